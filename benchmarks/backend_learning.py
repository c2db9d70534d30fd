"""Learning of the built-in default run through each sampler, over seeds, at equal steps.

    python benchmarks/backend_learning.py [--settings hf vllm:0 vllm:1 vllm_server:0 vllm_server:1]
        [--seeds 0 1 2] [--steps 15] [--server-dtype bfloat16] [--out outputs/backend-learning]
        [-- extra train args]

A setting is ``BACKEND[:MAX_STALENESS]`` (``generation.backend`` and ``rollout.max_staleness``,
0 when left out). ``hf`` runs in this interpreter on both cores; ``vllm`` (an engine in the
trainer's process) runs the trainer in ``.venv-vllm``; ``vllm_server`` starts one
``maxent-grpo serve`` (the default model, ``--server-dtype``) bound to core 0 with one thread,
kept for all its runs (each run pushes its own start weights first), and runs the trainer
bound to core 1 with one thread, as ``benchmarks/async_rollouts.py`` does (``--cores`` moves
them). Runs go one after another. Prints one row per run: the mean reward over the first and
the last fifth of the steps, the mean token entropy and completion length (first and last fifth), and the
sampler/trainer log-prob difference (``sampling/sampling_logp_difference/mean``, first and
last fifth), the lowest step reward with its step, and the bare zero-reward answers (at most
``BARE_TOKENS`` tokens, e.g. ``1<|im_end|>``: the answers the weighted MLE favours per token,
BENCHMARKS.md §7b) at step 1 and over all steps. Then, per setting, the runs whose lowest
step reward is below ``--dip`` and the pooled step-1 bare answers, each against ``hf`` with
Fisher's exact test (step 1 samples every backend from the same weights and prompts).
A finished run (its ``metrics.jsonl`` has ``--steps`` rows) is read, not rerun;
``OUT/summary.json`` keeps each run's per-step reward, mean length and bare-answer count.
"""

from __future__ import annotations

import argparse
import json
import math
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
BARE_TOKENS = 3  # a one- or two-digit number and the end-of-turn token


def fifths(rows: list[dict], key: str) -> tuple[float, float] | None:
    """Mean of ``key`` over the first and the last fifth of ``rows`` (None where no row has it)."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    if not vals:
        return None
    n = max(1, len(vals) // 5)
    return sum(vals[:n]) / n, sum(vals[-n:]) / n


def bare_answers(run: Path, steps: int) -> list[tuple[int, int]]:
    """Per step, (zero-reward completions of at most ``BARE_TOKENS`` tokens, completions), from
    ``completions/step-N.jsonl``; (0, 0) for a step with no file."""
    out = []
    for step in range(1, steps + 1):
        path = run / "completions" / f"step-{step}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        out.append((sum(1 for r in rows if r["reward"] == 0 and r["length"] <= BARE_TOKENS), len(rows)))
    return out


def fisher_exact(a: int, b: int, c: int, d: int) -> float:
    """Two-sided Fisher exact p-value of the 2x2 table [[a, b], [c, d]]: the total hypergeometric
    probability (margins fixed) of the tables no likelier than the one seen."""
    row1, col1, n = a + b, a + c, a + b + c + d

    def prob(k: int) -> float:
        return math.comb(col1, k) * math.comb(n - col1, row1 - k) / math.comb(n, row1)

    seen = prob(a)
    ks = range(max(0, row1 + col1 - n), min(row1, col1) + 1)
    return min(1.0, sum(p for p in map(prob, ks) if p <= seen * (1 + 1e-9)))


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


def _finished(out: Path, steps: int) -> list[dict] | None:
    """A run's metrics rows when its ``metrics.jsonl`` has ``steps`` of them, else None."""
    metrics = out / "metrics.jsonl"
    if not metrics.exists():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return rows if len(rows) == steps else None


def _train(backend: str, k: int, seed: int, out: Path, steps: int, url: str | None, extra: list[str],
           trainer_core: int = 1) -> list[dict]:
    metrics = out / "metrics.jsonl"
    if (rows := _finished(out, steps)) is not None:
        return rows
    sets = ["logging.progress_bar=false", f"generation.backend={backend}", f"rollout.max_staleness={k}",
            "checkpoint.save_minutes=0", "checkpoint.save_final=false"]
    python = str(VLLM_PYTHON) if backend == "vllm" else sys.executable
    cmd = [python, "-m", "maxent_grpo.cli", "train", "--output-dir", str(out), "--overwrite", "--max-steps",
           str(steps), "--seed", str(seed)]
    core = None
    if backend == "vllm_server":
        sets.append(f"generation.vllm.server_url={url}")
        cmd, core = ["taskset", "-c", str(trainer_core), *cmd], trainer_core
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
    parser.add_argument("--cores", type=int, nargs=2, default=[0, 1], metavar=("SERVER", "TRAINER"),
                        help="vllm_server: the server's core and the trainer's (the same core: they take turns "
                        "at max_staleness 0)")
    parser.add_argument("--dip", type=float, default=0.2, help="a run dips when its lowest step reward is below this")
    parser.add_argument("extra", nargs="*", help="arguments passed to maxent-grpo train (after --)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    proc = url = None
    table = []
    try:
        if any(b == "vllm_server" and _finished(out / f"{b}-k{k}-seed{seed}", args.steps) is None
               for b, k in args.settings for seed in args.seeds):  # a server only for runs still to do
            os.environ.update(VLLM_CPU_OMP_THREADS_BIND=str(args.cores[0]), OMP_NUM_THREADS="1")
            # A step's prompts in one prefill (docs/VLLM.md: the CPU build fails a seeded request whose
            # prefill is split over two engine steps).
            proc, url = start_server(args.model, out / "server.log", dtype=args.server_dtype,
                                     python=str(VLLM_PYTHON), taskset=str(args.cores[0]),
                                     vllm_args=("--max-num-batched-tokens", "16384"))
            for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
                os.environ.pop(key)
        for backend, k in args.settings:
            for seed in args.seeds:
                name = f"{backend}-k{k}-seed{seed}"
                t0 = time.perf_counter()
                rows = _train(backend, k, seed, out / name, args.steps, url, args.extra, args.cores[1])
                table.append((backend, k, seed, rows, bare_answers(out / name, args.steps)))
                print(f"{name}: {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
    print("\n| backend | max_staleness | seed | " + " | ".join(f"{c} first -> last" for c, _ in COLUMNS)
          + " | lowest reward (step) | bare zero-reward answers: step 1, all |")
    print("|---|---|---|" + "---|" * (len(COLUMNS) + 2))
    for backend, k, seed, rows, bare in table:
        print(f"| {backend} | {k} | {seed} | {table_cells(rows)} | {bare_cells(bare)} |")
    print()
    for line in comparison(table, args.dip):
        print(line)
    (out / "summary.json").write_text(json.dumps({
        f"{backend}-k{k}-seed{seed}": {
            "backend": backend, "max_staleness": k, "seed": seed,
            "reward": [r["reward"] for r in rows], "mean_length": [r.get("completions/mean_length") for r in rows],
            "bare_zero_reward": [b for b, _ in bare], "completions": [n for _, n in bare]}
        for backend, k, seed, rows, bare in table}, indent=1) + "\n")


def bare_cells(bare: list[tuple[int, int]]) -> str:
    """``first/n, total/N`` of one run's bare zero-reward answers (step 1, then all steps)."""
    if not bare or not bare[0][1]:
        return "-"
    return f"{bare[0][0]}/{bare[0][1]}, {sum(b for b, _ in bare)}/{sum(n for _, n in bare)}"


def comparison(table: list[tuple], dip: float) -> list[str]:
    """Per setting: runs that dip (lowest step reward < ``dip``) and step-1 bare answers, each with
    Fisher's two-sided p against ``hf`` at the same max_staleness when that setting ran."""
    runs: dict[tuple[str, int], list[tuple[bool, int, int]]] = {}
    for backend, k, _seed, rows, bare in table:
        first = bare[0] if bare else (0, 0)
        runs.setdefault((backend, k), []).append((min(r["reward"] for r in rows) < dip, *first))
    lines = []
    for (backend, k), got in runs.items():
        dips, bare1, n1 = sum(d for d, _, _ in got), sum(b for _, b, _ in got), sum(n for _, _, n in got)
        line = f"{backend}:{k}: {dips}/{len(got)} runs dip below {dip}; step-1 bare answers {bare1}/{n1}"
        base = runs.get(("hf", k))
        if base is not None and backend != "hf":
            hd, hb, hn = sum(d for d, _, _ in base), sum(b for _, b, _ in base), sum(n for _, _, n in base)
            line += (f" (hf: {hd}/{len(base)}, Fisher p {fisher_exact(dips, len(got) - dips, hd, len(base) - hd):.3g};"
                     f" {hb}/{hn}, p {fisher_exact(bare1, n1 - bare1, hb, hn - hb):.3g})")
        lines.append(line)
    return lines


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
