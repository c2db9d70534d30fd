"""The sleep / wake sequence of a colocated vLLM engine (``rollout/vllm_sleep.py``), on CPU.

vLLM's sleep mode does not run on its CPU build ("Sleep mode is not supported on
current platform", checked in tests/rollout/test_vllm.py), so these tests drive
``EngineSleep`` against ``SleepModelLLM``, a stand-in for ``vllm.LLM`` that keeps
what a real engine with sleep mode would hold: which memory is resident, and
whether the weights are valid (level 2 discards them; waking them gives back
memory, not values). It refuses what a real engine would do wrong: generating
without its KV cache or from discarded weights, loading into unallocated
weights. The real engine runs the same sequence in tests/gpu/test_vllm_cuda.py.
"""

from __future__ import annotations

import pytest

from maxent_grpo.rollout.vllm_sleep import EngineSleep


class SleepModelLLM:
    def __init__(self):
        self.log: list[str] = []
        self.weights_resident = self.kv_resident = self.weights_valid = True
        self.version = 0  # the policy version the weights hold

    def sleep(self, level: int) -> None:
        self.log.append(f"sleep({level})")
        assert level in (1, 2)
        self.kv_resident = False
        self.weights_resident = False
        if level == 2:
            self.weights_valid = False

    def wake_up(self, tags=None) -> None:
        self.log.append(f"wake_up({','.join(tags)})")
        if "weights" in tags:
            assert not self.weights_resident, "weights woken twice"
            self.weights_resident = True
        if "kv_cache" in tags:
            assert not self.kv_resident, "KV cache woken twice"
            self.kv_resident = True

    def reset_prefix_cache(self) -> None:
        self.log.append("reset_prefix_cache")

    def load(self, version: int) -> None:
        assert self.weights_resident, "weights loaded into freed memory"
        self.log.append(f"load({version})")
        self.version, self.weights_valid = version, True

    def generate(self) -> int:
        assert self.kv_resident and self.weights_resident and self.weights_valid
        self.log.append("generate")
        return self.version


class Trainer:
    """What the loop does around the engine: a step = rollout phase (n generate calls), optimizer step, push."""

    def __init__(self, sleep: EngineSleep, llm: SleepModelLLM):
        self.sleep, self.llm, self.version = sleep, llm, 0
        self.frees = 0
        sleep.free_memory = self._free

    def _free(self) -> None:
        self.frees += 1
        self.llm.log.append("free")

    def rollout(self, calls: int) -> list[int]:
        with self.sleep.rollout_phase(lambda: self.llm.load(self.version)):
            out = []
            for _ in range(calls):
                self.sleep.check_can_generate()
                out.append(self.llm.generate())
            return out

    def step(self, calls: int = 1, *, skipped: bool = False) -> list[int]:
        sampled = self.rollout(calls)
        if not skipped:
            self.version += 1
            self.sleep.push(lambda: self.llm.load(self.version))
        return sampled


def _engine(enabled=True):
    llm = SleepModelLLM()
    return Trainer(EngineSleep(llm, enabled=enabled), llm), llm


def test_a_step_wakes_weights_for_the_push_and_the_kv_cache_once_for_all_its_generate_calls():
    trainer, llm = _engine()
    assert trainer.step(calls=1) == [0]  # the first rollout: the engine's own, freshly loaded weights
    llm.log.clear()
    # A step with retries and dynamic-sampling rounds: three generate calls, one wake, one sleep.
    assert trainer.step(calls=3) == [1, 1, 1]
    assert llm.log == ["free", "wake_up(kv_cache)", "generate", "generate", "generate", "sleep(2)",
                       "free", "wake_up(weights)", "load(2)", "reset_prefix_cache"]


def test_the_first_rollout_samples_the_start_weights_and_sleeps_at_level_2():
    trainer, llm = _engine()
    trainer.step()
    assert llm.log == ["generate", "sleep(2)", "free", "wake_up(weights)", "load(1)", "reset_prefix_cache"]


def test_a_skipped_step_leaves_discarded_weights_and_the_next_phase_pushes_first():
    trainer, llm = _engine()
    trainer.step()
    trainer.step(skipped=True)  # sampled, then no optimizer step and no push
    llm.log.clear()
    assert trainer.step() == [1]  # the policy's weights, not the discarded ones
    assert llm.log[:5] == ["free", "wake_up(weights)", "load(1)", "reset_prefix_cache", "free"]
    assert llm.log[5:7] == ["wake_up(kv_cache)", "generate"]


def test_evaluation_after_the_push_is_its_own_phase():
    trainer, llm = _engine()
    trainer.step()
    assert trainer.rollout(calls=2) == [1, 1]  # in-loop validation after the step's push
    assert trainer.step() == [1]  # the evaluation's level-2 sleep discarded the push: pushed again
    assert llm.log.count("load(1)") == 2


def test_a_phase_that_raises_still_sleeps():
    trainer, llm = _engine()
    with pytest.raises(KeyError):
        with trainer.sleep.rollout_phase(lambda: llm.load(0)):
            raise KeyError("a reward function failed")
    assert llm.log[-1] == "sleep(2)" and not trainer.sleep.in_phase


def test_generate_outside_a_phase_and_nested_phases_are_refused():
    trainer, _ = _engine()
    with pytest.raises(RuntimeError, match="outside a rollout phase"):
        trainer.sleep.check_can_generate()
    with trainer.sleep.rollout_phase(lambda: None):
        with pytest.raises(RuntimeError, match="do not nest"):
            with trainer.sleep.rollout_phase(lambda: None):
                pass


def test_without_sleep_mode_only_the_push_touches_the_engine():
    trainer, llm = _engine(enabled=False)
    for _ in range(3):
        trainer.step(calls=2)
    trainer.sleep.check_can_generate()  # generate outside a phase is fine: the engine is always awake
    assert [e for e in llm.log if e != "generate"] == ["load(1)", "reset_prefix_cache", "load(2)",
                                                         "reset_prefix_cache", "load(3)", "reset_prefix_cache"]
    assert trainer.frees == 0
