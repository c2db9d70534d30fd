"""Step time of rollout.max_staleness 1 against 0 with vLLM's server, server and trainer one core each.

    python benchmarks/async_rollouts.py [--steps 8] [--repeats 2] [--out outputs/bench-async] [-- extra train args]

Starts ``maxent-grpo serve`` (the default model, in ``.venv-vllm``) bound to core 0
with one thread, and runs the built-in default training against it with
``generation.backend: vllm_server``, bound to core 1 with one thread, for each
``max_staleness`` in turn (alternating, ``--repeats`` times). Prints per setting the
mean step time over the steps after the first, and where each side waited:

* trainer waits: the trainer's time blocked on rollouts (synchronous: all of
  generation, ``time/generate``; asynchronous: ``time/wait_rollouts``);
* sampler idle: the server's time with nothing to do (synchronous: the rest of the
  step; asynchronous: ``time/sampler_idle``, from its last batch to its next request).

Needs both cores to itself: time nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from vllm_servers import start_server, stop_server  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def _one_core(core: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _train(url: str, k: int, out: Path, steps: int, dtype: str, extra: list[str]) -> list[dict]:
    cmd = ["taskset", "-c", "1", sys.executable, "-m", "maxent_grpo.cli", "train", "--output-dir", str(out),
           "--max-steps", str(steps),
           *[a for kv in (
               "logging.progress_bar=false", "generation.backend=vllm_server", f"generation.vllm.server_url={url}",
               f"generation.dtype={dtype}", f"rollout.max_staleness={k}", "checkpoint.save_minutes=0",
           ) for a in ("--set", kv)], *extra]
    subprocess.run(cmd, env=_one_core(1), check=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _sides(rows: list[dict], k: int) -> tuple[float, float, float]:
    """(step time, trainer waits, sampler idle) per step, mean over the steps after the first."""
    rest = rows[1:]
    step = statistics.mean(r["time/total"] for r in rest)
    if k == 0:
        wait = statistics.mean(r["time/generate"] for r in rest)
        idle = step - wait
    else:
        wait = statistics.mean(r["time/wait_rollouts"] for r in rest)
        idle = statistics.mean(r["time/sampler_idle"] for r in rest)
    return step, wait, idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", help="the server's dtype (and generation.dtype)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default="outputs/bench-async")
    parser.add_argument("extra", nargs="*", help="arguments passed to maxent-grpo train (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server_env = {"VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in server_env}
    os.environ.update(server_env)
    try:
        # A step's prompts in one prefill: vLLM's CPU build (0.32) fails a seeded request whose prefill is
        # split over two engine steps ("CPU Generator does not use offset"), docs/VLLM.md.
        proc, url = start_server(args.model, out / "server.log", dtype=args.dtype, python=str(VLLM_PYTHON),
                                 taskset="0", vllm_args=("--max-num-batched-tokens", "16384"))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    results: dict[int, list[tuple[float, float, float]]] = {0: [], 1: []}
    try:
        for rep in range(args.repeats):
            for k in (0, 1):
                t0 = time.perf_counter()
                rows = _train(url, k, out / f"k{k}-{rep}", args.steps, args.dtype, args.extra)
                results[k].append(_sides(rows, k))
                print(f"max_staleness={k} repeat {rep}: {time.perf_counter() - t0:.0f} s wall", flush=True)
    finally:
        stop_server(proc)
    sync_step = statistics.mean(s for s, _, _ in results[0])
    print(f"\n| max_staleness | step time (s) | vs sync | trainer waits (s/step) | sampler idle (s/step) |")
    print("|---|---|---|---|---|")
    for k, runs in results.items():
        step = statistics.mean(s for s, _, _ in runs)
        wait = statistics.mean(w for _, w, _ in runs)
        idle = statistics.mean(i for _, _, i in runs)
        print(f"| {k} | {step:.2f} | {step / sync_step:.2f}x | {wait:.2f} | {idle:.2f} |")


if __name__ == "__main__":
    main()
