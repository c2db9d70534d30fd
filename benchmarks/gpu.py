"""Ours against TRL on one GPU: tokens/s, step time and peak memory by phase (issue 21 §9).

    python benchmarks/gpu.py --plan                      # what it would run, and each memory plan (no GPU needed)
    python benchmarks/gpu.py --models qwen2.5-0.5b,qwen2.5-1.5b --steps 4

Each model is built with random weights from a ``config.json`` kept in ``benchmarks/model_configs``
(``benchmarks.model_paths.random_model``: nothing is downloaded, the shapes, speed and memory are
real). Each side trains it in a fresh process (``benchmarks/gpu_side.py``) with HF generation,
the same prompts (prompt-id hashes checked, as ``run.py`` does), sampling, rewards, optimizer
and micro-batch, bf16 compute over float32 master weights on both. The table gives, over the
steps after the first (warm-up), the median seconds per step and per phase (generate, score,
update; see ``gpu_side.py``), completion tokens per second per GPU, and each phase's peak
``torch.cuda.max_memory_allocated``. A model whose memory plan (``memory_plan.py``) does not fit
the GPU is skipped with the plan's figure (7B: full fine-tuning with AdamW needs ~16 bytes per
parameter, more than one 80 GiB GPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# bitsandbytes, imported through transformers/peft, warns on CPUs with AVX-512 bf16 that its optional 4-bit
# CPU kernel cannot be fetched; that would break the one-line refusal a machine without CUDA gets.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

from benchmarks.children import ChildFailed, child_env, python_module_cmd, run_child  # noqa: E402
from benchmarks.memory_plan import Shape, fits, format_plan, peak_gib, plan  # noqa: E402
from benchmarks.model_paths import MODEL_CONFIGS, cache_root, random_model_names  # noqa: E402
from benchmarks.ours import write_config  # noqa: E402
from benchmarks.results import RunResult, prompt_mismatch  # noqa: E402
from benchmarks.settings import LORA_TARGETS, BenchSetting  # noqa: E402
from maxent_grpo.config.load import load_config  # noqa: E402

SIDES = ("ours", "trl", "trl-static")  # trl-static: TRL with cache_implementation static
PHASES = ("generate", "score", "update")
GIB = 2**30


def gpu_setting(model: str, args: argparse.Namespace) -> BenchSetting:
    return BenchSetting(
        # pair_sum (benchmarks/pair_sum.py) needs no reasoning-gym, which the GPU machine lacks; with random
        # weights the text is noise anyway, the token counts are what is measured.
        name=f"gpu-{model}", model=model, task="pair_sum", dataset_size=256, prompts_per_step=args.prompts_per_step,
        num_generations=args.num_generations, max_new_tokens=args.max_new_tokens,
        micro_batch_size=args.micro_batch_size, bf16=True, learning_rate=1e-6, steps=args.steps, device="cuda",
        digest_reward=True,  # random weights score 0 on the task: a reward with signal in every group
    )


def memory_plan(setting: BenchSetting, args: argparse.Namespace) -> tuple[str, bool]:
    """Our trainer's memory plan for ``setting`` on one GPU, and whether it fits."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(write_config(setting, Path(tmp) / setting.model, Path(tmp) / "config.yaml"))
    shape = Shape.from_config(json.loads((MODEL_CONFIGS / f"{setting.model}.json").read_text()))
    rows = plan(cfg, shape, 1, args.gpu_memory_gib, args.prompt_tokens)
    return format_plan(rows, cfg, 1, args.gpu_memory_gib), fits(peak_gib(rows, cfg)[1], args.gpu_memory_gib)


def planned(model: str, args: argparse.Namespace) -> tuple[BenchSetting, str, bool]:
    """The setting a model runs with, its memory plan and whether it fits: full fine-tuning, or LoRA
    of rank ``--lora-r`` when full fine-tuning does not fit one GPU (7B)."""
    setting = gpu_setting(model, args)
    text, fit = memory_plan(setting, args)
    if not fit and args.lora_r:
        setting = setting.replace(name=f"{setting.name}-lora{args.lora_r}", lora_r=args.lora_r)
        text, fit = memory_plan(setting, args)
    return setting, text, fit


def describe(models: list[str], args: argparse.Namespace) -> str:
    lines = [f"benchmarks/gpu.py would run {', '.join(args.sides)} on one GPU of {args.gpu_memory_gib:g} GiB, each "
             f"side in a fresh process, HF generation, {args.steps} steps per run (the first a warm-up)."]
    for model in models:
        s, text, fit = planned(model, args)
        shape = Shape.from_config(json.loads((MODEL_CONFIGS / f"{s.model}.json").read_text()))
        lines += ["", f"## {s.name}: random weights from benchmarks/model_configs/{s.model}.json "
                      f"({shape.params() / 1e9:.2f}B parameters, V={shape.vocab})",
                  f"{s.task}, P={s.prompts_per_step} G={s.num_generations} max_new_tokens={s.max_new_tokens} "
                  f"micro={s.micro_batch_size}, bf16 compute over float32 master weights, lr {s.learning_rate:g}, "
                  f"beta {s.beta:g}, loss {s.loss_type}" + (f", LoRA r={s.lora_r} on {', '.join(LORA_TARGETS)}"
                                                           if s.lora_r else ", full fine-tuning"), "", text, "",
                  "runs" if fit else "SKIPPED: our memory plan does not fit one GPU"]
    return "\n".join(lines)


def _median_after_warmup(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def table(setting: BenchSetting, runs: dict[str, RunResult], params: float, peak_tflops: float) -> str:
    """Medians over the steps after the first; tokens are completion tokens. ``train MFU`` is the
    update phase's ``6 * params * completion tokens / seconds`` over ``peak_tflops`` (a lower bound:
    the prompt tokens' share of the forward and backward is not counted)."""
    lines = [f"### {setting.name} ({next(iter(runs.values())).extra['gpu']})", "",
             "| side | s/step | " + " | ".join(f"{p} s" for p in PHASES) + " | tokens/s per GPU | "
             + " | ".join(f"{p} tokens/s" for p in PHASES) + " | train MFU | "
             + " | ".join(f"peak GiB {p}" for p in PHASES) + " |",
             "|---|" + "---|" * (3 + 3 * len(PHASES))]
    tokens_per_s = {}
    for side, r in runs.items():
        phases = r.extra["phases"]
        seconds = {p: _median_after_warmup([s[p]["seconds"] for s in phases]) for p in PHASES}
        step = _median_after_warmup([sum(s[p]["seconds"] for p in PHASES) for s in phases])
        tokens = _median_after_warmup([t / sum(s[p]["seconds"] for p in PHASES)
                                       for t, s in zip(r.completion_tokens, phases)])
        per_phase = {p: _median_after_warmup([t / max(s[p]["seconds"], 1e-9) for t, s in zip(r.completion_tokens, phases)])
                     for p in PHASES}
        mfu = 6 * params * per_phase["update"] / (peak_tflops * 1e12)
        peaks = {p: max(s[p]["peak_bytes"] for s in phases) / GIB for p in PHASES}
        tokens_per_s[side] = tokens
        lines.append(f"| {side} | {step:.2f} | " + " | ".join(f"{seconds[p]:.2f}" for p in PHASES)
                     + f" | {tokens:.0f} | " + " | ".join(f"{per_phase[p]:.0f}" for p in PHASES)
                     + f" | {mfu:.1%} | " + " | ".join(f"{peaks[p]:.1f}" for p in PHASES) + " |")
    if "ours" in tokens_per_s and tokens_per_s.keys() & {"trl", "trl-static"}:
        lines += ["", "ours/TRL tokens/s: " + ", ".join(
            f"{tokens_per_s['ours'] / tokens_per_s[side]:.2f}x against {side}" for side in ("trl", "trl-static")
            if side in tokens_per_s)]
    if "trl-static" in runs:  # benchmarks/trl_runner.py: the one side whose weights are not float32
        lines += ["* trl-static trains bfloat16 weights (transformers 5.17's static cache takes no autocast keys "
                  "over float32 ones); ours and trl keep float32 master weights under bf16 autocast"]
    return "\n".join(lines)


def run_model(setting: BenchSetting, args: argparse.Namespace, work: Path,
              done: Callable[[dict[str, RunResult]], None]) -> tuple[dict[str, RunResult], list[str]]:
    """Each side's result, and one error per side that failed (the others still run); ``done`` is
    called with the results so far after each side that finishes."""
    env = child_env(None)
    model_dir = cache_root() / "random" / setting.model
    # Built in a child on the GPU: this process keeps no CUDA memory the sides would miss.
    run_child([sys.executable, "-c", "import sys; from pathlib import Path; from benchmarks.model_paths import "
               "random_model; random_model(sys.argv[1], Path(sys.argv[2]), device='cuda')",
               setting.model, str(model_dir)], work / "build.log", env)
    setting.to_json(work / "setting.json")
    runs, failed = {}, []
    for side in args.sides:
        out = work / side / "result.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            child = run_child(python_module_cmd("benchmarks.gpu_side", "--side", side, "--setting",
                                                str(work / "setting.json"), "--model-dir", str(model_dir), "--out",
                                                str(out)), work / side / f"{side}.log", env, args.timeout)
        except ChildFailed as err:
            failed.append(f"{setting.name} {side}: {err}")
            continue
        runs[side] = RunResult.from_json(out)
        runs[side].peak_rss_bytes = child.peak_rss_bytes
        done(runs)
    return runs, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Ours vs TRL on one GPU: tokens/s, step time and peak memory by phase.")
    p.add_argument("--plan", action="store_true", help="print what would run and the memory plans, run nothing")
    p.add_argument("--models", default=",".join(random_model_names()),
                   help="comma-separated, of the kept configs (default: all; one that does not fit is skipped)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated subset of {','.join(SIDES)}")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128, help="longest prompt, for the memory plan")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="for the plan (a run reads the GPU's own)")
    p.add_argument("--lora-r", type=int, default=16,
                   help="LoRA rank for a model whose full fine-tuning does not fit one GPU (0: skip such a model)")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="the GPU's dense bf16 peak for MFU (H100 SXM: 989)")
    p.add_argument("--timeout", type=float, help="seconds allowed per side")
    p.add_argument("--work-dir", type=Path)
    p.add_argument("--json-out", type=Path, help="write every run's raw result here")
    args = p.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in random_model_names()] + [s for s in args.sides if s not in SIDES]
    if unknown:
        p.error(f"unknown model or side {unknown}: models are {random_model_names()}, sides {list(SIDES)}")
    if args.plan:
        print(describe(models, args))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: no CUDA device here (torch {torch.__version__}, CUDA {torch.version.cuda}); "
              "it runs on a GPU machine (--plan shows what it would run)", file=sys.stderr)
        return 2
    args.gpu_memory_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="maxent-gpu-bench-"))
    raw, errors = {}, []
    for model in models:
        setting, text, fit = planned(model, args)
        if not fit:
            print(f"{setting.name}: skipped, our memory plan does not fit {args.gpu_memory_gib:.0f} GiB:\n{text}\n")
            continue
        shape = Shape.from_config(json.loads((MODEL_CONFIGS / f"{setting.model}.json").read_text()))

        def done(runs, setting=setting, shape=shape):  # the table so far: a stage cut later keeps it
            print(table(setting, runs, shape.params(), args.peak_tflops) + "\n", flush=True)

        runs, side_errors = run_model(setting, args, work / setting.name, done)
        for line in side_errors:
            print(f"FAILED: {line}", file=sys.stderr, flush=True)
        errors += side_errors
        if not runs:
            continue
        mismatch = prompt_mismatch({side: [r] for side, r in runs.items()})
        if mismatch is not None:
            print(f"FAILED: the sides did not train on the same prompts: {mismatch} (raw results in {work})",
                  file=sys.stderr)
            return 1
        raw[setting.name] = {side: r.__dict__ for side, r in runs.items()}
    print(f"* medians over steps 2-{args.steps}; raw results in {work}")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(raw, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
