"""A run's memory plan per GPU, from its config and the model's ``config.json`` (no model is loaded).

    python benchmarks/memory_plan.py --config recipes/qwen2.5-1.5b-gsm8k-fsdp2.yaml \\
        --model-config benchmarks/model_configs/qwen2.5-1.5b.json --gpus 8 --gpu-memory-gib 80

Prints, per GPU, what the training phase holds (float32 master weights, gradients and
AdamW state of the trained parameters, sharded 1/N under FSDP2; the reference model;
on-policy distillation's teacher (``teacher:``, counted from its own ``config.json``); a sampling copy; the activations of one micro-batch; the LM head's logits) and what a
colocated vLLM engine takes. These are estimates for planning, not measurements:

* parameters are counted from ``config.json`` by ``training/model_shape.py``'s ``Shape`` (a
  Llama/Qwen2-style decoder; tests check the count against transformers' own model on the
  meta device);
* activations assume SDPA (no attention matrix kept) and count, per layer and token,
  the tensors autograd keeps: ``6h + 2 kv + 4i`` values in the compute dtype, or only
  the layer input ``h`` with ``training.gradient_checkpointing`` (plus one layer
  recomputed at a time): ``Shape.saved_values_per_token``, which ``training.micro_batch_size:
  auto`` sizes its budget from too; with ``auto`` the plan counts its first guess of rows;
* the logits are one micro-batch's completion positions in float32;
* allocator fragmentation, CUDA context (about 0.5 GiB) and NCCL buffers are not counted.

``--prompt-tokens`` is the longest prompt the run expects (the config does not know it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from maxent_grpo.rollout.backends import BACKENDS  # noqa: E402
from maxent_grpo.config.load import load_config  # noqa: E402
from maxent_grpo.config.compile import compile_run  # noqa: E402
from maxent_grpo.models import master_dtype  # noqa: E402
from maxent_grpo.training.precision import Machine  # noqa: E402
from maxent_grpo.training.model_shape import Shape  # noqa: E402,F401 (the plan counts from it)
from maxent_grpo.training.strategy import STRATEGIES  # noqa: E402

GIB = 2**30
_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}


def plan(cfg, shape: Shape, gpus: int, gpu_memory_gib: float, prompt_tokens: int,
         teacher: Shape | None = None) -> list[tuple[str, float, str]]:
    """Rows (what, GiB per GPU, how it was counted) for a loaded TrainConfig on ``gpus`` GPUs;
    ``teacher``: the teacher's shape, needed when the run has one."""
    run = compile_run(cfg, Machine(fast_bf16=True, cuda=True, processes=None))  # a GPU multiplies bf16 natively
    t, g, lora = cfg.training, cfg.generation, cfg.model.lora
    shard = gpus if STRATEGIES[t.strategy].collective_forward else 1
    p = shape.params()
    compute = _BYTES["bfloat16"] if run.model.autocast_bf16 else _BYTES[cfg.model.dtype]
    stored = _BYTES[master_dtype(cfg.model.dtype, lora.enabled)]
    trained = shape.lora_params(lora.r, lora.target_modules) if lora.enabled else p
    rows = [
        ("policy weights", stored * p / shard / GIB,
         f"{p / 1e9:.2f}B params x {stored} B" + (f" / {shard} (FSDP2)" if shard > 1 else "")),
    ]
    if lora.enabled:
        rows.append(("LoRA adapters (float32)", 4 * trained / GIB, f"{trained / 1e6:.1f}M params, r={lora.r}"))
    rows += [
        ("gradients (float32)", 4 * trained / shard / GIB, "one per trained parameter"),
        ("AdamW state (float32)", 8 * trained / shard / GIB, "exp_avg and exp_avg_sq"),
    ]
    if shard > 1:
        rows.append(("FSDP2 gathered layers", 2 * compute * shape.layer_params() / GIB,
                     "one decoder layer unsharded, one prefetched"))
    if run.method.needs_reference and not lora.enabled:
        rows.append(("reference model", _BYTES[cfg.model.dtype] * p / shard / GIB, f"in model.dtype {cfg.model.dtype}"))
    if run.teacher is not None:
        if teacher is None:
            raise ValueError(f"the run has a teacher ({run.teacher.name_or_path}): give its shape")
        tp = teacher.params()
        rows.append(("teacher model", _BYTES[run.teacher.dtype] * tp / shard / GIB,
                     f"{tp / 1e9:.2f}B params in teacher.dtype {run.teacher.dtype}"
                     + (f" / {shard} (FSDP2)" if shard > 1 else "")))
    backend = BACKENDS[g.backend]
    copy = run.sampler.sample_dtype
    if not backend.owns_weights and copy not in (None, master_dtype(cfg.model.dtype, lora.enabled)):
        rows.append(("sampling copy", _BYTES[copy] * p / GIB, f"generation.dtype {copy}, a whole model per GPU"))
    micro = run.micro_batch_size  # training.micro_batch_size: auto plans its first guess
    tokens = micro * (prompt_tokens + g.max_new_tokens)
    per_token = shape.saved_values_per_token(t.gradient_checkpointing)
    how = (f"{tokens} tokens x (layer inputs + one layer recomputed)" if t.gradient_checkpointing
           else f"{tokens} tokens x {shape.layers} layers x (6h + 2kv + 4i)")
    rows.append(("activations (one micro-batch)", compute * tokens * per_token / GIB, how))
    rows.append(("LM head logits (float32)", 4 * micro * g.max_new_tokens * shape.vocab / GIB,
                 f"{micro} x {g.max_new_tokens} completion positions x V={shape.vocab}"))
    if g.backend == "hf":
        rows_per_call = g.batch_size or run.batch.prompts_per_step * g.num_generations
        sample_bytes = _BYTES[copy] if copy is not None else stored  # the sampling model's dtype
        length = prompt_tokens + g.max_new_tokens
        kv_bytes = sample_bytes * rows_per_call * length * shape.layers * 2 * shape.kv_dim
        rows.append((f"{GENERATION}KV cache", kv_bytes / GIB,
                     f"{rows_per_call} rows x {length} tokens x {shape.layers} layers x 2 x kv_dim {shape.kv_dim}"))
        rows.append((f"{GENERATION}one step's logits (float32)", 3 * 4 * rows_per_call * shape.vocab / GIB,
                     f"{rows_per_call} rows x V, three copies: the step's, the log-prob recorder's, a warper's"))
    if g.backend == "vllm":
        v = g.vllm
        asleep = "freed while training (sleep mode)" if v.enable_sleep_mode else "held while training too"
        rows.append(("vLLM engine (generation)", v.gpu_memory_utilization * gpu_memory_gib,
                     f"gpu_memory_utilization {v.gpu_memory_utilization} x {gpu_memory_gib:g} GiB; {asleep}"))
    return rows


GENERATION = "HF generation: "  # rows of the generation phase, which never overlaps the update's transients
UPDATE_TRANSIENTS = ("activations (one micro-batch)", "LM head logits (float32)")


def peak_gib(rows: list[tuple[str, float, str]], cfg) -> tuple[float, float]:
    """(the training phase's GiB: what is always held plus the larger of HF generation's and the
    update's transients; the peak with the engine: the larger when it sleeps, the sum when not)."""
    held = sum(gib for what, gib, _ in rows
               if not what.startswith(("vLLM", GENERATION)) and what not in UPDATE_TRANSIENTS)
    update = sum(gib for what, gib, _ in rows if what in UPDATE_TRANSIENTS)
    generation = sum(gib for what, gib, _ in rows if what.startswith(GENERATION))
    training = held + max(update, generation)
    engine = sum(gib for what, gib, _ in rows if what.startswith("vLLM"))
    asleep = cfg.generation.backend == "vllm" and cfg.generation.vllm.enable_sleep_mode
    return training, training if asleep else training + engine


def fits(peak: float, gpu_memory_gib: float) -> bool:
    return peak <= gpu_memory_gib * 0.95  # 5% kept for the CUDA context and fragmentation


def format_plan(rows: list[tuple[str, float, str]], cfg, gpus: int, gpu_memory_gib: float) -> str:
    training, peak = peak_gib(rows, cfg)
    lines = [f"memory plan per GPU: strategy {cfg.training.strategy}, {gpus} GPU(s) of {gpu_memory_gib:g} GiB, "
             f"model.dtype {cfg.model.dtype}, backend {cfg.generation.backend}", "",
             "| what | GiB per GPU | how |", "|---|---|---|"]
    lines += [f"| {what} | {gib:.2f} | {how} |" for what, gib, how in rows]
    lines += ["", f"training phase: {training:.2f} GiB; with the engine: {peak:.2f} GiB of {gpu_memory_gib:g} "
                  f"({'fits' if fits(peak, gpu_memory_gib) else 'does NOT fit'}, 5% kept for the CUDA context "
                  "and fragmentation)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A run's memory plan per GPU (estimates; see the module notes).")
    p.add_argument("--config", required=True, help="the run's YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--model-config", type=Path, help="the model's config.json (default: MODEL/config.json)")
    p.add_argument("--teacher-model-config", type=Path,
                   help="the teacher's config.json (default: TEACHER/config.json), for a run with a teacher:")
    p.add_argument("--gpus", type=int, default=1, help="processes (one GPU each)")
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("--prompt-tokens", type=int, default=256, help="longest prompt the run expects")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    model_config = args.model_config or Path(cfg.model.name_or_path) / "config.json"
    if not model_config.is_file():
        print(f"memory_plan: {model_config} not found; give the model's config.json with --model-config",
              file=sys.stderr)
        return 2
    shape = Shape.from_config(json.loads(model_config.read_text()))
    teacher = None
    if cfg.teacher.name_or_path is not None:
        teacher_config = args.teacher_model_config or Path(cfg.teacher.name_or_path) / "config.json"
        if not teacher_config.is_file():
            print(f"memory_plan: {teacher_config} not found; give the teacher's config.json with "
                  "--teacher-model-config", file=sys.stderr)
            return 2
        teacher = Shape.from_config(json.loads(teacher_config.read_text()))
    rows = plan(cfg, shape, args.gpus, args.gpu_memory_gib, args.prompt_tokens, teacher)
    print(format_plan(rows, cfg, args.gpus, args.gpu_memory_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
