"""Learning of the built-in default run through each sampler, over seeds, at equal steps.

    python benchmarks/backend_learning.py [--settings hf vllm:0 vllm:1 vllm_server:0 vllm_server:1]
        [--seeds 0 1 2] [--steps 15] [--server-dtype bfloat16] [--out outputs/backend-learning]
        [-- extra train args]

A setting is ``BACKEND[:MAX_STALENESS]`` (``generation.backend`` and ``rollout.max_staleness``,
0 when left out). ``hf`` runs in this interpreter on both cores; ``vllm`` (an engine in the
trainer's process) runs the trainer in ``.venv-vllm``; ``vllm_server`` starts one
``maxent-grpo serve`` (the default model, ``--server-dtype``) bound to core 0 with one thread,
kept for all its runs (each run pushes its own start weights first), and runs the trainer
bound to core 1 with one thread, as ``benchmarks/async_rollouts.py`` does. Runs go one after
another. Prints one row per run: the mean reward over the first and the last fifth of the
steps, the mean token entropy and completion length (first and last fifth), and the
sampler/trainer log-prob difference (``sampling/sampling_logp_difference/mean``, first and
last fifth), and the lowest step reward with its step. A finished run (its ``metrics.jsonl``
has ``--steps`` rows) is read, not rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from vllm_servers import start_server, stop_server  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
GAP = "sampling/sampling_logp_difference/mean"
COLUMNS = (("reward", "reward"), ("entropy", "entropy"), ("length", "completions/mean_length"), ("logp gap", GAP))


def fifths(rows: list[dict], key: str) -> tuple[float, float] | None:
    """Mean of ``key`` over the first and the last fifth of ``rows`` (None where no row has it)."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    if not vals:
        return None
    n = max(1, len(vals) // 5)
    return sum(vals[:n]) / n, sum(vals[-n:]) / n


def _setting(text: str) -> tuple[str, int]:
    backend, _, k = text.partition(":")
    if backend not in ("hf", "vllm", "vllm_server"):
        raise argparse.ArgumentTypeError(f"unknown backend {backend!r} in {text!r}")
    return backend, int(k or 0)


def _env(core: int | None) -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT / "src")}
    if core is not None:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(core))
    return env


def _train(backend: str, k: int, seed: int, out: Path, steps: int, url: str | None, extra: list[str]) -> list[dict]:
    metrics = out / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        if len(rows) == steps:
            return rows
    sets = ["logging.progress_bar=false", f"generation.backend={backend}", f"rollout.max_staleness={k}",
            "checkpoint.save_minutes=0", "checkpoint.save_final=false"]
    python = str(VLLM_PYTHON) if backend == "vllm" else sys.executable
    cmd = [python, "-m", "maxent_grpo.cli", "train", "--output-dir", str(out), "--overwrite", "--max-steps",
           str(steps), "--seed", str(seed)]
    core = None
    if backend == "vllm_server":
        sets.append(f"generation.vllm.server_url={url}")
        cmd, core = ["taskset", "-c", "1", *cmd], 1
    cmd += [a for kv in sets for a in ("--set", kv)] + extra
    env = _env(core)
    if backend == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    subprocess.run(cmd, env=env, check=True)
    return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", type=_setting, nargs="+",
                        default=[_setting(s) for s in ("hf", "vllm:0", "vllm:1", "vllm_server:0", "vllm_server:1")])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--server-dtype", default="bfloat16", help="the vLLM server's dtype")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default="outputs/backend-learning")
    parser.add_argument("extra", nargs="*", help="arguments passed to maxent-grpo train (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = url = None
    table = []
    try:
        if any(b == "vllm_server" for b, _ in args.settings):
            os.environ.update(VLLM_CPU_OMP_THREADS_BIND="0", OMP_NUM_THREADS="1")
            # A step's prompts in one prefill (docs/VLLM.md: the CPU build fails a seeded request whose
            # prefill is split over two engine steps).
            proc, url = start_server(args.model, out / "server.log", dtype=args.server_dtype,
                                     python=str(VLLM_PYTHON), taskset="0",
                                     vllm_args=("--max-num-batched-tokens", "16384"))
            for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
                os.environ.pop(key)
        for backend, k in args.settings:
            for seed in args.seeds:
                name = f"{backend}-k{k}-seed{seed}"
                t0 = time.perf_counter()
                rows = _train(backend, k, seed, out / name, args.steps, url, args.extra)
                table.append((backend, k, seed, rows))
                print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    print("\n| backend | max_staleness | seed | " + " | ".join(f"{c} first -> last" for c, _ in COLUMNS)
          + " | lowest reward (step) |")
    print("|---|---|---|" + "---|" * (len(COLUMNS) + 1))
    for backend, k, seed, rows in table:
        print(f"| {backend} | {k} | {seed} | {table_cells(rows)} |")


def table_cells(rows: list[dict]) -> str:
    """The table's cells of one run: each column's first -> last fifth, then its lowest step reward."""
    cells = []
    for _, key in COLUMNS:
        pair = fifths(rows, key)
        cells.append("-" if pair is None else f"{pair[0]:.3g} -> {pair[1]:.3g}")
    low = min(rows, key=lambda r: r["reward"])
    cells.append(f"{low['reward']:.3g} ({low['step']})")
    return " | ".join(cells)


if __name__ == "__main__":
    main()
