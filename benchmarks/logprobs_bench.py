"""Time and peak memory of chunked vs naive per-token log-probs + entropies (CPU).

    python benchmarks/logprobs_bench.py              # B=32, T=256, V=49152, fp32 and bf16
    python benchmarks/logprobs_bench.py --small      # a tiny size, a few seconds

Every (dtype, variant) runs in a fresh subprocess. Peak memory is the process's
resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``
after the inputs exist) minus the resident set at that moment, so the input
logits and targets are not counted; the first call is the one measured (no
warm-up before it, so freed-but-cached memory cannot hide allocations). Time is
the median of ``--reps`` further calls.

Variants:
  chunked fwd      selective_logps(..., with_entropy=True) under no_grad
  chunked fwd+bwd  the same with grad, then backward of a random combination
  naive fwd        log_softmax over the full tensor, gather, entropy from it
  naive fwd+bwd    the same with grad and backward
  head+chunked-fwd+bwd  from hidden states [B, T, H] and an LM head [V, H]: the logits
                   (F.linear), then chunked fwd+bwd; the gradient reaches hidden and head
  fused-fwd+bwd    the same through fused_lm_head.lm_head_logps (no [B, T, V] logits)

For the two head variants the inputs are the hidden states and the head weight,
so their peak includes the logits the first one builds.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("chunked-fwd", "naive-fwd", "chunked-fwd+bwd", "naive-fwd+bwd")
HEAD_VARIANTS = ("head+chunked-fwd+bwd", "fused-fwd+bwd")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _status_kib(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {field}")
    return int(match.group(1))


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def _measure(args: argparse.Namespace, dtype_name: str, variant: str) -> dict:
    import torch

    from maxent_grpo.core.logprobs import selective_logps

    torch.manual_seed(0)
    dtype = getattr(torch, DTYPES[dtype_name])
    b, t, v = args.batch, args.seq, args.vocab
    if variant in HEAD_VARIANTS:
        return _measure_head(args, dtype, variant)
    # Fill row by row so no full-size float32 temporary raises the high-water mark.
    logits = torch.empty((b, t, v), dtype=dtype)
    for i in range(b):
        logits[i].copy_(torch.randn(t, v) * 2.0)
    targets = torch.randint(0, v, (b, t))
    coef_lp, coef_h = torch.randn(b, t), torch.randn(b, t)
    chunked = variant.startswith("chunked")
    backward = variant.endswith("bwd")

    def naive(x):
        ls = torch.log_softmax(x if args.temperature == 1.0 else x / args.temperature, -1, dtype=torch.float32)
        lp = ls.gather(-1, targets[..., None]).squeeze(-1)
        ent = -(ls.exp() * ls).sum(-1)
        return lp, ent

    def chunk(x):
        return selective_logps(
            x, targets, temperature=args.temperature, with_entropy=True, chunk_rows=args.chunk_rows
        )

    fn = chunk if chunked else naive

    def call() -> None:
        if backward:
            x = logits.requires_grad_()
            lp, ent = fn(x)
            (lp * coef_lp + ent * coef_h).sum().backward()
            x.grad = None
        else:
            with torch.no_grad():
                fn(logits)

    return _time_and_peak(args, call, logits.numel() * logits.element_size() / 2**20)


def _measure_head(args: argparse.Namespace, dtype, variant: str) -> dict:
    import torch

    from maxent_grpo.core.fused_lm_head import lm_head_logps
    from maxent_grpo.core.logprobs import selective_logps

    b, t, v, h = args.batch, args.seq, args.vocab, args.hidden
    hidden = (torch.randn(b, t, h) * 2.0).to(dtype).requires_grad_()
    weight = (torch.randn(v, h) / h**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (b, t))
    coef_lp, coef_h = torch.randn(b, t), torch.randn(b, t)

    def call() -> None:
        if variant == "fused-fwd+bwd":
            lp, ent = lm_head_logps(hidden, weight, None, targets, temperature=args.temperature,
                                    with_entropy=True, chunk_rows=args.chunk_rows)
        else:
            logits = torch.nn.functional.linear(hidden, weight)
            lp, ent = selective_logps(logits, targets, temperature=args.temperature, with_entropy=True,
                                      chunk_rows=args.chunk_rows)
        (lp * coef_lp + ent * coef_h).sum().backward()
        hidden.grad = weight.grad = None

    return _time_and_peak(args, call, (hidden.numel() + weight.numel()) * hidden.element_size() / 2**20)


def _time_and_peak(args: argparse.Namespace, call, inputs_mib: float) -> dict:
    baseline = _status_kib("VmRSS")
    reset = _reset_peak()
    call()
    peak = _status_kib("VmHWM") - baseline
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"peak_mib": peak / 1024, "time_s": statistics.median(times), "inputs_mib": inputs_mib, "peak_reset": reset}


def _run_variant(args: argparse.Namespace, dtype: str, variant: str) -> dict:
    if args.in_process:
        return _measure(args, dtype, variant)
    cmd = [
        sys.executable, __file__, "--worker", variant, "--dtype", dtype,
        "--batch", str(args.batch), "--seq", str(args.seq), "--vocab", str(args.vocab),
        "--reps", str(args.reps), "--chunk-rows", str(args.chunk_rows), "--temperature", str(args.temperature),
        "--hidden", str(args.hidden),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    from maxent_grpo.core.logprobs import DEFAULT_CHUNK_ROWS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--small", action="store_true",
        help="B=2, T=16, V=512, 1 repetition, in one process (a smoke run; its memory figures mean nothing)",
    )
    parser.add_argument(
        "--in-process", action="store_true",
        help="run every variant in this process (fast, but peak memory is then not per variant)",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576, help="hidden size of the head variants (SmolLM2's 576)")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "both"], default="both")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of " + ", ".join(VARIANTS + HEAD_VARIANTS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--chunk-rows", type=int, default=DEFAULT_CHUNK_ROWS)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--worker", choices=VARIANTS + HEAD_VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(_measure(args, args.dtype, args.worker)))
        return
    if args.small:
        args.batch, args.seq, args.vocab, args.hidden, args.reps, args.in_process = 2, 16, 512, 32, 1, True
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS + HEAD_VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}")
    dtypes = ["fp32", "bf16"] if args.dtype == "both" else [args.dtype]

    print(f"B={args.batch} T={args.seq} V={args.vocab} chunk_rows={args.chunk_rows} "
          f"temperature={args.temperature} reps={args.reps} (median time; peak RSS above inputs)")
    print(f"load average at start: {_load()} (timings on a shared machine move with it)")
    print(f"{'dtype':<6}{'variant':<22}{'time [s]':>10}{'peak [MiB]':>12}{'inputs [MiB]':>14}")
    results = {}
    for dtype in dtypes:
        for variant in variants:
            r = _run_variant(args, dtype, variant)
            results[dtype, variant] = r
            print(f"{dtype:<6}{variant:<22}{r['time_s']:>10.3f}{r['peak_mib']:>12.1f}{r['inputs_mib']:>14.1f}", flush=True)
            if not r["peak_reset"]:
                print("  (could not reset VmHWM: peak includes everything since start-up)")
    print(f"load average at end: {_load()}")
    for dtype in dtypes:
        for mode in ("fwd", "fwd+bwd"):
            c, n = results.get((dtype, f"chunked-{mode}")), results.get((dtype, f"naive-{mode}"))
            if c is None or n is None:
                continue
            mem = c["peak_mib"] / n["peak_mib"] if n["peak_mib"] > 0 else float("nan")
            print(f"{dtype} {mode}: chunked/naive memory {mem:.3f}, time {c['time_s'] / n['time_s']:.3f}"
                  "  (targets: memory <= 0.25, time <= 1)")
        f, c = results.get((dtype, "fused-fwd+bwd")), results.get((dtype, "head+chunked-fwd+bwd"))
        if f is not None and c is not None:
            print(f"{dtype} from hidden states: fused/head+chunked memory {f['peak_mib'] / c['peak_mib']:.3f}, "
                  f"time {f['time_s'] / c['time_s']:.3f}")


if __name__ == "__main__":
    main()
