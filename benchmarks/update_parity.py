"""One optimizer step, ours vs TRL, from the same weights on the same rollouts: is the update the same?

    python benchmarks/update_parity.py            # the table of every case
    python benchmarks/update_parity.py --cases dapo,weight-decay-0.1

Both sides start from one tiny-model folder and train on one fixed rollout: P
prompts of unequal length (left padding), G completions each of unequal length
(some stop on EOS, one is cut at ``max_new_tokens``), fixed rewards; one
micro-batch per group, so a step accumulates P micro-batches. Each side runs
its real code:

* ours: ``load_config`` overrides -> ``compile_run`` (the run's ``LossSpec`` and
  ``Scoring``), ``build_optimizer`` (the run's AdamW and LR schedule),
  ``pack_rollout`` and ``compute_advantages``, then ``grpo_step`` with an
  ``OptimizerUpdate`` (clipping, optimizer, scheduler);
* TRL: ``GRPOTrainer.train()``, stopped after the case's steps, with its
  generation replaced by the same completion ids (``_generate_single_turn``) and a
  reward function returning the same rewards; TRL builds its own masks, token
  counts and advantages, micro-batches, loss scaling, clipping, AdamW and schedule.

The table gives, per case: the learning rate each optimizer step applied (read
in an optimizer step pre-hook), the gradient norm before clipping, the largest
advantage gap, and the relative differences ``||x_ours - x_TRL|| / ||x_TRL||`` of
the last step's clipped gradients and of the parameter change ``after - before``
(with its largest element-wise gap). The gradients are the sharp test: Adam's
first step, ``lr * g / (|g| + eps)``, turns a rounding difference in a gradient
element near ``eps`` into a visible one in the update.

TRL shuffles the rows of a generation batch before cutting its micro-batches;
that is turned off (``shuffle_sequence_dict`` patched to the identity) so both
sides see the same micro-batches, except in the ``*-trl-shuffle`` cases.
The results and the conventions that differ are in BENCHMARKS.md
("One optimizer step against TRL").
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

PROMPTS, GENERATIONS, MAX_NEW_TOKENS, TOTAL_STEPS = 3, 4, 8, 10
LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class Case:
    """One comparison: the settings both sides get, and what TRL is told where its names differ."""

    name: str
    loss_type: str = "dapo"
    dtype: str = "float32"
    max_grad_norm: float | None = 0.05  # below the tiny model's gradient norm: clipping acts
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    temperature: float = 1.0
    steps: int = 1  # 2: Adam's betas and the schedule's second lr act (step 1 is sign-like, g / |g|)
    trl_lr_scheduler: str | None = None  # TRL's lr_scheduler_type (default: ours' name)
    trl_shuffle: bool = False  # leave TRL's row shuffle before the micro-batch split on
    note: str = ""


CASES = [
    Case("dapo"),
    Case("grpo", loss_type="grpo"),
    Case("dr_grpo", loss_type="dr_grpo"),
    Case("bnpo", loss_type="bnpo"),
    Case("dapo-fp64", dtype="float64"),
    Case("grpo-fp64", loss_type="grpo", dtype="float64"),
    Case("dr_grpo-fp64", loss_type="dr_grpo", dtype="float64"),
    Case("bnpo-fp64", loss_type="bnpo", dtype="float64"),
    Case("no-clip", max_grad_norm=None),
    Case("temperature-0.7", temperature=0.7),
    Case("betas-0.8-0.95-2steps", betas=(0.8, 0.95), steps=2),
    Case("linear-2steps", lr_scheduler="linear", steps=2),
    Case("linear-warmup3-2steps", lr_scheduler="linear", warmup_steps=3, steps=2,
         note="both: lr 0 at step 1 (HF warmup starts at 0)"),
    Case("constant-warmup3-2steps", warmup_steps=3, steps=2, trl_lr_scheduler="constant_with_warmup",
         note="TRL told constant_with_warmup"),
    Case("constant-warmup3-trl-constant", warmup_steps=3,
         note="differs: TRL's 'constant' ignores warmup_steps"),
    Case("weight-decay-0.1", weight_decay=0.1, note="both exempt biases and norm gains from decay"),
    Case("dapo-trl-shuffle", trl_shuffle=True, note="TRL's row shuffle on: dapo does not depend on the split"),
    Case("bnpo-trl-shuffle", loss_type="bnpo", trl_shuffle=True,
         note="differs: TRL's micro-batches are a random split"),
]


@dataclass(frozen=True)
class Rollouts:
    """``P`` prompts (chat messages and their token ids) and ``G`` completions each, prompt-major."""

    messages: list[list[dict]]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]  # each ends with EOS, or has MAX_NEW_TOKENS tokens
    rewards: list[float]


def make_rollouts(tokenizer, seed: int = 0) -> Rollouts:
    """Fixed prompts of unequal length; completions whose lengths differ within and across groups."""
    from maxent_grpo.data.prompts import format_prompt

    gen = torch.Generator().manual_seed(seed)
    messages = [[{"role": "user", "content": f"What is {p + 2} + 3?" + " Think." * (4 * p)}] for p in range(PROMPTS)]
    prompt_ids = [tokenizer(format_prompt(tokenizer, m), add_special_tokens=False)["input_ids"] for m in messages]
    special = set(tokenizer.all_special_ids)
    vocab = torch.tensor([t for t in range(len(tokenizer)) if t not in special])
    completion_ids, rewards = [], []
    for p in range(PROMPTS):
        for g in range(GENERATIONS):
            # Group 0 short, group 1 long (its last completion cut at the limit), group 2 mixed.
            length = [2 + g, 5 + g, 1 + 2 * g][p % 3]
            ids = vocab[torch.randint(len(vocab), (length,), generator=gen)].tolist()
            completion_ids.append(ids if length >= MAX_NEW_TOKENS else ids + [tokenizer.eos_token_id])
            rewards.append(int(torch.randint(9, (), generator=gen)) / 8)  # dyadic: exact in float32
    return Rollouts(messages, prompt_ids, completion_ids, rewards)


@dataclass
class Outcome:
    """What one side did in its steps: flat float64 vectors over the named parameters."""

    delta: torch.Tensor  # parameters after the last step - before the first
    grads: torch.Tensor  # the last step's, as the optimizer saw them (after clipping)
    lrs: list[float]  # the learning rate each step applied
    grad_norm: float  # the last step's, before clipping
    advantages: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # the first step's


@contextmanager
def _optimizer_probe(model: torch.nn.Module, seen: dict):
    """Record the lr of every optimizer step of ``model``'s parameters, and the last one's gradients,
    as the step starts (after clipping)."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen["lrs"] = []

    def hook(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(id(p) in names for p in params):
            lrs = {group["lr"] for group in optimizer.param_groups}
            if len(lrs) != 1:
                raise RuntimeError(f"the optimizer's parameter groups apply different learning rates {sorted(lrs)}")
            seen["lrs"].append(lrs.pop())
            seen["grads"] = {names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None}

    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _flat(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([
        (tensors[n] if n in tensors else torch.zeros_like(p)).detach().reshape(-1).to(torch.float64)
        for n, p in model.named_parameters()
    ])


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def ours_step(case: Case, model, tokenizer, rollouts: Rollouts) -> Outcome:
    """``case.steps`` steps of our trainer's code on ``rollouts`` (``model`` is changed in place)."""
    from maxent_grpo.core.advantages import compute_advantages
    from maxent_grpo.core.step import MicroBatch, OptimizerUpdate, StepHooks, grpo_step
    from maxent_grpo.rollout.backend import RolloutBatch, pack_rollout
    from maxent_grpo.config.load import load_config
    from maxent_grpo.config.compile import compile_run
    from maxent_grpo.training.policy import build_optimizer
    from maxent_grpo.training.precision import Machine

    cfg = load_config(overrides={
        "method": "grpo", "loss.loss_type": case.loss_type, "loss.beta": 0.0, "loss.epsilon": 0.2,
        "loss.scale_rewards": "group", "generation.num_generations": GENERATIONS,
        "generation.max_new_tokens": MAX_NEW_TOKENS, "generation.temperature": case.temperature,
        "training.prompts_per_step": PROMPTS, "training.micro_batch_size": GENERATIONS,
        "training.learning_rate": LEARNING_RATE, "training.lr_scheduler": case.lr_scheduler,
        "training.warmup_steps": case.warmup_steps, "training.weight_decay": case.weight_decay,
        "training.adam_beta1": case.betas[0], "training.adam_beta2": case.betas[1],
        "training.max_grad_norm": case.max_grad_norm, "training.max_steps": TOTAL_STEPS,
        "training.autocast_bf16": False, "training.share_prompts": True,
    })
    plan = compile_run(cfg, Machine(fast_bf16=False, cuda=False))
    optimizer, scheduler = build_optimizer(model, plan.optimizer)
    batch = RolloutBatch(
        prompts=[""] * PROMPTS, prompt_ids=rollouts.prompt_ids, completion_ids=rollouts.completion_ids,
        completion_texts=[""] * len(rollouts.completion_ids),
        finish_reasons=["length" if len(c) == MAX_NEW_TOKENS and c[-1] != tokenizer.eos_token_id else "stop"
                        for c in rollouts.completion_ids],
        behaviour_logps=None, num_generations=GENERATIONS,
    )
    packed = pack_rollout(batch, tokenizer.pad_token_id)
    stats = plan.batch.reward_stats
    advantages = compute_advantages(torch.tensor(rollouts.rewards, dtype=torch.float64), GENERATIONS,
                                    estimator=stats.advantage_estimator, scale_rewards=stats.scale_rewards)
    size = plan.micro_batch_size
    micro_batches = [
        MicroBatch(input_ids=packed.input_ids[s : s + size], attention_mask=packed.attention_mask[s : s + size],
                   prompt_length=packed.prompt_length, num_generations=GENERATIONS,
                   completion_mask=packed.completion_mask[s : s + size], advantages=advantages[s : s + size])
        for s in range(0, packed.input_ids.shape[0], size)
    ]
    before, seen = _params(model), {}
    update = OptimizerUpdate(max_grad_norm=plan.max_grad_norm, lr_scheduler=scheduler)
    with _optimizer_probe(model, seen):
        for _ in range(case.steps):  # the same rollouts again: on-policy at the new weights, as TRL regenerates them
            result = grpo_step(model, optimizer, micro_batches, plan.method.loss, plan.scoring,
                               hooks=StepHooks(update=update))
    after = _params(model)
    return Outcome(
        delta=_flat(model, {n: after[n].double() - before[n].double() for n in after}),
        grads=_flat(model, seen["grads"]), lrs=seen["lrs"], grad_norm=result.grad_norm, advantages=advantages,
    )


def trl_step(case: Case, model, tokenizer, rollouts: Rollouts) -> Outcome:
    """``case.steps`` steps of TRL's ``GRPOTrainer`` on ``rollouts`` (``model`` is changed in place)."""
    import trl.trainer.grpo_trainer as grpo_module
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    by_prompt = {tuple(ids): p for p, ids in enumerate(rollouts.prompt_ids)}
    reward_of = {tuple(ids): r for ids, r in zip(rollouts.completion_ids, rollouts.rewards)}
    if len(reward_of) != len(rollouts.completion_ids):
        raise ValueError("the completions must be distinct: the reward function finds each by its ids")

    def fixed_reward(prompts, completions, completion_ids, **kwargs):
        return [reward_of[tuple(ids)] for ids in completion_ids]

    def fixed_generation(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        taken = [0] * PROMPTS
        out = []
        for ids in prompt_ids:
            p = by_prompt[tuple(ids)]  # a KeyError here: TRL tokenized a prompt differently from ours
            out.append(rollouts.completion_ids[p * GENERATIONS + taken[p]])
            taken[p] += 1
        return out, None

    class StopEarly(TrainerCallback):  # the schedule still spans TOTAL_STEPS
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= case.steps

    with tempfile.TemporaryDirectory(prefix="trl-parity-") as out_dir:
        args = GRPOConfig(
            output_dir=out_dir, use_cpu=True, report_to=[], bf16=False, fp16=False, disable_tqdm=True,
            per_device_train_batch_size=GENERATIONS, gradient_accumulation_steps=PROMPTS,
            steps_per_generation=PROMPTS, num_generations=GENERATIONS, max_completion_length=MAX_NEW_TOKENS,
            temperature=case.temperature, beta=0.0, epsilon=0.2, loss_type=case.loss_type,
            scale_rewards="group",
            learning_rate=LEARNING_RATE, lr_scheduler_type=case.trl_lr_scheduler or case.lr_scheduler,
            warmup_steps=case.warmup_steps, weight_decay=case.weight_decay, adam_beta1=case.betas[0],
            adam_beta2=case.betas[1], max_grad_norm=case.max_grad_norm or 0.0, max_steps=TOTAL_STEPS,
            gradient_checkpointing=False, shuffle_dataset=False, logging_steps=1, save_strategy="no",
            eval_strategy="no", dataloader_num_workers=0, seed=0,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=[fixed_reward], args=args, processing_class=tokenizer,
            train_dataset=Dataset.from_list([{"prompt": m} for m in rollouts.messages]), callbacks=[StopEarly()],
        )
        trainer._generate_single_turn = fixed_generation
        seen_advantages = []
        score = trainer._generate_and_score_completions

        def recording_score(inputs):
            out = score(inputs)
            seen_advantages.append(out["advantages"].detach().clone())
            return out

        trainer._generate_and_score_completions = recording_score
        before, seen = _params(model), {}
        shuffle = grpo_module.shuffle_sequence_dict if case.trl_shuffle else (lambda batch: batch)
        with _optimizer_probe(model, seen), mock.patch.object(grpo_module, "shuffle_sequence_dict", shuffle):
            trainer.train()
        log = [entry for entry in trainer.state.log_history if "loss" in entry][-1]
    after = _params(model)
    grads = _flat(model, seen["grads"])
    return Outcome(
        delta=_flat(model, {n: after[n].double() - before[n].double() for n in after}),
        grads=grads, lrs=seen["lrs"], advantages=seen_advantages[0].double(),
        # HF logs the norm clipping measured; without clipping the gradients are unchanged.
        grad_norm=float(log["grad_norm"]) if "grad_norm" in log else float(grads.norm()),
    )


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    denominator = float(b.norm())
    return float((a - b).norm()) / denominator if denominator > 0 else float((a - b).norm())


def compare(case: Case, model_dir: Path) -> dict:
    """Both sides' steps from the weights in ``model_dir``; the numbers of one table row."""
    from maxent_grpo.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_dir, dtype=case.dtype)
    model.train()
    twin = copy.deepcopy(model)
    rollouts = make_rollouts(tokenizer)
    ours = ours_step(case, model, tokenizer, rollouts)
    theirs = trl_step(case, twin, tokenizer, rollouts)
    return {
        "case": case.name,
        "loss_type": case.loss_type,
        "dtype": case.dtype,
        "steps": case.steps,
        "lrs_ours": ours.lrs,
        "lrs_trl": theirs.lrs,
        "grad_norm_ours": ours.grad_norm,
        "grad_norm_trl": theirs.grad_norm,
        "clipped": case.max_grad_norm is not None and ours.grad_norm > case.max_grad_norm,
        "advantage_max_abs": float((ours.advantages - theirs.advantages).abs().max()),
        "grad_rel": _relative(ours.grads, theirs.grads),
        "delta_rel": _relative(ours.delta, theirs.delta),
        "delta_max_abs": float((ours.delta - theirs.delta).abs().max()),
        "delta_norm_trl": float(theirs.delta.norm()),
        "note": case.note,
    }


def _lrs(lrs: list[float]) -> str:
    return ", ".join(f"{lr:.3g}" for lr in lrs)


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| case | loss | dtype | steps | lr per step ours | lr per step TRL | grad norm ours / TRL | clipped "
        "| max abs dA | rel diff grad | rel diff dθ | max abs diff dθ | ‖dθ_TRL‖ | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['loss_type']} | {r['dtype']} | {r['steps']} | {_lrs(r['lrs_ours'])} "
            f"| {_lrs(r['lrs_trl'])} "
            f"| {r['grad_norm_ours']:.4f} / {r['grad_norm_trl']:.4f} | {'yes' if r['clipped'] else 'no'} "
            f"| {r['advantage_max_abs']:.1e} | {r['grad_rel']:.1e} | {r['delta_rel']:.1e} "
            f"| {r['delta_max_abs']:.1e} | {r['delta_norm_trl']:.3g} | {r['note']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.model_paths import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", help=f"comma-separated subset of {', '.join(c.name for c in CASES)}")
    args = parser.parse_args(argv)
    by_name = {c.name: c for c in CASES}
    names = args.cases.split(",") if args.cases else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown cases {unknown}; cases: {', '.join(by_name)}")
    model_dir = resolve_model("tiny")
    print(f"tiny model {model_dir}; P={PROMPTS} G={GENERATIONS} (one micro-batch per group: {PROMPTS} micro-batches), "
          f"max_new_tokens={MAX_NEW_TOKENS}, lr {LEARNING_RATE}, schedule over {TOTAL_STEPS} steps\n")
    print(markdown_table([compare(by_name[n], model_dir) for n in names]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
