"""Log-probs and entropies straight from the last hidden states and the LM head (ALGORITHMS.md §1).

At a 150k-token vocabulary the ``[tokens, V]`` logits and their gradient are
most of a training pass's memory. Here the logits ``z = h W^T + b`` are built
one chunk of rows at a time, reduced to a log-prob and an entropy per row by
the kernel of ``chunked_softmax``, and dropped. The backward builds each
chunk's logits again, turns the upstream gradients into ``dL/dz`` for the chunk
(``chunked_softmax.rows_backward``) and folds it straight into

    dL/dh = dL/dz W,    dL/dW += dL/dz^T h,    dL/db += sum_rows dL/dz,

so no more than one chunk of logits (and its gradient) exists at a time. The
price is the LM-head matmul once more in the backward. EasyDeL's
``lmhead_chunksize``, Liger's fused linear losses and verl's fused kernels do
the same.

Under autocast the logits are recomputed in the backward under the same
autocast state as in the forward, so both passes see the same numbers. With ``fp32``
(``model.lm_head_fp32``, ``core/fp32_head.py``) the chunks of logits are built in float32 with
autocast off, in both passes, whatever the dtype of the hidden states and the weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from maxent_grpo.core.chunked_softmax import (
    DEFAULT_CHUNK_ROWS,
    check_chunk_rows,
    check_ids,
    check_temperature,
    rows_backward,
    rows_forward,
)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, autocast) -> torch.Tensor:
    """One chunk's logits; ``autocast`` is ``(enabled, dtype)`` or ``"fp32"`` (float32, autocast off)."""
    if autocast == "fp32":
        with torch.autocast(h.device.type, enabled=False):
            return F.linear(h.float(), weight.float(), None if bias is None else bias.float())
    with torch.autocast(h.device.type, dtype=autocast[1], enabled=autocast[0]):
        return F.linear(h, weight, bias)


class _FusedHeadLogps(torch.autograd.Function):
    """Log-probs (+ entropies) of ``targets [N]`` under ``softmax((h W^T + b) / T)`` for ``h [N, H]``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, with_entropy, chunk_rows, fp32):
        device = hidden.device.type
        autocast = "fp32" if fp32 else (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        n = hidden.shape[0]
        logps = torch.empty(n, dtype=torch.float64 if weight.dtype == torch.float64 else torch.float32,
                            device=hidden.device)
        lse = torch.empty_like(logps)
        ents = torch.empty_like(logps) if with_entropy else None
        for r0 in range(0, n, chunk_rows):
            sl = slice(r0, min(r0 + chunk_rows, n))
            z = _logits(hidden[sl], weight, bias, autocast)
            lp, ent, ls = rows_forward(z[None], targets[None, sl], temperature, with_entropy, chunk_rows)
            logps[sl], lse[sl] = lp[0], ls[0]
            if with_entropy:
                ents[sl] = ent[0]
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.chunk_rows, ctx.with_entropy, ctx.autocast = temperature, chunk_rows, with_entropy, autocast
        ctx.has_bias = bias is not None
        saved = [hidden, weight, targets, lse]
        if bias is not None:
            saved.append(bias)
        if ents is None:
            # autograd needs a tensor output; an empty one costs nothing
            ents = logps.new_empty(0)
            ctx.mark_non_differentiable(ents)
        else:
            saved.append(ents)
        ctx.save_for_backward(*saved)
        return logps, ents

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps, grad_ents):
        hidden, weight, targets, lse, *rest = ctx.saved_tensors
        bias = rest.pop(0) if ctx.has_bias else None
        ents = rest.pop(0) if ctx.with_entropy else None
        if not ctx.with_entropy:
            grad_ents = None
        if grad_logps is None and grad_ents is None:
            return None, None, None, None, None, None, None, None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        # Accumulated over chunks in float32 at least: a bf16 running sum would lose digits.
        acc = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b and bias is not None else None
        w_cast = None
        n, rows = hidden.shape[0], ctx.chunk_rows
        for r0 in range(0, n, rows):
            sl = slice(r0, min(r0 + rows, n))
            h = hidden[sl]
            z = _logits(h, weight, bias, ctx.autocast)
            dz = rows_backward(
                z[None], targets[None, sl], lse[None, sl], None if ents is None else ents[None, sl],
                None if grad_logps is None else grad_logps[None, sl],
                None if grad_ents is None else grad_ents[None, sl],
                ctx.temperature, rows,
            )[0]
            # The gradient matmuls run in the logits' dtype (bf16 under autocast), as
            # autograd through an autocast F.linear would.
            if w_cast is None:
                w_cast = weight.to(dz.dtype)
            if grad_h is not None:
                grad_h[sl] = dz @ w_cast
            if grad_w is not None:
                if dz.dtype == acc and h.dtype == acc:
                    grad_w.addmm_(dz.t(), h)
                else:
                    grad_w += dz.t() @ h.to(dz.dtype)
            if grad_b is not None:
                grad_b += dz.sum(0)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)
        grad_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None


def lm_head_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` under ``softmax((hidden @ weight.T + bias) / temperature)``
    and, if ``with_entropy``, the entropies of those distributions.

    ``hidden`` is ``[..., H]`` (the model's last hidden states, after its final
    norm), ``weight`` ``[V, H]`` and ``bias`` ``[V]`` or None (the LM head),
    ``targets`` ``[...]`` token ids. Returns float32 tensors (float64 for a
    float64 ``weight``) shaped like ``targets``; the entropy is None unless
    ``with_entropy``. Differentiable (once) w.r.t. ``hidden``, ``weight`` and
    ``bias``; a weight tied to the input embeddings gets this gradient added to
    its embedding gradient by autograd, as with an ordinary LM head. ``fp32``: the logits in
    float32 with autocast off (a :class:`~maxent_grpo.core.fp32_head.Float32Head`'s arithmetic).
    """
    temperature = check_temperature(temperature)
    chunk_rows = check_chunk_rows(chunk_rows)
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be [V, H] with H = {hidden.shape[-1]}, got {tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V] = [{weight.shape[0]}], got {tuple(bias.shape)}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden shape {tuple(hidden.shape)} must be targets shape {tuple(targets.shape)} plus H")
    check_ids(targets, weight.shape[0], "targets")
    logps, ents = _FusedHeadLogps.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1).long(),
        temperature, bool(with_entropy), chunk_rows, bool(fp32),
    )
    return logps.view(targets.shape), (ents.view(targets.shape) if with_entropy else None)
