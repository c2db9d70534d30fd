"""The sampler/trainer log-prob gap under bf16 compute, with and without the float32 LM head.

    python benchmarks/head_gap.py [--steps 4] [--out outputs/bench-head-gap] [-- extra train args]

Runs ``maxent-grpo train`` (the built-in default: SmolLM2-135M on chain_sum) in bf16 twice from the
same seed: the trainer under bf16 autocast over float32 master weights (``model.dtype: bfloat16``),
the sampler a bf16 copy of the policy (``generation.dtype: bfloat16``), once with
``model.lm_head_fp32: false`` and once ``true``. Each step logs the gap between the sampler's
log-prob of every sampled token and the trainer's pre-update log-prob of it
(``sampling/sampling_logp_difference/{mean,rms,max}``, ``token_mult_prob_error``,
``sampling/importance_sampling_ratio/{min,max}``); the table gives them per step and their mean.
On a CPU without native bf16 (AVX2 only) bf16 matmuls are slow: the default 4 steps take minutes.

``--random-model qwen2.5-0.5b`` (the GPU check's ``gap-10`` stage: ``--steps 10``) runs instead the
model ``benchmarks/gpu.py`` trains, random weights from ``benchmarks/model_configs`` built on CUDA,
on its setting (``pair_sum`` with the digest reward, 8 prompts x 8 completions, 256 new tokens,
micro-batch 8; no final checkpoint); ``--random-model tiny``: the tiny model on a small batch (the
CPU check). Each head's table is printed as its run ends.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.determinism import _cpu  # noqa: E402

GAP = (("sampling/sampling_logp_difference/mean", "mean |d|"), ("sampling/sampling_logp_difference/rms", "rms d"),
       ("sampling/sampling_logp_difference/max", "max |d|"), ("token_mult_prob_error", "mean exp|d|"),
       ("sampling/importance_sampling_ratio/min", "ratio min"), ("sampling/importance_sampling_ratio/max", "ratio max"))


def _run(out: Path, steps: int, fp32: bool, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "maxent_grpo.cli", "train", "--output-dir", str(out), "--max-steps", str(steps),
           "--overwrite", "--set", "logging.progress_bar=false", "--set", "model.dtype=bfloat16",
           "--set", "generation.dtype=bfloat16", "--set", f"model.lm_head_fp32={str(fp32).lower()}", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def random_model_config(name: str, out: Path, steps: int) -> Path:
    """Our config for ``benchmarks/gpu.py``'s setting on the random ``name`` (``tiny``: the tiny model,
    2 prompts x 4 completions of 8 tokens), written under ``out``."""
    import torch

    from benchmarks.gpu import gpu_setting
    from benchmarks.model_paths import cache_root, random_model, resolve_model
    from benchmarks.ours import write_config

    tiny = name == "tiny"
    size = dict(prompts_per_step=2, num_generations=4, max_new_tokens=8, micro_batch_size=4) if tiny else \
        dict(prompts_per_step=8, num_generations=8, max_new_tokens=256, micro_batch_size=8)
    setting = gpu_setting(name, argparse.Namespace(steps=steps, **size))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = resolve_model(name) if tiny else random_model(name, cache_root() / "random" / name, device=device)
    return write_config(setting, model, out / "config.yaml", extra={"checkpoint": {"save_final": False}})


def _device() -> str:
    import torch

    return f"GPU: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else f"CPU: {_cpu()}"


def table(runs: dict[str, list[dict]]) -> str:
    lines = ["| LM head | step | " + " | ".join(name for _, name in GAP) + " |",
             "|---|---|" + "---|" * len(GAP)]
    for head, rows in runs.items():
        for r in rows:
            lines.append(f"| {head} | {r['step']} | " + " | ".join(f"{r[k]:.4f}" for k, _ in GAP) + " |")
        means = [sum(r[k] for r in rows) / len(rows) for k, _ in GAP]
        lines.append(f"| {head} | mean | " + " | ".join(f"**{v:.4f}**" for v in means) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench-head-gap")
    parser.add_argument("--random-model", metavar="NAME",
                        help="benchmarks/gpu.py's model and setting instead of the built-in default: "
                             "qwen2.5-0.5b (random weights), or tiny (the CPU check)")
    parser.add_argument("extra", nargs="*", help="after --: more train arguments, the same for both runs")
    args = parser.parse_args(argv)
    extra = args.extra
    if args.random_model is not None:
        extra = ["--config", str(random_model_config(args.random_model, args.out, args.steps)), *extra]
    device = _device()
    print(device)
    for head in ("bf16", "float32"):
        rows = _run(args.out / head, args.steps, head == "float32", extra)
        print(f"\n### The sampler/trainer log-prob gap, LM head {head} ({device})\n\n{table({head: rows})}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
