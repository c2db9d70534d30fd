"""When a colocated vLLM engine with sleep mode wakes and sleeps: one object that owns the sequence.

The engine (``vllm.LLM`` with ``enable_sleep_mode=True``, CUDA only) holds two
kinds of GPU memory: its weights and its KV cache. A training step uses them so
(TRL and verl do the same):

* **push** (after the optimizer step): wake the *weights* only
  (``wake_up(tags=["weights"])``), load the new weights, reset the prefix
  cache. The weights then stay resident: the next thing the engine does is the
  step's rollout, which needs them, and sleeping in between could only be level
  1 (level 2 would discard the push), a GPU->CPU->GPU round trip of the weights.
* **rollout phase** (every generate call of a step: retries, dynamic-sampling
  rounds; or of an evaluation): wake the *KV cache* once at its start, and at
  its end sleep at level 2, which frees both weights and KV cache without
  copying either to the host.
* Level 2 discards the weights, so the engine's weights are stale after a
  phase. A phase that starts on stale weights (a skipped step had no optimizer
  step and no push; a resume) pushes the policy first.
* Before any wake, ``gc.collect()`` and ``torch.cuda.empty_cache()``: tensors
  the trainer has dropped but the caching allocator still holds would otherwise
  keep the engine's wake from getting its memory (verl #575).

Without sleep mode all of this is a no-op apart from the push itself.
``EngineSleep`` only calls ``sleep``, ``wake_up`` and ``reset_prefix_cache`` on
the engine it is given, so its sequencing is tested on CPU against a recorder
(vLLM's sleep mode does not run on its CPU build), and on a GPU against vLLM.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def free_cached_memory() -> None:
    """Return what the trainer no longer uses to the driver, so the engine's wake can take it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class EngineSleep:
    """The sleep / wake sequence of one engine; ``enabled=False`` (no sleep mode) leaves it always awake."""

    def __init__(self, llm, *, enabled: bool, free_memory: Callable[[], None] = free_cached_memory):
        self.llm = llm
        self.enabled = enabled
        self.free_memory = free_memory
        # A new engine is awake, with the weights it loaded from the model path: the policy's at start.
        self.weights_resident = True
        self.kv_cache_resident = True
        self.weights_current = True
        self.in_phase = False

    def push(self, load: Callable[[], None]) -> None:
        """Load new weights through ``load()`` (the engine's ``reload_weights``), waking only the weights."""
        if self.enabled and not self.weights_resident:
            self.free_memory()
            self.llm.wake_up(tags=["weights"])
            self.weights_resident = True
        load()
        # Prompts whose KV blocks were cached under the old weights would keep them.
        self.llm.reset_prefix_cache()
        self.weights_current = True

    @contextmanager
    def rollout_phase(self, push_policy: Callable[[], None]) -> Iterator[None]:
        """Bracket every generate call of one step (or one evaluation): the KV cache wakes once, level 2 after.

        ``push_policy`` pushes the policy's weights; it is called only when the engine's are stale.
        """
        if self.in_phase:
            raise RuntimeError("rollout phases do not nest: the engine is already in one")
        if self.enabled:
            if not self.weights_current:
                self.push(push_policy)
            if not self.kv_cache_resident:
                self.free_memory()
                self.llm.wake_up(tags=["kv_cache"])
                self.kv_cache_resident = True
        self.in_phase = True
        try:
            yield
        finally:
            self.in_phase = False
            if self.enabled:
                self.llm.sleep(level=2)
                self.weights_resident = self.kv_cache_resident = self.weights_current = False

    def check_can_generate(self) -> None:
        """With sleep mode a generate call must run inside a rollout phase (the KV cache is asleep outside)."""
        if self.enabled and not self.in_phase:
            raise RuntimeError("generate outside a rollout phase with sleep mode on: wrap the step's generation "
                               "in backend.rollout_phase(policy)")
