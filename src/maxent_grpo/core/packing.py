"""Padding-free scoring: the real tokens of a padded ``[B, L]`` batch packed into fewer, fuller rows.

A GRPO batch is padded twice: prompts on the left to the longest prompt, completions on
the right to the longest completion. Completions of one group vary a lot (11-37 of 64
tokens for SmolLM2 on chain_sum; 100-4000 of 4096 on the GPU recipes), so a padded
forward spends much of its work on padding. Packing (as verl's ``use_remove_padding``,
TRL's ``padding_free``, NeMo-RL's sequence packing) lays each row's real tokens end to end
in bins of at most ``capacity`` tokens (first-fit decreasing; the padded width by default, the
whole micro-batch in one row for flash attention's variable-length kernel), restarts the positions at
each row's first token, and keeps the rows apart with a block-diagonal causal mask
``[bins, 1, C, C]`` (a segment attends to its own earlier tokens only). The model computes
the same function of every row as in the padded batch (the masked keys add exact zeros),
so the completion log-probs, and the loss and gradients built on them, equal the padded
path's up to the order of floating-point sums.

With shared prompts (:func:`pack_plan_by_group`, :func:`prefixed_packed_inputs`) each distinct
prompt runs once and only the completions are packed, each bin holding completions of one
prompt and attending to that prompt's KV cache through a ``[bins, 1, width, P + width]`` mask:
the prompt is computed once per prompt instead of once per row, and the completions with no
padding (SmolLM2-135M, 4 prompts x 8 completions of 64 tokens: BENCHMARKS.md §10).

Pure index arithmetic: :func:`pack_plan` decides where each row goes, :func:`packed_inputs`
builds the model's inputs, :func:`unpack_completion` gathers the outputs that predict each
completion token back to ``[B, T, ...]`` (padded completion positions get a copy of a real
one: meaningless, as in the padded path, and masked downstream).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PackPlan", "inline_prompt_inputs", "pack_plan", "pack_plan_by_group", "packed_inputs", "prefixed_packed_inputs",
           "unpack_completion", "unpack_behind_prompt"]


@dataclass(frozen=True)
class PackPlan:
    """Where each row's real tokens sit after packing.

    ``start`` [B]: the row's first real token in the padded batch (its tokens are
    ``start .. start + length - 1``, contiguous); ``length`` [B]; ``bin`` [B] and ``offset`` [B]:
    the packed row holding them and where they begin in it; ``bins``, ``width``: the packed
    batch's shape ``[bins, width]``.
    """

    start: torch.Tensor
    length: torch.Tensor
    bin: torch.Tensor
    offset: torch.Tensor
    bins: int
    width: int

    @property
    def computed_tokens(self) -> int:
        """Positions the packed forward computes (``bins * width``; the padded one computes ``B * L``)."""
        return self.bins * self.width


def pack_plan(attention_mask: torch.Tensor, capacity: int | None = None) -> PackPlan:
    """First-fit decreasing of the rows of ``attention_mask`` ``[B, L]`` (1 on real tokens, which
    must be one contiguous span per row: left-padded prompt, completion, right padding) into bins of
    at most ``capacity`` tokens (default ``L``, the padded width: no bin is wider than the padded
    batch, so a dense mask's attention costs no more than padding's). Deterministic: rows of equal
    length are placed in row order."""
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, L], got shape {tuple(attention_mask.shape)}")
    mask = attention_mask.bool().cpu()
    length = mask.sum(dim=1)
    if int(length.min()) < 1:
        raise ValueError("every row needs at least one real token to be packed")
    start = mask.int().argmax(dim=1)
    span = torch.arange(mask.shape[1]).unsqueeze(0)
    contiguous = (span >= start.unsqueeze(1)) & (span < (start + length).unsqueeze(1))
    if not torch.equal(contiguous, mask):
        raise ValueError("packing needs each row's real tokens in one contiguous span (attention_mask has holes)")
    cap = mask.shape[1] if capacity is None else int(capacity)
    if cap < int(length.max()):
        raise ValueError(f"capacity {cap} is shorter than the longest row ({int(length.max())} tokens)")
    fill: list[int] = []
    bin_of, offset_of = [0] * len(length), [0] * len(length)
    for i in sorted(range(len(length)), key=lambda r: (-int(length[r]), r)):
        n = int(length[i])
        b = next((b for b, used in enumerate(fill) if used + n <= cap), len(fill))
        if b == len(fill):
            fill.append(0)
        bin_of[i], offset_of[i] = b, fill[b]
        fill[b] += n
    dev = attention_mask.device
    return PackPlan(start=start.to(dev), length=length.to(dev), bin=torch.tensor(bin_of, device=dev),
                    offset=torch.tensor(offset_of, device=dev), bins=len(fill), width=max(fill))


def pack_plan_by_group(attention_mask: torch.Tensor, group: torch.Tensor,
                       capacity: int | None = None) -> tuple[PackPlan, torch.Tensor]:
    """:func:`pack_plan` within each group of rows (``group`` [B]: ids ``0 .. D-1``), so that no bin holds
    rows of two groups; bins are numbered group by group. Returns the merged plan and each bin's
    group ``[bins]``."""
    b = attention_mask.shape[0]
    if group.shape != (b,):
        raise ValueError(f"group must be [B] = [{b}], got shape {tuple(group.shape)}")
    dev = attention_mask.device
    start, length, bin_of, offset = (torch.zeros(b, dtype=torch.long, device=dev) for _ in range(4))
    bin_group: list[int] = []
    width = 0
    for d in sorted(set(group.tolist())):
        rows = (group == d).nonzero()[:, 0]
        plan = pack_plan(attention_mask[rows], capacity)
        start[rows], length[rows], offset[rows] = plan.start, plan.length, plan.offset
        bin_of[rows] = plan.bin + len(bin_group)
        bin_group += [d] * plan.bins
        width = max(width, plan.width)
    return (PackPlan(start=start, length=length, bin=bin_of, offset=offset, bins=len(bin_group), width=width),
            torch.tensor(bin_group, dtype=torch.long, device=dev))


def _token_places(plan: PackPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every real token of the padded batch: (row, column in the padded row, bin, column in the bin)."""
    rows = torch.repeat_interleave(torch.arange(len(plan.length), device=plan.length.device), plan.length)
    first = torch.cumsum(plan.length, 0) - plan.length
    within = torch.arange(int(plan.length.sum()), device=rows.device) - first[rows]
    return rows, plan.start[rows] + within, plan.bin[rows], plan.offset[rows] + within


def packed_inputs(input_ids: torch.Tensor, plan: PackPlan, *, pad_id: int = 0,
                  mask: str | None = "bool", mask_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor | None]:
    """``input_ids``, ``position_ids`` ``[bins, width]`` and the 4-D block-diagonal causal
    ``attention_mask`` ``[bins, 1, width, width]`` of the packed batch: ``mask="bool"`` (True = attend,
    for sdpa), ``"additive"`` (0 / the min of ``mask_dtype``, for attention that adds its mask to the
    scores: eager), or None (no mask: flash attention's variable-length kernel reads the sequences off
    the restarting ``position_ids``). A bin's unused tail attends to itself only (its outputs are never read)."""
    if mask not in ("bool", "additive", None):
        raise ValueError(f"mask must be 'bool', 'additive' or None, got {mask!r}")
    rows, cols, bins, places = _token_places(plan)
    ids = torch.full((plan.bins, plan.width), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[bins, places] = input_ids[rows, cols]
    positions = torch.zeros((plan.bins, plan.width), dtype=torch.long, device=input_ids.device)
    positions[bins, places] = cols - plan.start[rows]
    if mask is None:
        return {"input_ids": ids, "position_ids": positions, "attention_mask": None}
    segment = torch.full((plan.bins, plan.width), -1, dtype=torch.long, device=input_ids.device)
    segment[bins, places] = rows
    causal = torch.ones(plan.width, plan.width, dtype=torch.bool, device=input_ids.device).tril()
    same = segment.unsqueeze(2) == segment.unsqueeze(1)
    eye = torch.eye(plan.width, dtype=torch.bool, device=input_ids.device)
    allowed = (((same & (segment.unsqueeze(2) >= 0)) | eye) & causal).unsqueeze(1)
    if mask == "additive":
        dtype = mask_dtype or torch.float32
        allowed = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)
    return {"input_ids": ids, "position_ids": positions, "attention_mask": allowed}


def unpack_completion(packed: torch.Tensor, plan: PackPlan, prompt_length: int, seq_len: int) -> torch.Tensor:
    """``packed`` ``[bins, width, ...]`` (the model's outputs, position by position) -> ``[B, T, ...]``
    with ``T = seq_len - prompt_length``: at ``t``, the output of the position that predicts token
    ``prompt_length + t`` of the padded row (its position ``prompt_length - 1 + t``). Positions past a
    row's last real token take its last real position's output."""
    t = torch.arange(seq_len - prompt_length, device=packed.device)
    source = (prompt_length - 1 + t).unsqueeze(0) - plan.start.unsqueeze(1)  # [B, T], within the segment
    source = torch.minimum(source, (plan.length - 1).unsqueeze(1)).clamp(min=0)
    return packed[plan.bin.unsqueeze(1), plan.offset.unsqueeze(1) + source]


def prefixed_packed_inputs(input_ids: torch.Tensor, plan: PackPlan, prefix_mask: torch.Tensor, *, pad_id: int = 0,
                           mask: str = "bool", mask_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """:func:`packed_inputs` for bins that continue a cached prefix (a shared prompt): ``prefix_mask``
    ``[bins, P]`` (1 on each bin's real prefix tokens, left-padded). Positions go on from each bin's
    prefix length, and every position also attends to its bin's real prefix tokens: the mask is
    ``[bins, 1, width, P + width]`` (prefix columns first, as the KV cache holds them)."""
    if mask not in ("bool", "additive"):
        raise ValueError(f"mask must be 'bool' or 'additive', got {mask!r}")
    inputs = packed_inputs(input_ids, plan, pad_id=pad_id, mask="bool")
    prefix = prefix_mask.bool()
    inputs["position_ids"] = inputs["position_ids"] + prefix.sum(dim=1, keepdim=True)
    block = inputs["attention_mask"]
    allowed = torch.cat([prefix[:, None, None, :].expand(-1, 1, plan.width, -1), block], dim=-1)
    if mask == "additive":
        dtype = mask_dtype or torch.float32
        allowed = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)
    inputs["attention_mask"] = allowed
    return inputs


def unpack_behind_prompt(prompt_last: torch.Tensor, packed: torch.Tensor, plan: PackPlan, inverse: torch.Tensor,
                         completion_length: int) -> torch.Tensor:
    """``[B, T, ...]`` outputs for completions packed behind their shared prompt: at ``t = 0`` the output
    of the prompt's last position (``prompt_last`` ``[D, ...]``, row ``inverse[b]``), at ``t >= 1`` that of
    completion token ``t - 1`` in its bin (the completion rows of ``plan`` start at their first token).
    Positions past a row's last real token take its last real position's output."""
    t = torch.arange(1, completion_length, device=packed.device)
    source = torch.minimum((t - 1).unsqueeze(0), (plan.length - 1).unsqueeze(1))
    rest = packed[plan.bin.unsqueeze(1), plan.offset.unsqueeze(1) + source]
    return torch.cat([prompt_last[inverse].unsqueeze(1), rest], dim=1)


def inline_prompt_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                         first: torch.Tensor, inverse: torch.Tensor, *, pad_id: int = 0, mask: str = "bool",
                         mask_dtype: torch.dtype | None = None) -> tuple[dict[str, torch.Tensor], PackPlan, torch.Tensor]:
    """One packed row per distinct prompt, for a single forward: the prompt's real tokens once, then each
    of its group's completions end to end (an empty completion keeps one slot, never read).

    ``input_ids`` / ``attention_mask`` ``[B, L]``, prompts left-padded to ``prompt_length``;
    ``first`` ``[D]`` / ``inverse`` ``[B]``: each distinct prompt's first row and each row's prompt.
    Positions: the prompt's ``0 .. p-1``, each completion's ``p .. p + len - 1``, as in its own padded row.
    The mask ``[D, 1, W, W]`` lets a prompt token see the prompt's earlier tokens, and a completion token
    the whole prompt and its own earlier tokens, never a sibling's; an unused tail position sees itself.
    So every completion token is the same function of its row as in the padded batch, and the prompt's
    activations, computed once, receive the gradient of all its completions.

    Returns the model's inputs, the completions' :class:`PackPlan` (``bin`` = the row's prompt, ``offset``
    past the prompt; for :func:`unpack_behind_prompt`) and each prompt's last position ``[D]``.
    """
    if mask not in ("bool", "additive"):
        raise ValueError(f"mask must be 'bool' or 'additive', got {mask!r}")
    dev, b = input_ids.device, input_ids.shape[0]
    prompt_len = attention_mask[first, :prompt_length].sum(dim=1)  # [D] real prompt tokens
    length = attention_mask[:, prompt_length:].sum(dim=1).clamp(min=1)  # [B]
    # Each completion's place behind its prompt: the lengths of the earlier rows of its group, summed.
    same = inverse.unsqueeze(0) == inverse.unsqueeze(1)  # [B, B]
    earlier = torch.ones(b, b, dtype=torch.bool, device=dev).tril(-1)
    offset = prompt_len[inverse] + ((same & earlier).long() * length.unsqueeze(0)).sum(dim=1)
    width = int((offset + length).max())
    d = first.numel()
    ids = torch.full((d, width), pad_id, dtype=input_ids.dtype, device=dev)
    positions = torch.zeros((d, width), dtype=torch.long, device=dev)
    segment = torch.full((d, width), -1, dtype=torch.long, device=dev)  # -2: prompt, b: row b's completion
    # The prompts: their real tokens are the last prompt_len of the prompt columns.
    p_rows = torch.repeat_interleave(torch.arange(d, device=dev), prompt_len)
    p_within = torch.arange(int(prompt_len.sum()), device=dev) - (torch.cumsum(prompt_len, 0) - prompt_len)[p_rows]
    ids[p_rows, p_within] = input_ids[first[p_rows], prompt_length - prompt_len[p_rows] + p_within]
    positions[p_rows, p_within] = p_within
    segment[p_rows, p_within] = -2
    # The completions, right-padded: their real tokens come first.
    c_rows = torch.repeat_interleave(torch.arange(b, device=dev), length)
    c_within = torch.arange(int(length.sum()), device=dev) - (torch.cumsum(length, 0) - length)[c_rows]
    ids[inverse[c_rows], offset[c_rows] + c_within] = input_ids[c_rows, prompt_length + c_within]
    positions[inverse[c_rows], offset[c_rows] + c_within] = prompt_len[inverse[c_rows]] + c_within
    segment[inverse[c_rows], offset[c_rows] + c_within] = c_rows
    q, k = segment.unsqueeze(2), segment.unsqueeze(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=dev).tril()
    eye = torch.eye(width, dtype=torch.bool, device=dev)
    allowed = ((((k == -2) | (q == k)) & (q != -1) & causal) | eye).unsqueeze(1)
    if mask == "additive":
        dtype = mask_dtype or torch.float32
        allowed = torch.zeros(allowed.shape, dtype=dtype, device=dev).masked_fill(~allowed, torch.finfo(dtype).min)
    plan = PackPlan(start=torch.full((b,), prompt_length, dtype=torch.long, device=dev), length=length,
                    bin=inverse, offset=offset, bins=d, width=width)
    return {"input_ids": ids, "position_ids": positions, "attention_mask": allowed}, plan, prompt_len - 1
