"""The update alone on one fixed ragged batch, ours against TRL: seconds, tokens/s, MFU, peak memory.

    python benchmarks/update_ragged.py --model qwen2.5-0.5b    # a GPU: random weights, bf16 autocast
    python benchmarks/update_ragged.py --cpu                    # the tiny model on the CPU: a check, no figures

One batch, built once (:func:`ragged_batch`) and given to both sides: ``--prompts`` groups of
``--group`` completions of random token ids, each prompt ``--prompt-len`` tokens, each completion's
length drawn (seeded) from :data:`LENGTH_QUANTILES` scaled to ``--max-new-tokens``; fixed rewards,
their group advantages (``compute_advantages``, std-scaled per group). Our side gets the padded
tensors from ``pack_rollout``, TRL's from the padding its ``_generate_and_score_completions`` does
(``trl.trainer.utils.pad``): the same ids, masks and advantages (checked by the tests).

* ours: ``grpo_step`` with the run's ``LossSpec`` and ``Scoring`` from ``compile_run`` (method
  ``grpo``, loss ``dapo``, epsilon 0.2, beta 0), for each layout of :data:`LAYOUTS`, with
  ``training.micro_batch_size`` fixed (``--micro-batch-size``) and ``auto`` (on CUDA sized as the
  trainer sizes it: ``device_budget`` with the model loaded, then ``MicroBatchBudget.rows`` at the
  batch's lengths; on the CPU the compiled plan's count). The optimizer is never stepped: forward
  and backward only, the gradients zeroed before each pass.
* TRL: a ``GRPOTrainer`` built on the same model (a one-row dataset, a zero reward; it generates
  nothing), its ``compute_loss`` and ``accelerator.backward`` on each micro-batch of
  ``--micro-batch-size`` rows, with ``current_gradient_accumulation_steps`` set as its training loop sets it.

bf16 autocast over float32 weights on CUDA on both sides (TRL: ``bf16=True``); float32 with ``--cpu``.
Each variant runs once to warm up, then ``--reps`` times; the median. Trained tokens count each
prompt once per group plus every completion token; MFU is ``6 x params x trained tokens / s`` over
``--peak-tflops``; peak memory is ``torch.cuda.max_memory_allocated`` over the variant's passes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

# Completion lengths as fractions of the limit: the 0%, 5%, ..., 100% quantiles of the sampled
# completions (their `length`, of a 40-token limit) in ModeBench's eval files,
# benchmarks/results/modebench/*/seed*/eval-seed*/completions.jsonl.gz: 5376 completions of
# SmolLM2-135M-Instruct, the start model and every trained arm, 15% of them at the limit
# (:func:`length_quantiles_from_results` recomputes them; a test checks they match). The default
# run's metrics (benchmarks/results/default_learning) keep only each step's mean length (12 of 48
# tokens), no per-completion lengths.
LENGTH_QUANTILES = (0.15, 0.5, 0.55, 0.55, 0.55, 0.575, 0.575, 0.575, 0.575, 0.6, 0.675, 0.7, 0.75, 0.825, 0.85,
                    0.875, 0.9, 1.0, 1.0, 1.0, 1.0)
LENGTH_LIMIT = 40
LENGTH_FILES = "modebench/*/seed*/eval-seed*/completions.jsonl.gz"
# Our layouts: the training keys each sets, and the forward it gives (core/completion_logits.forward_layout;
# under flash attention the shared ones run as "packed", which the table then says).
LAYOUTS = {
    "padded": ({"share_prompts": False, "packing": False, "inline_prompts": False}, "plain"),  # CUDA's default
    "packed": ({"share_prompts": False, "packing": True, "inline_prompts": False}, "packed"),
    "shared-packed": ({"share_prompts": True, "packing": True, "inline_prompts": False}, "shared_packed"),
    "inline": ({"share_prompts": True, "packing": True, "inline_prompts": True}, "inline"),  # the CPU's default
}


def length_quantiles_from_results(root: Path) -> tuple[float, ...]:
    """:data:`LENGTH_QUANTILES` from the files under ``root`` (``benchmarks/results``)."""
    from benchmarks.result_files import read_jsonl

    lengths = sorted(r["length"] for path in sorted(root.glob(LENGTH_FILES))
                     for r in read_jsonl(path.with_suffix("")) if r["mode"] == "sampled")
    return tuple(lengths[round(q * (len(lengths) - 1) / 20)] / LENGTH_LIMIT for q in range(21))


def draw_lengths(n: int, max_new_tokens: int, gen: torch.Generator) -> list[int]:
    """``n`` completion lengths: the quantile function of :data:`LENGTH_QUANTILES`, linear between
    them, at ``n`` uniform draws, times ``max_new_tokens`` (at least one token)."""
    pos = torch.rand(n, generator=gen, dtype=torch.float64) * (len(LENGTH_QUANTILES) - 1)
    lo = pos.floor().long().clamp(max=len(LENGTH_QUANTILES) - 2)
    q = torch.tensor(LENGTH_QUANTILES, dtype=torch.float64)
    frac = q[lo] + (pos - lo) * (q[lo + 1] - q[lo])
    return [max(1, round(float(f) * max_new_tokens)) for f in frac]


@dataclass(frozen=True)
class RaggedBatch:
    """``P`` prompts x ``G`` completions (prompt-major), and each completion's advantage."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    advantages: torch.Tensor  # [P * G] float32
    num_generations: int

    @property
    def trained_tokens(self) -> int:
        """Each prompt once per group, and every completion token."""
        return sum(map(len, self.prompt_ids)) + sum(map(len, self.completion_ids))


def ragged_batch(vocab: int, prompts: int, group: int, prompt_len: int, max_new_tokens: int,
                 seed: int = 0) -> RaggedBatch:
    from maxent_grpo.core.advantages import compute_advantages

    gen = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(vocab, (prompts, prompt_len), generator=gen).tolist()
    lengths = draw_lengths(prompts * group, max_new_tokens, gen)
    completion_ids = [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]
    rewards = torch.rand(prompts * group, generator=gen, dtype=torch.float64)
    advantages = compute_advantages(rewards, group, estimator="grpo", scale_rewards="group").float()
    return RaggedBatch(prompt_ids, completion_ids, advantages, group)


def ours_packed(batch: RaggedBatch, pad_id: int, device):
    """Our trainer's padded batch (``pack_rollout``)."""
    from maxent_grpo.rollout.backend import RolloutBatch, pack_rollout

    n = len(batch.completion_ids)
    rollout = RolloutBatch(prompts=[""] * len(batch.prompt_ids), prompt_ids=batch.prompt_ids,
                           completion_ids=batch.completion_ids, completion_texts=[""] * n,
                           finish_reasons=["stop"] * n, behaviour_logps=None, num_generations=batch.num_generations)
    return pack_rollout(rollout, pad_id, device=device)


def trl_inputs(batch: RaggedBatch, pad_id: int, device) -> dict:
    """The dict TRL 1.16's ``_generate_and_score_completions`` returns, padded as it pads."""
    from trl.trainer.utils import pad

    prompts = [torch.tensor(batch.prompt_ids[i // batch.num_generations]) for i in range(len(batch.completion_ids))]
    completions = [torch.tensor(ids) for ids in batch.completion_ids]
    completion_mask = pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right")
    return {
        "prompt_ids": pad(prompts, padding_value=pad_id, padding_side="left").to(device),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left").to(device),
        "completion_ids": pad(completions, padding_value=pad_id, padding_side="right").to(device),
        "completion_mask": completion_mask.to(device),
        "advantages": batch.advantages.to(device),
        "num_items_in_batch": completion_mask.sum().to(device),
    }


def our_plan(layout: str, micro, batch: RaggedBatch, max_new_tokens: int, bf16: bool):
    """The compiled run for ``layout`` and ``micro`` (rows, or "auto") on this machine."""
    from maxent_grpo.config.compile import compile_run
    from maxent_grpo.config.load import load_config
    from maxent_grpo.training.precision import Machine

    overrides = {
        "method": "grpo", "loss.loss_type": "dapo", "loss.beta": 0.0, "loss.epsilon": 0.2,
        "loss.scale_rewards": "group", "loss.rollout_correction": "none", "data.source": "modebench:pair_sum",
        "generation.num_generations": batch.num_generations, "generation.max_new_tokens": max_new_tokens,
        "training.prompts_per_step": len(batch.prompt_ids), "training.micro_batch_size": micro,
        "model.dtype": "bfloat16" if bf16 else "float32", "training.autocast_bf16": bf16,
        **{f"training.{k}": v for k, v in LAYOUTS[layout][0].items()},
    }
    return compile_run(load_config(overrides=overrides), Machine.here())


def micro_rows(plan, model, packed) -> int:
    """Rows per micro-batch as the trainer picks them (training/loop.py's ``_micro_batch_rows``)."""
    if not plan.micro_batch_from_memory:
        return plan.micro_batch_size
    from maxent_grpo.training.distributed import Dist
    from maxent_grpo.training.micro_batches import DTYPE_BYTES, device_budget
    from maxent_grpo.training.model_shape import Shape

    budget = device_budget(model, Shape.from_config(model.config.to_dict()), Dist(),
                           compute_bytes=2 if plan.model.autocast_bf16 else DTYPE_BYTES[plan.model.dtype],
                           gradient_checkpointing=plan.model.gradient_checkpointing,
                           num_generations=plan.batch.num_generations)
    return budget.rows(packed.input_ids.shape[0], packed.input_ids.shape[1], packed.completion_mask.shape[1])


def _timed(run, reps: int, cuda: bool) -> tuple[float, float | None]:
    """Median seconds of ``run()`` over ``reps`` calls after one warm-up, and the peak GiB (None off CUDA)."""
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for rep in range(reps + 1):
        start = time.perf_counter()
        run()
        if cuda:
            torch.cuda.synchronize()
        if rep:
            times.append(time.perf_counter() - start)
    return statistics.median(times), (torch.cuda.max_memory_allocated() / 2**30 if cuda else None)


def time_ours(model, batch: RaggedBatch, layout: str, micro, args, cuda: bool) -> dict:
    from maxent_grpo.core.completion_logits import forward_layout
    from maxent_grpo.core.step import MicroBatch, StepHooks, grpo_step

    plan = our_plan(layout, micro, batch, args.max_new_tokens, args.bf16)
    packed = ours_packed(batch, args.pad_id, model.device)
    rows = micro_rows(plan, model, packed)
    advantages = batch.advantages.to(model.device)
    mbs = [MicroBatch(input_ids=packed.input_ids[s:s + rows], attention_mask=packed.attention_mask[s:s + rows],
                      prompt_length=packed.prompt_length, num_generations=batch.num_generations,
                      completion_mask=packed.completion_mask[s:s + rows], advantages=advantages[s:s + rows])
           for s in range(0, packed.input_ids.shape[0], rows)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # never stepped: grpo_step zeroes the grads through it
    hooks = StepHooks(update=lambda model, optimizer: torch.zeros(()))
    scoring = plan.scoring
    seconds, peak = _timed(lambda: grpo_step(model, optimizer, mbs, plan.method.loss, scoring, hooks=hooks),
                           args.reps, cuda)
    kind = forward_layout(model, mbs[0].input_ids, mbs[0].attention_mask, packed.prompt_length,
                          share_prompts=scoring.share_prompts, pack=scoring.packing,
                          inline_prompts=scoring.inline_prompts).kind
    positions = sum(scoring.forward_positions(model, mb.input_ids, mb.attention_mask, mb.prompt_length) for mb in mbs)
    name = layout if kind == LAYOUTS[layout][1] else f"{layout} (ran as {kind})"
    return {"side": "ours", "layout": name, "micro": f"{micro} ({rows} rows)" if micro == "auto"
            else str(rows), "seconds": seconds, "peak": peak, "positions": positions}


def time_trl(model, tokenizer, batch: RaggedBatch, args, cuda: bool) -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    n, micro = len(batch.completion_ids), args.micro_batch_size
    inputs = trl_inputs(batch, args.pad_id, model.device)
    # Its micro-batches, as its split_tensor_dict cuts them: the rows of every tensor, a 0-d one kept whole.
    parts = [{k: v if v.dim() == 0 else v[s:s + micro] for k, v in inputs.items()} for s in range(0, n, micro)]

    def zero_reward(completions, **kwargs):
        return [0.0] * len(completions)

    with tempfile.TemporaryDirectory(prefix="trl-update-ragged-") as out:
        config = GRPOConfig(output_dir=out, use_cpu=not cuda, bf16=args.bf16, fp16=False, report_to=[],
                            per_device_train_batch_size=micro, gradient_accumulation_steps=n // micro,
                            steps_per_generation=n // micro, num_generations=batch.num_generations,
                            max_completion_length=args.max_new_tokens, beta=0.0, loss_type="dapo", epsilon=0.2,
                            scale_rewards="group", gradient_checkpointing=False, use_vllm=False, save_strategy="no",
                            disable_tqdm=True, dataloader_num_workers=0, max_steps=1)
        trainer = GRPOTrainer(model=model, reward_funcs=[zero_reward], args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_list([{"prompt": "x"}]))
        trainer.current_gradient_accumulation_steps = n // micro  # what its training loop sets each step
        trainer.model.train()

        def update():
            trainer.model.zero_grad(set_to_none=True)
            for part in parts:
                trainer.accelerator.backward(trainer.compute_loss(trainer.model, part))

        seconds, peak = _timed(update, args.reps, cuda)
    width = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
    return {"side": "trl", "layout": "padded", "micro": str(micro), "seconds": seconds, "peak": peak,
            "positions": n * width}


def table(rows: list[dict], batch: RaggedBatch, params: int, args, device: str) -> str:
    tokens = batch.trained_tokens
    lengths = sorted(map(len, batch.completion_ids))
    lines = [f"### One ragged batch's update, ours against TRL ({device})", "",
             "| side | layout | micro-batch | s/update | trained tokens/s | MFU | peak GiB | positions computed |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['side']} | {r['layout']} | {r['micro']} | {r['seconds']:.3f} | {tokens / r['seconds']:.0f} "
                     f"| {6 * params * tokens / r['seconds'] / (args.peak_tflops * 1e12):.1%} "
                     f"| {'-' if r['peak'] is None else format(r['peak'], '.1f')} "
                     f"| {r['positions']} |")
    ours = [r for r in rows if r["side"] == "ours"]
    trl = [r for r in rows if r["side"] == "trl"]
    if ours and trl:
        best = min(ours, key=lambda r: r["seconds"])
        lines += ["", f"ours/TRL tokens/s: {trl[0]['seconds'] / best['seconds']:.2f}x ({best['layout']}, micro-batch "
                      f"{best['micro']}, against TRL at micro-batch {trl[0]['micro']})"]
    lines += [f"* {len(batch.prompt_ids)} prompts x {batch.num_generations} completions, {args.prompt_len}-token prompts, "
              f"completions of {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}, limit "
              f"{args.max_new_tokens}), {tokens} trained tokens (each prompt once per group); {params / 1e6:.1f}M "
              f"parameters, MFU against {args.peak_tflops:g} TFLOP/s; medians of {args.reps} after a warm-up"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen2.5-0.5b", help="one of benchmarks/model_configs (random weights)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=168, help="benchmarks/gpu.py's pair_sum prompts: ~168 tokens")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8, help="the fixed micro-batch (both sides)")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"ours: a subset of {','.join(LAYOUTS)}")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM: 989)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cpu", action="store_true", help="the tiny model on the CPU, float32, a small batch: a check")
    args = p.parse_args(argv)
    layouts = [x for x in args.layouts.split(",") if x]
    if set(layouts) - set(LAYOUTS):
        p.error(f"unknown layouts {sorted(set(layouts) - set(LAYOUTS))}: {', '.join(LAYOUTS)}")
    from benchmarks.model_paths import cache_root, random_model, resolve_model
    from maxent_grpo.models import load_model_and_tokenizer

    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        print("benchmarks/update_ragged.py: no CUDA device here (--cpu checks the script on the tiny model)",
              file=sys.stderr)
        return 2
    if args.cpu:
        args.prompts, args.group, args.prompt_len, args.max_new_tokens, args.micro_batch_size, args.reps = 2, 4, 16, 32, 4, 2
    args.bf16 = cuda
    path = resolve_model("tiny") if args.cpu else random_model(args.model, cache_root() / "random" / args.model, device="cuda")
    model, tokenizer = load_model_and_tokenizer(path, dtype="float32", device="cuda" if cuda else "cpu")
    model.train()
    args.pad_id = tokenizer.pad_token_id
    batch = ragged_batch(model.config.vocab_size, args.prompts, args.group, args.prompt_len, args.max_new_tokens,
                         args.seed)
    params = sum(t.numel() for t in model.parameters())
    device = torch.cuda.get_device_name() if cuda else "CPU, the tiny model"
    rows = []
    for layout in layouts:
        for micro in (args.micro_batch_size, "auto"):
            rows.append(time_ours(model, batch, layout, micro, args, cuda))
            print(table(rows, batch, params, args, device) + "\n", flush=True)
    rows.append(time_trl(model, tokenizer, batch, args, cuda))
    print(table(rows, batch, params, args, device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
