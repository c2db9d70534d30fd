"""Per-token log-probs and entropies of completion tokens (ALGORITHMS.md §1).

The model-facing entry points. The arithmetic on logits is in
``chunked_softmax`` (rows of ``[*, V]`` logits, chunked forward and backward)
and ``fused_lm_head`` (the same from the last hidden states and the LM head, so
that the ``[tokens, V]`` logits are never built).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from maxent_grpo.core.chunked_softmax import (
    DEFAULT_CHUNK_ROWS,
    check_chunk_rows,
    check_ids,
    check_temperature,
    selective_logps,
)
from maxent_grpo.core.completion_logits import (
    completion_hidden_states,
    completion_logits,
    forward_layout,
    lm_head,
    supports_fused_head,
)
from maxent_grpo.core.fp32_head import is_fp32_head
from maxent_grpo.core.fused_lm_head import lm_head_logps

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "Scoring",
    "compute_per_token_logps",
    "compute_per_token_logps_and_entropies",
    "get_per_token_logps",
    "get_per_token_logps_and_entropies",
    "per_token_logp",
    "selective_logps",
]


def per_token_logp(seq_logp_sum: torch.Tensor, token_counts: torch.Tensor) -> torch.Tensor:
    """The one length normalisation of a sequence log-prob: its mean per completion token.

    ``seq_logp_sum`` (any shape) is summed over ``token_counts`` (same shape) tokens. The
    raw sum favours short completions; the listwise reference term, xDr's reference
    anchor and SEED's cluster masses all use this mean instead. A completion with no
    token counts as one, so its sum (0) stays 0.
    """
    if token_counts.shape != seq_logp_sum.shape:
        raise ValueError(f"token_counts {tuple(token_counts.shape)} must have the shape of "
                         f"seq_logp_sum {tuple(seq_logp_sum.shape)}")
    return seq_logp_sum / token_counts.to(seq_logp_sum.dtype).clamp(min=1)


def _check_prompt_length(prompt_length: int, seq_len: int) -> int:
    p = operator.index(prompt_length)
    if not 1 <= p <= seq_len:
        raise ValueError(f"prompt_length must be in [1, {seq_len}] (the sequence length), got {prompt_length}")
    return p


def _check_input_ids(input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")


def compute_per_token_logps(logits: torch.Tensor, input_ids: torch.Tensor, prompt_length: int,
                            **options) -> torch.Tensor:
    """Log-probs of the completion tokens ``input_ids[:, prompt_length:]``.

    ``logits`` are either the model's outputs for the whole ``input_ids``
    (``[B, L, V]``; position ``t`` predicts token ``t+1``, so positions
    ``prompt_length-1 .. L-2`` are used) or already trimmed to those positions
    (``[B, L - prompt_length, V]``). Returns ``[B, L - prompt_length]``. Options
    (``temperature``, ``chunk_rows``) as :func:`compute_per_token_logps_and_entropies`'s.
    """
    logps, _ = compute_per_token_logps_and_entropies(logits, input_ids, prompt_length, with_entropy=False, **options)
    return logps


def compute_per_token_logps_and_entropies(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    prompt_length: int,
    *,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Like :func:`compute_per_token_logps`, also returning token entropies ``[B, L - prompt_length]``."""
    _check_input_ids(input_ids)
    seq_len = input_ids.shape[1]
    prompt_length = _check_prompt_length(prompt_length, seq_len)
    if logits.dim() != 3 or logits.shape[0] != input_ids.shape[0]:
        raise ValueError(f"logits must be [B, L, V] with B = {input_ids.shape[0]}, got {tuple(logits.shape)}")
    if logits.shape[1] == seq_len:
        logits = logits[:, prompt_length - 1 : -1]
    elif logits.shape[1] != seq_len - prompt_length:
        raise ValueError(
            f"logits have {logits.shape[1]} positions; expected {seq_len} (whole sequence) "
            f"or {seq_len - prompt_length} (completion only)"
        )
    targets = input_ids[:, prompt_length:]
    check_ids(targets, logits.shape[-1], "input_ids")
    return selective_logps(
        logits, targets, temperature=temperature, with_entropy=with_entropy, chunk_rows=chunk_rows
    )


def get_per_token_logps(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                        **options) -> torch.Tensor:
    """Completion-token log-probs ``[B, L - prompt_length]`` of ``model``: the log-probs of
    :func:`get_per_token_logps_and_entropies`, with its options (``temperature``, ``chunk_rows``,
    ``share_prompts``, ``fused_head``, ``pack``) and no entropies."""
    logps, _ = get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, prompt_length, with_entropy=False, **options
    )
    return logps


def get_per_token_logps_and_entropies(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    *,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    with_entropy: bool = True,
    share_prompts: bool = True,
    fused_head: bool = True,
    pack: bool = False,
    inline_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``model`` over prompt+completion (``[B, L]``, prompts left-padded,
    ``attention_mask`` 0 on padding); return completion log-probs and token entropies,
    both ``[B, L - prompt_length]`` (entropies ``None`` unless ``with_entropy``).
    ``share_prompts``: run each distinct prompt row once (see ``completion_logits``).
    ``fused_head``: apply the LM head chunk by chunk (``fused_lm_head``), so the
    ``[B, T, V]`` logits never exist, where the model family allows it
    (``supports_fused_head``); otherwise the model's own logits are used.
    ``pack``: run the rows padding-free (``core/packing.py``): with ``share_prompts``, each distinct
    prompt once and its completions packed behind it; otherwise whole rows. ``inline_prompts`` (shared and
    packed): each prompt in the same forward as its completions, one row per prompt, rather than through
    a KV cache (``core/packing.inline_prompt_inputs``).

    Values at padded completion positions are meaningless; mask them downstream.
    """
    _check_input_ids(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
        )
    temperature = check_temperature(temperature)
    chunk_rows = check_chunk_rows(chunk_rows)
    prompt_length = _check_prompt_length(prompt_length, input_ids.shape[1])
    check_ids(input_ids, model.config.get_text_config().vocab_size, "input_ids")
    targets = input_ids[:, prompt_length:]
    if fused_head and supports_fused_head(model):
        hidden = completion_hidden_states(model, input_ids, attention_mask, prompt_length,
                                          share_prompts=share_prompts, pack=pack, inline_prompts=inline_prompts)
        head = lm_head(model)  # after the forward (see lm_head)
        return lm_head_logps(
            hidden, head.weight, head.bias, targets,
            temperature=temperature, with_entropy=with_entropy, chunk_rows=chunk_rows, fp32=is_fp32_head(head),
        )
    logits = completion_logits(model, input_ids, attention_mask, prompt_length, share_prompts=share_prompts, pack=pack,
                               inline_prompts=inline_prompts)
    return selective_logps(
        logits, targets, temperature=temperature, with_entropy=with_entropy, chunk_rows=chunk_rows,
    )


@dataclass(frozen=True)
class Scoring:
    """How the trainer scores completions under a model, the same for the policy step, the
    reference, the pre-update policy and the entropy pass.

    ``temperature``: the sampling temperature (the logits are divided by it, as the sampler's
    were). ``share_prompts``: each distinct prompt of a batch runs once
    (``completion_logits``). ``packing``: the rows run padding-free (``core/packing.py``); with
    ``share_prompts`` each distinct prompt runs once and its completions are packed behind it (whole
    rows are packed under flash attention). ``autocast_bf16``: bf16 matmuls over the model's own weights
    (``torch.autocast``), around the forward only. ``rows_per_pass``: rows per forward when
    scoring without gradients (:meth:`score_rows`).
    """

    temperature: float = 1.0
    share_prompts: bool = True
    autocast_bf16: bool = False
    rows_per_pass: int = 8
    packing: bool = False
    inline_prompts: bool = False  # shared and packed: prompt and completions in one forward (no KV cache)

    def __post_init__(self) -> None:
        check_temperature(self.temperature)
        if self.rows_per_pass < 1:
            raise ValueError(f"rows_per_pass must be >= 1, got {self.rows_per_pass}")

    def logps(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, *,
              with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Completion log-probs (and entropies) ``[B, L - prompt_length]`` of ``model``, with gradients."""
        with torch.autocast(input_ids.device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16):
            return get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, prompt_length, temperature=self.temperature,
                with_entropy=with_entropy, share_prompts=self.share_prompts, pack=self.packing,
                inline_prompts=self.inline_prompts,
            )

    def forward_positions(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          prompt_length: int) -> int:
        """Token positions one :meth:`logps` call runs ``model`` over (``ForwardLayout.positions``)."""
        layout = forward_layout(model, input_ids, attention_mask, prompt_length,
                                share_prompts=self.share_prompts, pack=self.packing,
                                inline_prompts=self.inline_prompts)
        return layout.positions(input_ids, attention_mask, prompt_length)

    def score_rows(self, model, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, *,
                   with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`logps` without gradients, ``rows_per_pass`` rows at a time, concatenated."""
        outs, ents = [], []
        with torch.no_grad():
            for s in range(0, input_ids.shape[0], self.rows_per_pass):
                sl = slice(s, s + self.rows_per_pass)
                logp, ent = self.logps(model, input_ids[sl], attention_mask[sl], prompt_length,
                                       with_entropy=with_entropy)
                outs.append(logp)
                ents.append(ent)
        return torch.cat(outs), (torch.cat(ents) if with_entropy else None)
