"""Log-probs and entropies of rows of logits, chunked forward and backward (ALGORITHMS.md §1).

The full ``[B, T, V]`` log-softmax is never held: rows are processed in chunks
into two reusable buffers. With ``u = z - max(z)`` and ``s = sum exp(u)``:

    logp(y) = u_y - log s
    H       = log s - sum exp(u) * u / s        (= logsumexp(z) - sum softmax(z) z)

Working on ``u`` instead of ``z`` avoids the cancellation between two large
numbers (``logsumexp(z)`` and ``sum p z``) that costs float32 entropies digits
when logits are large. The backward is chunked the same way and writes straight
into the gradient, using the saved ``lse`` and ``H``:

    d logp(y)/dz = onehot(y) - p,    dH/dz = -p * (log p + H).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

# Rows of [*, V] logits handled at once (tuned with benchmarks/logprobs_bench.py).
# At V = 49152 the float32 work buffers are 48 MiB each, ~3% of the logits of
# a 32 x 256 batch. Smaller chunks save little more memory but multiply the
# number of thread-synchronised ops: on a busy 2-core machine 32-row chunks
# were 10x slower, while 128..1024 rows all ran at the same speed.
DEFAULT_CHUNK_ROWS = 256


def check_ids(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.numel() == 0:
        return
    lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one device sync, not two
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise ValueError(f"{name}: token id {bad} is outside the model vocabulary [0, {vocab_size})")


def check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return t


def check_chunk_rows(chunk_rows: int) -> int:
    rows = operator.index(chunk_rows)
    if rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    return rows


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Upcast half precision per chunk: a bf16 logsumexp over 49k entries loses ~2 digits.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(a: int, t: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """(batch slice, time slice) pairs of at most ``rows`` rows, never merging
    non-adjacent memory, so a strided ``[A, T, V]`` view is never copied whole."""
    if a == 0 or t == 0:
        return
    if t <= rows:
        step = rows // t
        for a0 in range(0, a, step):
            yield slice(a0, min(a0 + step, a)), slice(0, t)
    else:
        for a0 in range(a):
            for t0 in range(0, t, rows):
                yield slice(a0, a0 + 1), slice(t0, min(t0 + rows, t))


def _buffer(n_rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(n_rows * vocab, dtype=dtype, device=device)


def _view(buf: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return buf[: math.prod(shape)].view(shape)


def _max_chunk_rows(a: int, t: int, rows: int) -> int:
    if a == 0 or t == 0:
        return 0
    return min(rows // t, a) * t if t <= rows else rows


def _scaled_shifted(out: torch.Tensor, x: torch.Tensor, temperature: float, offset: torch.Tensor) -> torch.Tensor:
    """``out = x / temperature + offset`` in ``out``'s dtype."""
    if x.dtype != out.dtype:
        # upcast into out first: a mixed-dtype add would allocate a hidden
        # chunk-sized float32 copy of x (page faults on every chunk)
        x = out.copy_(x)
    return torch.add(offset, x, alpha=1.0 / temperature, out=out)


def rows_forward(logits, targets, temperature, with_entropy, rows):
    """Log-probs, entropies (or None) and ``logsumexp(logits / T)``, each ``[A, T]``, of ``[A, T, V]`` logits."""
    a, t, vocab = logits.shape
    cdtype = _compute_dtype(logits.dtype)
    logps = torch.empty((a, t), dtype=cdtype, device=logits.device)
    lse = torch.empty_like(logps)
    ents = torch.empty_like(logps) if with_entropy else None
    n_max = _max_chunk_rows(a, t, rows)
    u_buf = _buffer(n_max, vocab, cdtype, logits.device)
    p_buf = _buffer(n_max, vocab, cdtype, logits.device) if with_entropy else None
    for bs, ts in _chunks(a, t, rows):
        x = logits[bs, ts]
        m = x.amax(-1, keepdim=True).to(cdtype).div_(temperature)
        u = _scaled_shifted(_view(u_buf, x.shape), x, temperature, -m)
        u_y = u.gather(-1, targets[bs, ts, None]).squeeze(-1)
        if p_buf is None:
            log_s = u.exp_().sum(-1).log_()
        else:
            p = torch.exp(u, out=_view(p_buf, x.shape))
            s = p.sum(-1)
            log_s = s.log()
            # sum p u <= 0 termwise: no cancellation, unlike lse - sum p z
            ents[bs, ts] = log_s - p.mul_(u).sum(-1).div_(s)
        logps[bs, ts] = u_y - log_s
        lse[bs, ts] = m.squeeze(-1) + log_s
    return logps, ents, lse


def rows_backward(logits, targets, lse, ents, grad_logps, grad_ents, temperature, rows):
    """Gradient ``[A, T, V]`` (in the logits' dtype) of ``sum(grad_logps * logps + grad_ents * H)``;
    either upstream gradient may be None. ``lse`` and ``ents`` come from :func:`rows_forward`."""
    a, t, vocab = logits.shape
    cdtype = lse.dtype
    grad = torch.empty((a, t, vocab), dtype=logits.dtype, device=logits.device)
    # float32/float64 logits: the gradient slice itself is the work buffer.
    n_max = _max_chunk_rows(a, t, rows)
    g_buf = None if logits.dtype == cdtype else _buffer(n_max, vocab, cdtype, logits.device)
    p_buf = _buffer(n_max, vocab, cdtype, logits.device) if grad_ents is not None else None
    # Row factors with the chain-rule 1/T folded in, so each chunk costs few passes.
    g_lp = None if grad_logps is None else grad_logps.to(cdtype) / temperature
    if grad_ents is not None:
        g_h = grad_ents.to(cdtype).div(-temperature)
        offset = g_h * ents if g_lp is None else torch.sub(g_h * ents, g_lp)
    for bs, ts in _chunks(a, t, rows):
        x = logits[bs, ts]
        g = grad[bs, ts] if g_buf is None else _view(g_buf, x.shape)
        lp = _scaled_shifted(g, x, temperature, -lse[bs, ts, None])  # log softmax
        if grad_ents is None:
            g = lp.exp_().mul_(-g_lp[bs, ts, None])
        else:
            p = torch.exp(lp, out=_view(p_buf, x.shape))
            # d/dz [g_lp logp_y + g_H H] = onehot g_lp - p (g_lp + g_H (log p + H)); times 1/T
            g = torch.addcmul(offset[bs, ts, None], lp, g_h[bs, ts, None], out=lp).mul_(p)
        if g_lp is not None:
            g.scatter_add_(-1, targets[bs, ts, None], g_lp[bs, ts, None])
        if g_buf is not None:
            grad[bs, ts] = g
    return grad


class _ChunkedLogps(torch.autograd.Function):
    """Chunked log-prob (+ entropy) of ``[A, T, V]`` logits with a chunked backward."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk_rows):
        logps, ents, lse = rows_forward(logits, targets, temperature, with_entropy, chunk_rows)
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.chunk_rows, ctx.with_entropy = temperature, chunk_rows, with_entropy
        if ents is None:
            # autograd needs a tensor output; an empty one costs nothing
            ents = logps.new_empty(0)
            ctx.mark_non_differentiable(ents)
            ctx.save_for_backward(logits, targets, lse)
        else:
            ctx.save_for_backward(logits, targets, lse, ents)
        return logps, ents

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logps, grad_ents):
        if ctx.with_entropy:
            logits, targets, lse, ents = ctx.saved_tensors
        else:
            logits, targets, lse = ctx.saved_tensors
            ents, grad_ents = None, None
        if grad_logps is None and grad_ents is None:
            return None, None, None, None, None
        grad = rows_backward(logits, targets, lse, ents, grad_logps, grad_ents, ctx.temperature, ctx.chunk_rows)
        return grad, None, None, None, None


def _as_3d(x: torch.Tensor, last: int) -> torch.Tensor:
    """View ``[..., T, *tail]`` as ``[A, T, *tail]`` (``tail`` has ``last`` dims), copying only if it must."""
    lead = x.shape[: x.dim() - last]
    tail = x.shape[x.dim() - last :]
    if len(lead) == 0:
        return x.reshape(1, 1, *tail)
    if len(lead) == 1:
        return x.unsqueeze(0)
    if len(lead) == 2:
        return x
    return x.reshape(-1, lead[-1], *tail)


def selective_logps(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` under ``softmax(logits / temperature)`` and, if
    ``with_entropy``, the entropies of those distributions, for logits ``[..., V]``.

    Returns float32 tensors (float64 for float64 logits) shaped like ``targets``;
    the entropy is ``None`` when ``with_entropy`` is false. Differentiable w.r.t.
    ``logits`` (once) through a chunked backward.
    """
    temperature = check_temperature(temperature)
    chunk_rows = check_chunk_rows(chunk_rows)
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    if logits.dim() < 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} must be targets shape {tuple(targets.shape)} plus a vocab dim"
        )
    check_ids(targets, logits.shape[-1], "targets")
    logps, ents = _ChunkedLogps.apply(
        _as_3d(logits, 1), _as_3d(targets.long(), 0), temperature, bool(with_entropy), chunk_rows
    )
    return logps.view(targets.shape), (ents.view(targets.shape) if with_entropy else None)


