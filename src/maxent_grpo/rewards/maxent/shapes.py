"""Shape checks for the batch layout shared by reward and weight statistics.

Tensors are flat ``[N]`` (prompt-major, ``N = P * G``) or grouped ``[P, G]``;
these helpers turn the first into the second and name the argument when the
shape is wrong.
"""

from __future__ import annotations

import torch


def grouped(name: str, flat: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``flat[N]`` viewed as ``[P, num_generations]``; ``ValueError`` naming ``name`` otherwise."""
    if flat.dim() != 1 or flat.shape[0] % num_generations != 0:
        raise ValueError(
            f"{name} must be [N] with N a multiple of num_generations={num_generations}, got shape {tuple(flat.shape)}"
        )
    return flat.view(-1, num_generations)


def check_num_generations(num_generations: int) -> None:
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
        raise ValueError(f"num_generations must be an int >= 2 (a group is needed), got {num_generations!r}")
