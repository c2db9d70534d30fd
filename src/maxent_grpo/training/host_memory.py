"""Freed host memory handed back to the operating system between the policy's passes.

A CPU step allocates and frees many tensors of many sizes (a micro-batch's activations, its
gradients, the generation's KV cache). glibc's ``malloc`` keeps freed heap chunks resident
for reuse, so the process's resident set grows past what is live: with SmolLM2-135M
(BENCHMARKS.md §4b) the peak was 0.2-0.45 GiB above the live tensors. ``malloc_trim(0)``
returns every free page of the heap to the OS; calling it before each micro-batch's forward
and backward (``grpo_step``'s ``StepHooks.release``, when ``training.release_host_memory`` is on)
keeps the peak near the live memory, for 3-5% of the step: the pages are faulted in again by
the next micro-batch (BENCHMARKS.md §2, on our own decoding loop and packing). Where the C library has no ``malloc_trim`` (musl, macOS) and on
a GPU (whose tensors are not on this heap) nothing is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable


def host_memory_release(device_type: str) -> Callable[[], None] | None:
    """A call that hands freed heap memory back to the OS, or None where there is none to make
    (a CUDA device, or a C library without ``malloc_trim``)."""
    if device_type != "cpu":
        return None
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        return None
    trim = libc.malloc_trim
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def release() -> None:
        trim(0)

    return release
