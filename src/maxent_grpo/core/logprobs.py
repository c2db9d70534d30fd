"""Per-token log-probs and entropies of completion tokens (ALGORITHMS.md §1).

The full ``[B, T, V]`` log-softmax is never held: rows are processed in chunks,
the chosen logit is gathered and ``logsumexp`` subtracted; the entropy
``H = logsumexp(z) - sum softmax(z) * z`` comes from the same chunk.
"""

from __future__ import annotations

import torch

# Rows of [*, V] logits handled at once. 1024 rows x 49152 vocab x fp32 is
# ~200 MB of temporaries per chunk, small next to the model's own logits.
DEFAULT_CHUNK_ROWS = 1024


def _check_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    if input_ids.numel() == 0:
        return
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"input_ids: token id {hi if hi >= vocab_size else lo} is outside the "
            f"model vocabulary [0, {vocab_size})"
        )


def _rowwise_logps(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``targets`` under ``softmax(logits / temperature)`` for 2-D ``[N, V]`` logits."""
    n = logits.shape[0]
    logps = torch.empty(n, dtype=torch.float32 if logits.dtype != torch.float64 else torch.float64, device=logits.device)
    ents = torch.empty_like(logps) if with_entropy else None
    for start in range(0, n, chunk_rows):
        stop = min(start + chunk_rows, n)
        # Upcast per chunk: bf16 logsumexp over 49k entries loses ~2 digits.
        z = logits[start:stop].to(logps.dtype)
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        logps[start:stop] = z.gather(-1, targets[start:stop, None]).squeeze(-1) - lse
        if ents is not None:
            p = torch.softmax(z, dim=-1)
            ents[start:stop] = lse - (p * z).sum(-1)
    return logps, ents


class _ChunkedLogps(torch.autograd.Function):
    """Chunked log-prob (+ entropy) with a chunked backward, so neither pass holds [N, V] softmax."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, with_entropy, chunk_rows):
        logps, ents = _rowwise_logps(logits, targets, temperature, with_entropy, chunk_rows)
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.chunk_rows, ctx.with_entropy = temperature, chunk_rows, with_entropy
        if ents is None:
            ents = torch.zeros_like(logps)
        return logps, ents

    @staticmethod
    def backward(ctx, grad_logps, grad_ents):
        logits, targets = ctx.saved_tensors
        tau, rows = ctx.temperature, ctx.chunk_rows
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], rows):
            stop = min(start + rows, logits.shape[0])
            z = logits[start:stop].to(grad_logps.dtype) / tau
            lse = torch.logsumexp(z, dim=-1, keepdim=True)
            p = torch.exp(z - lse)
            g_lp = grad_logps[start:stop, None]
            # d logp_y / dz = onehot(y) - p
            g = -p * g_lp
            g.scatter_add_(-1, targets[start:stop, None], g_lp)
            if ctx.with_entropy and grad_ents is not None:
                # H = lse - sum p z ;  dH/dz = -p * (z - sum p z)
                ez = (p * z).sum(-1, keepdim=True)
                g = g - p * (z - ez) * grad_ents[start:stop, None]
            grad[start:stop] = (g / tau).to(logits.dtype)
        return grad, None, None, None, None


def selective_logps(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` and (optionally) entropies for logits of shape ``[..., V]``.

    Returns float32 tensors (float64 for float64 logits) shaped like ``targets``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets shape {tuple(targets.shape)} does not match logits {tuple(logits.shape)}")
    _check_ids(targets, logits.shape[-1])
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_targets = targets.reshape(-1)
    logps, ents = _ChunkedLogps.apply(flat_logits, flat_targets, float(temperature), with_entropy, int(chunk_rows))
    logps = logps.view(targets.shape)
    return logps, (ents.view(targets.shape) if with_entropy else None)


def compute_per_token_logps(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    prompt_length: int,
    *,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """Log-probs of the completion tokens ``input_ids[:, prompt_length:]``.

    ``logits`` are the model's outputs for the whole ``input_ids`` ``[B, L, V]``;
    position ``t`` predicts token ``t+1``. Returns ``[B, L - prompt_length]``.
    """
    logps, _ = _completion_logps(logits, input_ids, prompt_length, temperature, False, chunk_rows)
    return logps


def _completion_logps(logits, input_ids, prompt_length, temperature, with_entropy, chunk_rows):
    if not 0 < prompt_length < input_ids.shape[1] + 1:
        raise ValueError(f"prompt_length must be in [1, {input_ids.shape[1]}], got {prompt_length}")
    # logits for positions prompt_length-1 .. L-2 predict tokens prompt_length .. L-1
    if logits.shape[1] == input_ids.shape[1]:
        logits = logits[:, prompt_length - 1 : -1]
    targets = input_ids[:, prompt_length:]
    return selective_logps(logits, targets, temperature=temperature, with_entropy=with_entropy, chunk_rows=chunk_rows)


def _forward_completion_logits(model, input_ids, attention_mask, prompt_length):
    # logits_to_keep avoids the LM head over prompt positions (T+1 keeps the one
    # that predicts the first completion token).
    keep = input_ids.shape[1] - prompt_length + 1
    out = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep, use_cache=False)
    return out.logits[:, :-1]


def get_per_token_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_length: int,
    *,
    temperature: float = 1.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """Forward ``model`` once and return completion-token log-probs ``[B, L - prompt_length]``."""
    logps, _ = get_per_token_logps_and_entropies(
        model, input_ids, attention_mask, prompt_length,
        temperature=temperature, chunk_rows=chunk_rows, with_entropy=False,
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward ``model`` once; return completion log-probs and token entropies, both ``[B, T]``."""
    _check_ids(input_ids, model.config.get_text_config().vocab_size)
    logits = _forward_completion_logits(model, input_ids, attention_mask, prompt_length)
    return selective_logps(
        logits, input_ids[:, prompt_length:],
        temperature=temperature, with_entropy=with_entropy, chunk_rows=chunk_rows,
    )
