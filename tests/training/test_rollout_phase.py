"""Where the loop opens a backend's rollout phase (``GenerationBackend.rollout_phase``): one phase per step
around all its generate calls (dynamic-sampling rounds, retries), one per in-loop evaluation, and no
generate call outside one. A sleeping vLLM engine relies on it (docs/VLLM.md, "Sleep mode")."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

from maxent_grpo.rewards.maxent import weighting_at
from maxent_grpo.training.pipeline import prepare_training_batch
from maxent_grpo.training.skip_counts import SkipCounts
from maxent_grpo.training.setup import build_run
from maxent_grpo.training.validation import validate
from tiny_runs import compiled, tiny_overrides


class PhaseRecorder:
    """The run's real HF backend, recording which generate calls (their prompt counts) ran in which phase."""

    def __init__(self, inner):
        self.inner = inner
        self.phases: list[list[int]] = []
        self.outside = 0
        self._current: list[int] | None = None

    @contextmanager
    def rollout_phase(self, policy):
        assert self._current is None, "rollout phases nested"
        with self.inner.rollout_phase(policy):
            self._current = []
            try:
                yield
            finally:
                self.phases.append(self._current)
                self._current = None

    def generate(self, prompts, num_generations, params):
        if self._current is None:
            self.outside += 1
        else:
            self._current.append(len(prompts))
        return self.inner.generate(prompts, num_generations, params)

    def sync_weights(self, policy):
        self.inner.sync_weights(policy)


def test_a_step_is_one_phase_around_every_round_and_an_evaluation_is_another(tiny_model_dir, tmp_path):
    # boxed_accuracy is 0 for every completion of the untrained tiny model: no group varies, so dynamic
    # sampling draws all of its max_gen_batches rounds, then skips the batch.
    args = tiny_overrides(tiny_model_dir, tmp_path / "run", rewards="[{name: boxed_accuracy}]", extra=[
        "loss.dynamic_sampling=true", "loss.max_gen_batches=3", "data.eval_size=3", "eval.k=2",
        "eval.num_prompts=3",
    ])
    overrides = [args[i + 1] for i in range(len(args)) if args[i] == "--set"]
    run = build_run(compiled(None, [*overrides, f"logging.output_dir={tmp_path / 'run'}"]))
    try:
        recorder = PhaseRecorder(run.ctx.backend)
        run.ctx = dataclasses.replace(run.ctx, backend=recorder)
        skips = SkipCounts()
        prepared = prepare_training_batch(run.ctx, recorder, run.sampler.next_batch(), weighting=weighting_at(run.plan.weighting, run.state.controllers),
                                          skips=skips, more_rows=run.sampler.next_batch)
        assert prepared is None and skips.last.stage == "dynamic_sampling" and dict(skips.by_stage) == {
            "dynamic_sampling": 1}
        assert recorder.phases == [[2, 2, 2]]  # three rounds of the step's 2 prompts, one phase
        validate(run, 1)
        assert len(recorder.phases) == 2 and len(recorder.phases[1]) >= 2  # sampled and greedy: one phase
        assert recorder.outside == 0
    finally:
        run.finish()
