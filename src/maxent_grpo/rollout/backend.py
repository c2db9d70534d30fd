"""The generation interface and the rollout records.

A backend answers ``generate(prompts, num_generations, params)`` with one
``PromptGroup`` per prompt, which may hold fewer completions than asked (a
server dropped some, a request timed out). ``generate_groups`` re-asks for the
missing ones, drops groups that stay incomplete (ALGORITHMS.md §9) and lays the
rest out prompt-major in a ``RolloutBatch``; ``pack_rollout`` turns that into
padded tensors for scoring.

Completion conventions, shared by every backend:

* ``token_ids`` end with the EOS token when generation stopped on EOS;
* when a stop string ended generation, the tokens end with the token that
  completed it; the stop string is KEPT in ``text`` (rewards may look for it);
* ``text`` is the decoding of ``token_ids`` without special tokens;
* ``logps[t]`` is ``log_softmax(logits_t / temperature)[token_t]`` under the
  raw model logits: top-k / top-p filtering is not applied, which is what the
  trainer recomputes.

A multi-turn episode (``maxent_grpo.envs``) is one completion whose tokens
interleave the model's turns with the environment's: ``loss_mask`` is 1 on the
model's tokens and 0 on the environment's, whose ``logps`` are 0 (nobody
sampled them). ``None`` means every token is the model's.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from maxent_grpo.errors import UserError

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    stop: tuple[str, ...] = ()
    do_sample: bool = True
    # The call's own seed (a sampler running beside the trainer must not share its RNG); None: the
    # backend draws from torch's global RNG, which the run seeds at each step.
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be an integer >= 0 or None, got {self.seed!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings, got {self.stop!r}")
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"do_sample must be a bool, got {self.do_sample!r}")
        object.__setattr__(self, "stop", tuple(self.stop))

    def for_call(self, index: int) -> "SamplingParams":
        """The params of a later call in the same batch (a retry round, an episode's next turn): with a
        seed, a seed of its own, so two calls never share a random stream; without one, unchanged."""
        if self.seed is None:
            return self
        mixed = int(np.random.SeedSequence([self.seed, index]).generate_state(1, np.uint64)[0] >> 2)
        return dataclasses.replace(self, seed=mixed)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    logps: list[float] | None = None  # behaviour log-probs, one per token
    loss_mask: list[int] | None = None  # 1: the model sampled the token; 0: the environment wrote it
    env_reward: float | None = None  # an episode's score from its environment (None: it gave none)

    def __post_init__(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if self.logps is not None and len(self.logps) != len(self.token_ids):
            raise ValueError(f"logps has {len(self.logps)} entries for {len(self.token_ids)} tokens")
        if self.loss_mask is not None and (
            len(self.loss_mask) != len(self.token_ids) or any(m not in (0, 1) for m in self.loss_mask)
        ):
            raise ValueError(f"loss_mask must hold one 0/1 per token ({len(self.token_ids)} tokens)")


@dataclass(frozen=True)
class PromptGroup:
    """What a backend returns for one prompt: up to ``num_generations`` completions."""

    prompt: str
    prompt_ids: list[int]
    completions: list[Completion]


class SamplerLost(UserError, RuntimeError):
    """The generation server stopped answering mid-batch and answered again (itself, or a replacement at
    its address, which holds other weights): the batch is sampled again, from the same seeds, once every
    process has agreed and the last pushed weights are back on it (``restore_weights``)."""


class SamplerGone(UserError):
    """The sampler cannot go on: its server stopped answering and did not answer again in time
    (``generation.vllm.server_wait_s``), or was lost again and again; the run stops with a checkpoint."""


class GenerationBackend(Protocol):
    def generate(self, prompts: list[str], num_generations: int, params: SamplingParams) -> list[PromptGroup]:
        """One ``PromptGroup`` per prompt, in order, each with at most ``num_generations`` completions.

        ``prompts`` are already chat-templated text; they are tokenized without
        adding special tokens.
        """
        ...

    def sync_weights(self, policy) -> None:
        """Make the backend sample from ``policy``'s current weights (called after each optimizer step).

        A no-op where the backend samples from the policy object itself (HF); a
        vLLM backend pushes the weights here.
        """
        ...

    def rollout_phase(self, policy) -> AbstractContextManager[None]:
        """The bracket around every generate call of one step (retries and dynamic-sampling rounds
        included) or of one evaluation: ``with backend.rollout_phase(policy): ...``.

        A no-op for HF and the server. A colocated vLLM engine with sleep mode wakes its KV
        cache once at the start and sleeps at the end (``rollout/vllm_sleep.py``); since that
        sleep discards its weights, it pushes ``policy`` first when no push came since.
        """
        ...


class TokenPrompts(abc.ABC):
    """``generate`` (chat-templated text) and ``generate_ids`` (token ids) for a backend that samples from
    token ids: both reach its ``_generate(prompts, prompt_ids, num_generations, params)``.

    ``generate_ids`` is how a multi-turn episode continues from exactly the ids it holds (re-tokenising its
    text could give other ids); each group's ``prompt`` is then the ids' decoding.
    """

    tokenizer: object

    def generate(self, prompts: list[str], num_generations: int, params: SamplingParams) -> list[PromptGroup]:
        if not prompts or not all(isinstance(p, str) and p for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty strings")
        prompt_ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        return self._generate(list(prompts), prompt_ids, num_generations, params)

    def generate_ids(
        self, prompt_ids: list[list[int]], num_generations: int, params: SamplingParams
    ) -> list[PromptGroup]:
        if not prompt_ids or not all(isinstance(p, list) and p for p in prompt_ids):
            raise ValueError("prompt_ids must be a non-empty list of non-empty token id lists")
        texts = self.tokenizer.batch_decode(prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self._generate(texts, prompt_ids, num_generations, params)

    @abc.abstractmethod
    def _generate(
        self, prompts: list[str], prompt_ids: list[list[int]], num_generations: int, params: SamplingParams
    ) -> list[PromptGroup]:
        """One group per prompt, from ``prompt_ids`` (``prompts`` is their text, kept in each group)."""


@dataclass(frozen=True)
class RolloutBatch:
    """``P`` prompts x ``G`` completions, prompt-major: rows ``p*G .. p*G+G-1`` belong to prompt ``p``."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    completion_texts: list[str]
    finish_reasons: list[str]
    behaviour_logps: list[list[float]] | None
    num_generations: int
    # Per-token 1/0: model / environment token (multi-turn episodes); None: every token the model's.
    loss_masks: list[list[int]] | None = None
    # Each episode's score from its environment (None where it gave none); None for one-shot prompts.
    env_rewards: list[float | None] | None = None

    def __post_init__(self) -> None:
        g = self.num_generations
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"num_generations must be a positive integer, got {g!r}")
        p = len(self.prompts)
        if len(self.prompt_ids) != p:
            raise ValueError(f"prompt_ids has {len(self.prompt_ids)} rows for {p} prompts")
        n = p * g
        for name, rows in (
            ("completion_ids", self.completion_ids),
            ("completion_texts", self.completion_texts),
            ("finish_reasons", self.finish_reasons),
        ):
            if len(rows) != n:
                raise ValueError(f"{name} has {len(rows)} rows, expected prompts x num_generations = {n}")
        bad = [r for r in self.finish_reasons if r not in FINISH_REASONS]
        if bad:
            raise ValueError(f"finish_reasons must be in {FINISH_REASONS}, got {bad[0]!r}")
        if self.behaviour_logps is not None:
            if len(self.behaviour_logps) != n or any(
                len(lp) != len(ids) for lp, ids in zip(self.behaviour_logps, self.completion_ids)
            ):
                raise ValueError("behaviour_logps must have one entry per completion token")
        if self.loss_masks is not None and (
            len(self.loss_masks) != n or any(len(m) != len(ids) for m, ids in zip(self.loss_masks, self.completion_ids))
        ):
            raise ValueError("loss_masks must have one entry per completion token")
        if self.env_rewards is not None and len(self.env_rewards) != n:
            raise ValueError(f"env_rewards has {len(self.env_rewards)} rows, expected {n}")

    @property
    def num_prompts(self) -> int:
        return len(self.prompts)

    @property
    def num_completions(self) -> int:
        return len(self.completion_ids)


def build_rollout_batch(groups: Sequence[PromptGroup], num_generations: int) -> RolloutBatch:
    """Lay out complete groups prompt-major. Behaviour log-probs are kept only if every completion has them."""
    for i, grp in enumerate(groups):
        if len(grp.completions) != num_generations:
            raise ValueError(f"groups[{i}] has {len(grp.completions)} completions, expected {num_generations}")
    comps = [c for grp in groups for c in grp.completions]
    with_logps = [c.logps is not None for c in comps]
    if any(with_logps) and not all(with_logps):
        raise ValueError("groups: some completions carry behaviour log-probs and some do not")
    return RolloutBatch(
        prompts=[grp.prompt for grp in groups],
        prompt_ids=[list(grp.prompt_ids) for grp in groups],
        completion_ids=[list(c.token_ids) for c in comps],
        completion_texts=[c.text for c in comps],
        finish_reasons=[c.finish_reason for c in comps],
        behaviour_logps=[list(c.logps) for c in comps] if comps and all(with_logps) else None,
        num_generations=num_generations,
        loss_masks=(
            [list(c.loss_mask) if c.loss_mask is not None else [1] * len(c.token_ids) for c in comps]
            if any(c.loss_mask is not None for c in comps) else None
        ),
        env_rewards=[c.env_reward for c in comps] if any(c.env_reward is not None for c in comps) else None,
    )


def select_groups(batch: RolloutBatch, keep: Sequence[int]) -> RolloutBatch:
    """The batch restricted to the prompts ``keep`` (in that order), each with its whole group."""
    g = batch.num_generations
    rows = [p * g + j for p in keep for j in range(g)]
    return RolloutBatch(
        prompts=[batch.prompts[p] for p in keep],
        prompt_ids=[batch.prompt_ids[p] for p in keep],
        completion_ids=[batch.completion_ids[i] for i in rows],
        completion_texts=[batch.completion_texts[i] for i in rows],
        finish_reasons=[batch.finish_reasons[i] for i in rows],
        behaviour_logps=None if batch.behaviour_logps is None else [batch.behaviour_logps[i] for i in rows],
        num_generations=g,
        loss_masks=None if batch.loss_masks is None else [batch.loss_masks[i] for i in rows],
        env_rewards=None if batch.env_rewards is None else [batch.env_rewards[i] for i in rows],
    )


def concat_rollouts(batches: Sequence[RolloutBatch]) -> RolloutBatch:
    """Prompt-major concatenation of batches with the same group size."""
    if not batches:
        raise ValueError("batches must not be empty")
    g = batches[0].num_generations
    if any(b.num_generations != g for b in batches):
        raise ValueError("batches: every batch must have the same num_generations")
    with_logps = all(b.behaviour_logps is not None for b in batches)
    with_masks = any(b.loss_masks is not None for b in batches)
    return RolloutBatch(
        prompts=[x for b in batches for x in b.prompts],
        prompt_ids=[x for b in batches for x in b.prompt_ids],
        completion_ids=[x for b in batches for x in b.completion_ids],
        completion_texts=[x for b in batches for x in b.completion_texts],
        finish_reasons=[x for b in batches for x in b.finish_reasons],
        behaviour_logps=[x for b in batches for x in b.behaviour_logps] if with_logps else None,
        num_generations=g,
        loss_masks=[
            m for b in batches
            for m in (b.loss_masks if b.loss_masks is not None else [[1] * len(ids) for ids in b.completion_ids])
        ] if with_masks else None,
        env_rewards=[
            r for b in batches for r in (b.env_rewards if b.env_rewards is not None else [None] * b.num_completions)
        ] if any(b.env_rewards is not None for b in batches) else None,
    )


def generate_groups(
    backend: GenerationBackend,
    prompts: list[str],
    num_generations: int,
    params: SamplingParams,
    *,
    max_retry_rounds: int = 2,
) -> tuple[RolloutBatch, list[int]]:
    """Generate ``num_generations`` completions per prompt, re-asking for missing ones.

    Returns the batch of complete groups (in prompt order) and the indices of the
    prompts whose groups were still incomplete after ``max_retry_rounds`` and were dropped.
    """
    if isinstance(max_retry_rounds, bool) or not isinstance(max_retry_rounds, int) or max_retry_rounds < 0:
        raise ValueError(f"max_retry_rounds must be an integer >= 0, got {max_retry_rounds!r}")
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be a positive integer, got {num_generations!r}")
    if not prompts:
        raise ValueError("prompts must not be empty")

    groups = _checked(backend.generate(list(prompts), num_generations, params), prompts, num_generations)
    collected = [list(g.completions) for g in groups]
    for round_index in range(1, max_retry_rounds + 1):
        missing: dict[int, list[int]] = {}  # how many are missing -> prompt indices
        for i, comps in enumerate(collected):
            if len(comps) < num_generations:
                missing.setdefault(num_generations - len(comps), []).append(i)
        if not missing:
            break
        for k, idx in sorted(missing.items()):
            asked = [prompts[i] for i in idx]
            for i, grp in zip(idx, _checked(backend.generate(asked, k, params.for_call(round_index)), asked, k)):
                collected[i].extend(grp.completions)

    kept = [
        PromptGroup(prompt=g.prompt, prompt_ids=g.prompt_ids, completions=c)
        for g, c in zip(groups, collected)
        if len(c) == num_generations
    ]
    dropped = [i for i, c in enumerate(collected) if len(c) != num_generations]
    return build_rollout_batch(kept, num_generations), dropped


def _checked(groups: list[PromptGroup], prompts: Sequence[str], num_generations: int) -> list[PromptGroup]:
    if len(groups) != len(prompts):
        raise ValueError(f"backend returned {len(groups)} groups for {len(prompts)} prompts")
    for i, (grp, prompt) in enumerate(zip(groups, prompts)):
        if grp.prompt != prompt:
            raise ValueError(f"backend returned group {i} for a different prompt")
        if len(grp.completions) > num_generations:
            raise ValueError(f"backend returned {len(grp.completions)} completions for group {i}, asked for {num_generations}")
    return groups


@dataclass(frozen=True)
class PackedRollout:
    """Padded tensors of a ``RolloutBatch``: prompts left-padded to ``prompt_length``, completions right-padded."""

    input_ids: torch.Tensor  # [N, Lp + T] long
    attention_mask: torch.Tensor  # [N, Lp + T] long
    completion_mask: torch.Tensor  # [N, T] float32: 1 on the model's tokens, 0 on padding and environment tokens
    prompt_length: int  # Lp
    behaviour_logps: torch.Tensor | None  # [N, T] float32, 0 at padding
    truncated: torch.Tensor  # [N] bool: finish_reason == "length"
    completion_lengths: torch.Tensor  # [N] long


def pack_rollout(batch: RolloutBatch, pad_token_id: int, *, device: str | torch.device = "cpu") -> PackedRollout:
    if batch.num_completions == 0:
        raise ValueError("batch holds no completions")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a non-negative integer, got {pad_token_id!r}")
    g = batch.num_generations
    n = batch.num_completions
    lp = max(len(ids) for ids in batch.prompt_ids)
    t = max(len(ids) for ids in batch.completion_ids)
    input_ids = torch.full((n, lp + t), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, lp + t), dtype=torch.long)
    completion_mask = torch.zeros((n, t), dtype=torch.float32)
    logps = torch.zeros((n, t), dtype=torch.float32) if batch.behaviour_logps is not None else None
    for i, comp in enumerate(batch.completion_ids):
        prompt = batch.prompt_ids[i // g]
        input_ids[i, lp - len(prompt) : lp] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[i, lp - len(prompt) : lp] = 1
        if comp:
            input_ids[i, lp : lp + len(comp)] = torch.tensor(comp, dtype=torch.long)
            attention_mask[i, lp : lp + len(comp)] = 1
            completion_mask[i, : len(comp)] = (
                1.0 if batch.loss_masks is None else torch.tensor(batch.loss_masks[i], dtype=torch.float32)
            )
            if logps is not None:
                logps[i, : len(comp)] = torch.tensor(batch.behaviour_logps[i], dtype=torch.float32)
    return PackedRollout(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        completion_mask=completion_mask.to(device),
        prompt_length=lp,
        behaviour_logps=logps.to(device) if logps is not None else None,
        truncated=torch.tensor([r == "length" for r in batch.finish_reasons], dtype=torch.bool, device=device),
        completion_lengths=torch.tensor([len(c) for c in batch.completion_ids], dtype=torch.long, device=device),
    )
