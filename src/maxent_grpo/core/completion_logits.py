"""The model's logits (or its last hidden states) at the positions that predict each completion token.

A GRPO batch holds ``G`` completions per prompt, so a plain forward over
``[prompt + completion]`` rows runs every prompt ``G`` times. When prompts are
long next to completions (few-shot demonstrations, system prompts, short
answers) that repeated prompt work is most of the forward and backward.

With ``share_prompts`` each distinct prompt row runs once: its keys and values
(kept in the autograd graph) are gathered to every row that shares it, and the
completions attend to them through the KV cache. The gradient of the shared
prompt work is the sum over the rows that used it, exactly as in the plain
forward; only the order of floating-point sums differs.

``completion_hidden_states`` runs the same forwards but asks the model for no
logits at all (``logits_to_keep`` an empty index tensor) and takes the final,
normed hidden states from its decoder, for ``fused_lm_head``. The forward still
goes through the model's own ``forward`` (not the decoder's), so that a DDP or
FSDP2 wrapper sees the call it needs to synchronise gradients or gather weights.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch

from maxent_grpo.core.packing import (
    inline_prompt_inputs, pack_plan, pack_plan_by_group, packed_inputs, prefixed_packed_inputs, unpack_behind_prompt,
    unpack_completion,
)


@functools.cache
def cache_kwarg() -> str:
    """The name transformers uses for the KV cache, as a forward / ``generate`` argument and an output field.

    Newer transformers (5.24 here) call it ``cache``: ``past_key_values`` still works but warns
    (a FutureWarning; removed for the forwards in 5.40, for ``generate`` in 6.0). Older releases,
    such as the <5.20 that the vLLM environment pins, know only ``past_key_values``. We use the
    name ``generate`` itself hands the model's forward.
    """
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    # Left padding: positions count real tokens, as during generation, so
    # absolute-position models see the same positions they sampled with.
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    # A DistributedDataParallel wrapper syncs gradients through hooks on the
    # parameters, which fire once per backward whichever forward used them; its
    # own forward must run only once per backward, so the prompt pass bypasses it.
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def distinct_prompt_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, inverse)``: one row index per distinct prompt, and each row's distinct prompt."""
    key = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    rows = torch.arange(key.shape[0], device=key.device)
    first = torch.full((int(inverse.max()) + 1,), key.shape[0], dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


@dataclass(frozen=True)
class ForwardLayout:
    """How one scoring call runs the model over its ``[B, L]`` rows (:func:`forward_layout`).

    ``kind``: ``"inline"`` (one forward: each distinct prompt once with its group's completions packed
    behind it in the same row, a completion seeing the prompt and itself only), ``"shared_packed"``
    (each distinct prompt once, its completions packed behind it through its KV cache), ``"packed"`` (whole rows packed padding-free), ``"shared"`` (each
    distinct prompt once, the padded completions through its KV cache) or ``"plain"`` (one padded
    forward). ``first`` / ``inverse``: :func:`distinct_prompt_rows`, for the shared kinds. ``flash``:
    the attention is flash attention's variable-length kernel (whole rows pack into one bin).
    """

    kind: str
    flash: bool
    first: torch.Tensor | None = None
    inverse: torch.Tensor | None = None

    def positions(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> int:
        """Token positions the forwards run the model over: ``B * L`` padded, each distinct prompt once
        plus every completion slot when shared, the bins' widths when packed."""
        b, length = input_ids.shape
        if self.kind == "inline":
            return len(self.first) * _inline_width(attention_mask, prompt_length, self.first, self.inverse)
        if self.kind == "shared_packed":
            bins = completion_pack_plan(attention_mask, prompt_length, self.inverse)[0]
            return len(self.first) * prompt_length + bins.computed_tokens
        if self.kind == "packed":
            return _row_pack_plan(attention_mask, self.flash).computed_tokens
        if self.kind == "shared":
            return len(self.first) * prompt_length + b * (length - prompt_length)
        return b * length


def forward_layout(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   prompt_length: int, *, share_prompts: bool, pack: bool, inline_prompts: bool = False) -> ForwardLayout:
    """The one place the layout is chosen. Prompts are shared when ``share_prompts``, there are
    completion positions and some row repeats a prompt; under ``pack`` too unless the attention is
    flash attention (its variable-length kernel has no cached prefix: it packs whole rows). Shared and
    packed, ``inline_prompts`` runs each prompt in the same forward as its completions (``"inline"``)
    rather than through a KV cache."""
    flash = _unwrapped(model).config._attn_implementation.startswith("flash")
    if share_prompts and input_ids.shape[1] > prompt_length and not (pack and flash):
        first, inverse = distinct_prompt_rows(input_ids[:, :prompt_length], attention_mask[:, :prompt_length])
        if first.numel() < input_ids.shape[0]:
            kind = ("inline" if inline_prompts else "shared_packed") if pack else "shared"
            return ForwardLayout(kind, flash, first, inverse)
    return ForwardLayout("packed" if pack else "plain", flash)


def _row_pack_plan(attention_mask: torch.Tensor, flash: bool):
    """Whole rows' :class:`PackPlan`. Flash attention takes packed rows as position_ids that restart
    per sequence (varlen), no mask, and costs nothing for the keys a sequence does not see: the whole
    micro-batch in one row. A dense mask (sdpa, eager) costs attention over the whole bin: bins no
    wider than the padded rows."""
    if flash:
        return pack_plan(attention_mask, capacity=int(attention_mask.sum(dim=1).sum()))
    return pack_plan(attention_mask)


def _packed_forward(model, input_ids, attention_mask, flash, with_logits):
    """One forward over the rows packed padding-free; the model's output and the :class:`PackPlan`."""
    plan = _row_pack_plan(attention_mask, flash)
    if flash:
        inputs = packed_inputs(input_ids, plan, mask=None)
    else:  # sdpa takes a boolean 4-D mask; eager adds its mask to the scores, so it gets an additive one
        impl = _unwrapped(model).config._attn_implementation
        inputs = packed_inputs(input_ids, plan, mask="bool" if impl == "sdpa" else "additive",
                               mask_dtype=next(model.parameters()).dtype)
    no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)
    out = model(**inputs, logits_to_keep=0 if with_logits else no_logits, use_cache=False)
    return out, plan


def completion_pack_plan(attention_mask: torch.Tensor, prompt_length: int, inverse: torch.Tensor):
    """The completions' :func:`pack_plan_by_group` by shared prompt. An empty completion keeps one
    slot (its output is never read), so every row has a real token to pack."""
    completion_mask = attention_mask[:, prompt_length:].clone()
    completion_mask[:, 0] = 1
    return pack_plan_by_group(completion_mask, inverse)


def _shared_packed_forward(model, input_ids, attention_mask, prompt_length, layout, with_logits):
    """Each distinct prompt once (KV cache kept in the graph), then every bin of its completions,
    packed padding-free, through that cache. Returns the two outputs and the completions' plan."""
    first, inverse = layout.first, layout.inverse
    no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)
    prompt_mask = attention_mask[first, :prompt_length]
    prompt = _unwrapped(model)(
        input_ids=input_ids[first, :prompt_length], attention_mask=prompt_mask,
        position_ids=position_ids(prompt_mask), logits_to_keep=1 if with_logits else no_logits, use_cache=True,
    )
    plan, bin_prompt = completion_pack_plan(attention_mask, prompt_length, inverse)
    cache = getattr(prompt, cache_kwarg())
    cache.batch_select_indices(bin_prompt)
    impl = _unwrapped(model).config._attn_implementation
    inputs = prefixed_packed_inputs(input_ids[:, prompt_length:], plan, prompt_mask[bin_prompt],
                                    mask="bool" if impl == "sdpa" else "additive",
                                    mask_dtype=next(model.parameters()).dtype)
    rest = model(**inputs, **{cache_kwarg(): cache}, use_cache=True, logits_to_keep=0 if with_logits else no_logits)
    return prompt, rest, plan


def _inline_width(attention_mask: torch.Tensor, prompt_length: int, first: torch.Tensor,
                  inverse: torch.Tensor) -> int:
    """The width of :func:`inline_prompt_inputs`'s rows: the longest prompt plus its group's completions."""
    lengths = attention_mask[:, prompt_length:].sum(dim=1).clamp(min=1)
    per_prompt = torch.zeros(first.numel(), dtype=lengths.dtype, device=lengths.device).index_add(0, inverse, lengths)
    return int((attention_mask[first, :prompt_length].sum(dim=1) + per_prompt).max())


def _inline_forward(model, input_ids, attention_mask, prompt_length, layout, with_logits):
    """One forward over one row per distinct prompt, its completions packed behind it in the row
    (:func:`inline_prompt_inputs`). Returns the output, the completions' plan and each prompt's last position."""
    impl = _unwrapped(model).config._attn_implementation
    inputs, plan, prompt_last = inline_prompt_inputs(
        input_ids, attention_mask, prompt_length, layout.first, layout.inverse,
        mask="bool" if impl == "sdpa" else "additive", mask_dtype=next(model.parameters()).dtype)
    no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)
    out = model(**inputs, logits_to_keep=0 if with_logits else no_logits, use_cache=False)
    return out, plan, prompt_last


def _forwards(model, input_ids, attention_mask, prompt_length, layout, with_logits):
    """Run the model over prompt+completion, padded: the shared-prompt pair of forwards (prompt rows
    once, then the completions through the KV cache) or the one plain forward; return the outputs.

    ``with_logits``: the LM head only where a completion token is predicted; otherwise
    nowhere (``logits_to_keep`` an empty index tensor).
    """
    positions = position_ids(attention_mask)
    completion_length = input_ids.shape[1] - prompt_length
    no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)
    if layout.kind == "shared":
        prompt_mask = attention_mask[layout.first, :prompt_length]
        prompt = _unwrapped(model)(
            input_ids=input_ids[layout.first, :prompt_length],
            attention_mask=prompt_mask,
            position_ids=position_ids(prompt_mask),
            logits_to_keep=1 if with_logits else no_logits,
            use_cache=True,
        )
        cache = getattr(prompt, cache_kwarg())
        cache.batch_select_indices(layout.inverse)
        rest = model(
            input_ids=input_ids[:, prompt_length:],
            attention_mask=attention_mask,
            position_ids=positions[:, prompt_length:],
            **{cache_kwarg(): cache},
            use_cache=True,
            **({} if with_logits else {"logits_to_keep": no_logits}),
        )
        return [prompt, rest]
    # logits_to_keep skips the LM head over the prompt (T+1 keeps the position
    # that predicts the first completion token).
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=positions,
        logits_to_keep=completion_length + 1 if with_logits else no_logits,
        use_cache=False,
    )
    return [out]


def completion_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      prompt_length: int, **layout) -> torch.Tensor:
    """Logits ``[B, L - prompt_length, V]``; position ``t`` predicts ``input_ids[:, prompt_length + t]``.

    ``input_ids`` / ``attention_mask`` are ``[B, L]`` with prompts left-padded to
    ``prompt_length``. The plain path runs one forward (LM head only where needed);
    ``share_prompts`` (default on) runs each distinct prompt row once when some row repeats;
    ``pack`` (default off) runs the rows padding-free: with ``share_prompts``, each distinct
    prompt once and its completions packed behind it, otherwise whole rows (the choice:
    :func:`forward_layout`).
    """
    return _completion_positions(model, input_ids, attention_mask, prompt_length, with_logits=True, **layout)


def _completion_positions(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    *,
    with_logits: bool,
    share_prompts: bool = True,
    pack: bool = False,
    inline_prompts: bool = False,
) -> torch.Tensor:
    """The forwards :func:`forward_layout` chooses, and the completion positions' logits
    (``with_logits``) or final hidden states, ``[B, L - prompt_length, V or H]``: the one body of
    :func:`completion_logits` and :func:`completion_hidden_states`."""
    layout = forward_layout(model, input_ids, attention_mask, prompt_length, share_prompts=share_prompts, pack=pack,
                            inline_prompts=inline_prompts)
    completion_length = input_ids.shape[1] - prompt_length
    captured: list[torch.Tensor] = []
    with contextlib.nullcontext() if with_logits else _last_hidden_states(model, captured):
        if layout.kind == "inline":
            out, plan, prompt_last = _inline_forward(model, input_ids, attention_mask, prompt_length, layout,
                                                     with_logits=with_logits)
            outs = [out]
        elif layout.kind == "shared_packed":
            *outs, plan = _shared_packed_forward(model, input_ids, attention_mask, prompt_length, layout,
                                                 with_logits=with_logits)
        elif layout.kind == "packed":
            *outs, plan = _packed_forward(model, input_ids, attention_mask, layout.flash, with_logits=with_logits)
        else:
            outs = _forwards(model, input_ids, attention_mask, prompt_length, layout, with_logits=with_logits)
    states = [out.logits for out in outs] if with_logits else captured
    if layout.kind == "inline":
        packed = states[0]
        last = packed[torch.arange(packed.shape[0], device=packed.device), prompt_last]
        return unpack_behind_prompt(last, packed, plan, layout.inverse, completion_length)
    if layout.kind == "shared_packed":
        prompt, rest = states
        return unpack_behind_prompt(prompt[:, -1], rest, plan, layout.inverse, completion_length)
    if layout.kind == "packed":
        return unpack_completion(states[0], plan, prompt_length, input_ids.shape[1])
    if layout.kind == "shared":
        prompt, rest = states
        return torch.cat([prompt[layout.inverse, -1:], rest[:, :-1]], dim=1)
    # Logits were kept for the last completion_length + 1 positions, hidden states for all L.
    return states[0][:, -(completion_length + 1) : -1]


# Model families whose CausalLM computes ``logits = lm_head(decoder(...).last_hidden_state)``
# with nothing after the head (no soft-capping, no logit scale; read from their modeling
# files): only for these is the fused LM head the same function as the model.
FUSED_HEAD_MODEL_TYPES = frozenset({
    "llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo2", "smollm3",
})


def supports_fused_head(model: torch.nn.Module) -> bool:
    """Whether ``completion_hidden_states`` + the LM head compute exactly the model's logits."""
    return (
        _unwrapped(model).config.get_text_config().model_type in FUSED_HEAD_MODEL_TYPES
        and isinstance(lm_head(model), torch.nn.Linear)
    )


def lm_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The model's LM head. Read its weight after the forward: FSDP2 swaps the gathered
    (unsharded) weight in for the forward and keeps it there until the backward has used it."""
    return _unwrapped(model).get_output_embeddings()


@contextlib.contextmanager
def _last_hidden_states(model: torch.nn.Module, into: list):
    """Append the decoder's output hidden states ``[B, L, H]`` to ``into`` on every model forward."""
    handle = _unwrapped(model).get_decoder().register_forward_hook(lambda _m, _i, out: into.append(out[0]))
    try:
        yield
    finally:
        handle.remove()


def completion_hidden_states(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             prompt_length: int, **layout) -> torch.Tensor:
    """Final hidden states ``[B, L - prompt_length, H]``; position ``t`` predicts ``input_ids[:, prompt_length + t]``.

    The same forwards as :func:`completion_logits` (and its ``share_prompts`` / ``pack``) with no
    LM head applied: the logits at those positions are ``model.get_output_embeddings()(hidden)``.
    """
    return _completion_positions(model, input_ids, attention_mask, prompt_length, with_logits=False, **layout)
