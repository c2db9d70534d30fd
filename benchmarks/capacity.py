"""A capacity model on paper: step time and tokens/s per GPU at 1, 8 and 64 GPUs, for Qwen2.5-1.5B and 7B,
with the engine colocated on every training GPU or on generation servers of their own.

Built from measured single-GPU figures and stated fabric bandwidths (docs/SCALING.md, "Capacity on paper"):

    python benchmarks/capacity.py                      # the table, with this file's inputs
    python benchmarks/capacity.py --measure-disk DIR   # measure DIR's write and read bandwidth first (4 GiB file)

Every GPU trains on its own ``P x G`` completions per step (``training.prompts_per_step`` is per process), so
the per-GPU work of a step is the measured one and the cluster adds what the step must move:

* colocated, N GPUs:  t = t_gen + t_upd + t_grad(N) + t_push(N)
* server, one step of staleness (``rollout.max_staleness: 1``), the N GPUs split between generators and
  trainers as generation and update split one GPU's step (generators = round(N x t_gen / (t_gen + t_upd))):
  t = max(t_gen x trainers / generators, t_upd + t_grad(trainers)) + t_sync
* t_grad(n) = 2 x 4 B x params x (n - 1) / n / B_bus(n)   (ring all-reduce of float32 gradients, not overlapped)
* t_push(n) = 2 B x params x (n - 1) / n / B_bus(n)       (FSDP2: gather the bf16 weights for the colocated engine)
* t_sync: disk: 2 B x params / B_write + 2 B x params / B_read; NCCL: 2 B x params / B_bus(N) (broadcast)
* tokens/s per GPU = trainers x tokens per step / t / N
* a layout whose training GPU would hold more than 80 GiB (18 B a parameter over the trainers, 8 GiB of
  activations, a colocated engine's 24 GiB) gets no row: it needs LoRA or more GPUs
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass
from pathlib import Path

# Measured on one H200 (BENCHMARKS.md §9, 2026-11-29, call 2; benchmarks/results/gpu-h200-2026-11-29/call2):
# Qwen2.5-1.5B, 8 prompts x 8 completions x 256 new tokens, compiled decoding, bf16 compute, micro-batch 8.
TOKENS_PER_STEP = 8 * 8 * 256
GEN_S_1_5B = 1.88
UPD_S_1_5B = 1.15
# Parameters (benchmarks/model_configs, checked by memory_plan.py against transformers' model on meta).
PARAMS = {"1.5B": 1.54e9, "7B": 7.62e9}
# Stated, not measured here: NVLink 4 all-reduce bus bandwidth within a node (NCCL tests on H100 SXM reach
# ~360-450 GB/s), and one 400 Gb/s InfiniBand NIC per GPU between nodes (50 GB/s, ~40 GB/s achieved).
NVLINK_GBS = 360.0
IB_GBS = 40.0
GPUS_PER_NODE = 8
# Memory (docs/SCALING.md's memory plan): float32 weights, gradients and AdamW (16 B a parameter) plus a bf16
# reference (2 B), sharded over the trainers by FSDP2; a colocated engine takes 0.3 of an 80 GiB GPU.
RESIDENT_BYTES_PER_PARAM = 18
GPU_GIB = 80.0
ENGINE_GIB = 24.0
ACTIVATIONS_GIB = 8.0
# Measured on this machine (2026-12-07, `measure_disk("/tmp", 4.0)` three times, medians; a virtual disk shared
# with other jobs: writes 0.19-0.53 GB/s fsync'd, reads 0.35-0.45 GB/s from outside the page cache):
DISK_WRITE_GBS = 0.28
DISK_READ_GBS = 0.41


@dataclass(frozen=True)
class Inputs:
    disk_write_gbs: float = DISK_WRITE_GBS
    disk_read_gbs: float = DISK_READ_GBS
    nvlink_gbs: float = NVLINK_GBS
    ib_gbs: float = IB_GBS


@dataclass(frozen=True)
class Row:
    model: str
    gpus: int
    layout: str  # "colocated", "server, disk sync", "server, NCCL sync"
    trainers: int
    step_s: float | None  # None: the layout needs more GPUs
    tokens_per_gpu_s: float | None
    bottleneck: str


def single_gpu(model: str) -> tuple[float, float]:
    """(generate s, update s) of one GPU's step: measured at 1.5B, scaled by parameters for 7B (decoding
    reads every weight per token and the update's FLOPs are 6 x params per token: both linear at fixed MFU)."""
    scale = PARAMS[model] / PARAMS["1.5B"]
    return GEN_S_1_5B * scale, UPD_S_1_5B * scale


def bus_gbs(n: int, inputs: Inputs) -> float:
    """The collective bandwidth of n GPUs: NVLink within one node, the slowest link (InfiniBand) beyond."""
    return inputs.nvlink_gbs if n <= GPUS_PER_NODE else inputs.ib_gbs


def grad_s(params: float, n: int, inputs: Inputs) -> float:
    return 0.0 if n == 1 else 2 * 4 * params * (n - 1) / n / (bus_gbs(n, inputs) * 1e9)


def push_s(params: float, n: int, inputs: Inputs) -> float:
    return 0.0 if n == 1 else 2 * params * (n - 1) / n / (bus_gbs(n, inputs) * 1e9)


def sync_s(params: float, n: int, how: str, inputs: Inputs) -> float:
    if how == "disk":
        return 2 * params / (inputs.disk_write_gbs * 1e9) + 2 * params / (inputs.disk_read_gbs * 1e9)
    return 2 * params / (bus_gbs(n, inputs) * 1e9)


def resident_gib(model: str, trainers: int, engine: bool) -> float:
    """What one training GPU holds: its shard of the training state, activations and a colocated engine."""
    return RESIDENT_BYTES_PER_PARAM * PARAMS[model] / trainers / 2**30 + ACTIVATIONS_GIB + (ENGINE_GIB if engine else 0)


def colocated(model: str, n: int, inputs: Inputs) -> Row:
    gen, upd = single_gpu(model)
    params = PARAMS[model]
    if resident_gib(model, n, engine=True) > GPU_GIB:
        return Row(model, n, "colocated", n, None, None, f"memory: {resident_gib(model, n, engine=True):.0f} GiB a GPU")
    parts = {"generation": gen, "update": upd, "gradient all-reduce": grad_s(params, n, inputs),
             "weight gather for the engine": push_s(params, n, inputs)}
    step = sum(parts.values())
    return Row(model, n, "colocated", n, step, TOKENS_PER_STEP / step, max(parts, key=parts.get))


def server(model: str, n: int, how: str, inputs: Inputs) -> Row:
    layout = f"server, {how} sync"
    if n < 2:
        return Row(model, n, layout, 0, None, None, "needs 2 GPUs or more")
    gen, upd = single_gpu(model)
    params = PARAMS[model]
    # The split that balances the two sides: generators' share of the GPUs = generation's share of the step.
    generators = max(1, min(n - 1, round(n * gen / (gen + upd))))
    trainers = n - generators
    if resident_gib(model, trainers, engine=False) > GPU_GIB:
        return Row(model, n, layout, trainers, None, None, f"memory: {resident_gib(model, trainers, engine=False):.0f} GiB a GPU")
    produce = gen * trainers / generators
    train = upd + grad_s(params, trainers, inputs)
    sync = sync_s(params, n, how, inputs)
    step = max(produce, train) + sync
    parts = {"generation": produce, "update": train, "weight sync": sync}
    return Row(model, n, layout, trainers, step, trainers * TOKENS_PER_STEP / step / n, max(parts, key=parts.get))


def table(inputs: Inputs) -> list[Row]:
    rows = []
    for model in PARAMS:
        for n in (1, 8, 64):
            rows += [colocated(model, n, inputs), server(model, n, "disk", inputs), server(model, n, "NCCL", inputs)]
    return rows


def markdown(rows: list[Row]) -> str:
    lines = ["| model | GPUs | layout | trainers | step s | tokens/s per GPU | largest part |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        step = "-" if r.step_s is None else f"{r.step_s:.2f}"
        rate = "-" if r.tokens_per_gpu_s is None else f"{r.tokens_per_gpu_s:,.0f}"
        lines.append(f"| {r.model} | {r.gpus} | {r.layout} | {r.trainers or '-'} | {step} | {rate} | {r.bottleneck} |")
    return "\n".join(lines)


def measure_disk(folder: Path, size_gib: float = 4.0) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one file of ``size_gib`` in ``folder``: written in 64 MiB blocks and fsync'd,
    then dropped from the page cache (posix_fadvise) and read back; the file is removed."""
    block = os.urandom(64 << 20)
    count = max(1, int(size_gib * 1024 / 64))
    path = folder / f".capacity-disk-{os.getpid()}"
    try:
        start = time.perf_counter()
        with open(path, "wb") as fh:
            for _ in range(count):
                fh.write(block)
            fh.flush()
            os.fsync(fh.fileno())
        write_s = time.perf_counter() - start
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            while os.read(fd, 64 << 20):
                pass
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    size = count * len(block) / 1e9
    return size / write_s, size / read_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure-disk", metavar="DIR", type=Path, help="measure DIR's disk bandwidth and use it")
    parser.add_argument("--disk-gib", type=float, default=4.0, help="size of the measured file (GiB)")
    parser.add_argument("--disk-write-gbs", type=float, default=DISK_WRITE_GBS)
    parser.add_argument("--disk-read-gbs", type=float, default=DISK_READ_GBS)
    parser.add_argument("--nvlink-gbs", type=float, default=NVLINK_GBS)
    parser.add_argument("--ib-gbs", type=float, default=IB_GBS)
    args = parser.parse_args(argv)
    write, read = args.disk_write_gbs, args.disk_read_gbs
    if args.measure_disk is not None:
        write, read = measure_disk(args.measure_disk, args.disk_gib)
        print(f"disk {args.measure_disk}: write {write:.2f} GB/s (fsync'd), read {read:.2f} GB/s (cold)")
    inputs = Inputs(disk_write_gbs=write, disk_read_gbs=read, nvlink_gbs=args.nvlink_gbs, ib_gbs=args.ib_gbs)
    print(markdown(table(inputs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
