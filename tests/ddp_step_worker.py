"""Synthetic GRPO batches for the step tests, and a 2-process DDP step (run with torchrun).

``python -m torch.distributed.run --standalone --nproc_per_node 2 ddp_step_worker.py MODEL_DIR OUT``
runs ``grpo_step`` with the rows split over the ranks (two micro-batches each) and writes rank 0's
parameter update (SGD, lr=1, so it equals minus the gradient) and all-reduce count to ``OUT``; and
a Dr.GRPO step with verified replay of :data:`REPLAY_GROUPS` (every rank replays the same groups).
"""

from __future__ import annotations

import sys

import torch

from maxent_grpo.core.logprobs import Scoring, get_per_token_logps_and_entropies
from maxent_grpo.core.losses import ClipSettings
from maxent_grpo.core.replay import ReplayBatch, replay_layout, replay_scale
from maxent_grpo.core.step import Comm, LossSpec, MicroBatch, OptimizerUpdate, StepHooks, grpo_step

PROMPT_LEN = 5
COMPLETION_LEN = 7
G = 4
# Per-row completion lengths (P=2 prompts x G=4): varied so the normaliser matters,
# with one empty completion.
LENGTHS = (7, 3, 5, 1, 6, 2, 0, 4)
PROMPT_PADDING = (0, 2, 0, 1, 0, 0, 3, 0)
# Banked prompts and their exemplars (token ids) for the replay steps: three groups of 2, 1 and 3 modes.
REPLAY_GROUPS = [((3, 5, 7), [(9, 2), (4, 4, 6, 1)]), ((8, 1), [(5,)]), ((2, 2, 2, 2), [(7, 3, 3), (6,), (1, 9)])]


def replay_batch(compute_only: bool = False, rows_per_pass: int = 8) -> ReplayBatch:
    """The replay work of one step over :data:`REPLAY_GROUPS` (alpha 0.1, G = 4)."""
    return ReplayBatch(replay_layout(REPLAY_GROUPS, pad_token_id=0), replay_scale(0.1, G), compute_only, rows_per_pass)


def load_model(model_dir: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).to(torch.float64)
    model.train()
    return model


def build_rows(model: torch.nn.Module, seed: int = 0, lengths=LENGTHS) -> dict[str, torch.Tensor]:
    """Whole-step tensors: left-padded prompts, right-padded completions, old/ref log-probs."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lengths)
    vocab = model.config.vocab_size
    pad = model.config.pad_token_id
    ids = torch.randint(3, vocab, (n, PROMPT_LEN + COMPLETION_LEN), generator=gen)
    attn = torch.ones_like(ids)
    cmask = torch.zeros(n, COMPLETION_LEN, dtype=torch.float64)
    for i, (t, p) in enumerate(zip(lengths, PROMPT_PADDING)):
        ids[i, :p] = pad
        attn[i, :p] = 0
        ids[i, PROMPT_LEN + t :] = pad
        attn[i, PROMPT_LEN + t :] = 0
        cmask[i, :t] = 1
    with torch.no_grad():
        logp, _ = get_per_token_logps_and_entropies(model, ids, attn, PROMPT_LEN, with_entropy=False)
    # Behaviour and reference policies a little away from the current one, so
    # ratios leave the clip range on some tokens and the KL is not zero.
    old = logp + 0.4 * torch.randn(logp.shape, generator=gen, dtype=logp.dtype)
    ref = logp + 0.3 * torch.randn(logp.shape, generator=gen, dtype=logp.dtype)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    return {"input_ids": ids, "attention_mask": attn, "completion_mask": cmask,
            "advantages": adv, "old_logps": old, "ref_logps": ref}


def build_shared_rows(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """:func:`build_rows` with every group of ``G`` rows given its first row's prompt (ragged completions
    of 7, 3, 5, 1 and 6, 2, 0, 4 tokens: one is empty): distinct prompts that groups share."""
    rows = build_rows(model)
    ids, attn = rows["input_ids"].clone(), rows["attention_mask"].clone()
    for i in range(ids.shape[0]):
        head = i - i % G
        ids[i, :PROMPT_LEN] = ids[head, :PROMPT_LEN]
        attn[i, :PROMPT_LEN] = attn[head, :PROMPT_LEN]
    return {**rows, "input_ids": ids, "attention_mask": attn}


def reference_logps(model: torch.nn.Module, rows: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, T]`` completion log-probs from full logits and a plain log_softmax (the float64 references'
    own, sharing no code with the library's scoring)."""
    p = PROMPT_LEN
    attn = rows["attention_mask"]
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=rows["input_ids"], attention_mask=attn, position_ids=positions, use_cache=False).logits
    return torch.log_softmax(logits[:, p - 1 : -1], dim=-1).gather(-1, rows["input_ids"][:, p:, None]).squeeze(-1)


def flat_grads(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """The gradient of ``loss`` over ``model``'s parameters, flat (0 where a parameter gets none)."""
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, model.parameters())])


def micro_batches(rows: dict[str, torch.Tensor], bounds, **extra: torch.Tensor) -> list[MicroBatch]:
    """Slice ``rows`` (and per-row ``extra`` tensors) into micro-batches ``[start, stop)``."""
    out = []
    for start, stop in bounds:
        fields = {k: v[start:stop] for k, v in {**rows, **extra}.items()}
        out.append(MicroBatch(prompt_length=PROMPT_LEN, num_generations=G, **fields))
    return out


_CLIP = {"epsilon": "epsilon_low", "epsilon_high": "epsilon_high", "delta": "delta", "dual_clip": "dual_clip",
         "importance_sampling_level": "importance_sampling_level"}


def spec(**loss) -> LossSpec:
    """A LossSpec from the config's flat loss keys (``epsilon`` ... as ``loss:`` names them)."""
    clip = {_CLIP[k]: loss.pop(k) for k in list(loss) if k in _CLIP}
    if "epsilon_high" not in clip:
        clip["epsilon_high"] = clip.get("epsilon_low", 0.2)
    return LossSpec(clip=ClipSettings(**clip), **loss)


def step(model, optimizer, mbs, *, share_prompts: bool = True, inline_prompts: bool = False,
         temperature: float = 1.0, max_grad_norm: float | None = None, lr_scheduler=None, comm: Comm = Comm(),
         **loss):
    """``grpo_step`` with the loss given as flat keyword arguments (:func:`spec`); ``inline_prompts``: the
    one-pass layout (shared, packed: each prompt once, its completions behind it in one forward)."""
    scoring = Scoring(temperature=temperature, share_prompts=share_prompts or inline_prompts,
                      packing=inline_prompts, inline_prompts=inline_prompts)
    return grpo_step(model, optimizer, mbs, spec(**loss), scoring,
                     comm=comm, hooks=StepHooks(OptimizerUpdate(max_grad_norm, lr_scheduler)))


def rank_micro_batches(rows: dict[str, torch.Tensor], rank: int, world: int) -> list[MicroBatch]:
    """This rank's half of the rows, as two micro-batches (rank 0: rows 0-3, rank 1: rows 4-7)."""
    half = len(LENGTHS) // world
    lo = rank * half
    return micro_batches(rows, [(lo, lo + half // 2), (lo + half // 2, lo + half)])


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t)
    return t


def main(model_dir: str, out_path: str) -> None:
    """One step with the gradient reduced once (``ddp_gradient_sync``, as the trainer runs it) and
    one with it reduced after every micro-batch; DDP's comm hook counts the all-reduces of each."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from maxent_grpo.training.distributed import DataParallelPolicy, ddp_gradient_sync

    rank, world = dist.get_rank(), dist.get_world_size()

    saved = {}
    for name, once in (("once", True), ("every", False)):
        model = load_model(model_dir)
        rows = build_rows(model)
        mine = rank_micro_batches(rows, rank, world)
        ddp = DataParallelPolicy(model, gradient_as_bucket_view=True)
        all_reduces = []

        def counting_hook(state, bucket, calls=all_reduces):
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, counting_hook)
        before = [p.detach().clone() for p in model.parameters()]
        comm = Comm(world, all_reduce_sum, ddp_gradient_sync(ddp) if once else None)
        result = step(ddp, torch.optim.SGD(ddp.parameters(), lr=1.0), mine, beta=0.05, loss_type="dapo", comm=comm,
                      share_prompts=False)  # the test compares to 1e-10 (see test_step._step)
        saved[name] = {"grads": [b - p.detach() for b, p in zip(before, model.parameters())], "loss": result.loss,
                       "metrics": result.metrics, "all_reduces": len(all_reduces), "buckets": len(set(all_reduces))}
    # Dr.GRPO with verified replay, as the trainer runs it: the replay backward without the reduction,
    # the gradients reduced once in the last fresh backward.
    model = load_model(model_dir)
    mine = rank_micro_batches(build_rows(model), rank, world)
    ddp = DataParallelPolicy(model, gradient_as_bucket_view=True)
    before = [p.detach().clone() for p in model.parameters()]
    result = grpo_step(ddp, torch.optim.SGD(ddp.parameters(), lr=1.0), mine,
                       spec(beta=0.0, loss_type="dr_grpo", max_completion_length=COMPLETION_LEN),
                       Scoring(share_prompts=False), comm=Comm(world, all_reduce_sum, ddp_gradient_sync(ddp)),
                       replay=replay_batch())
    saved["replay"] = {"grads": [b - p.detach() for b, p in zip(before, model.parameters())], "loss": result.loss,
                       "metrics": result.metrics}
    if rank == 0:
        torch.save(saved, out_path)


if __name__ == "__main__":
    from maxent_grpo.training.distributed import process_group

    # The group ends after main's objects are gone (process_group's docstring: a gloo group
    # destroyed while a model still holds it can abort or hang a rank at exit).
    with process_group(timeout_minutes=5):
        main(sys.argv[1], sys.argv[2])
