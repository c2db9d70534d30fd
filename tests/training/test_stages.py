"""The batch's registered stages (``training/stages.py``): their order, the one place a skip is caught,
and dynamic sampling's rounds kept aligned (each kept completion with its own reward and column)."""

from __future__ import annotations

from maxent_grpo.training.pipeline import produce_rollouts
from maxent_grpo.training.setup import build_run
from maxent_grpo.training.stages import STAGES
from tiny_runs import compiled, tiny_overrides


def _run(tiny_model_dir, out, rewards, extra=()):
    args = tiny_overrides(tiny_model_dir, out, rewards=rewards, extra=list(extra))
    overrides = [args[i + 1] for i in range(len(args)) if args[i] == "--set"]
    return build_run(compiled(None, [*overrides, f"logging.output_dir={out}"]))


def test_the_stages_run_in_their_parts_order():
    parts = [s.part for s in STAGES]
    assert parts == sorted(parts, key=["sampling", "rewarding", "scoring"].index)
    assert [s.name for s in STAGES] == [
        "generation", "reward", "dynamic_sampling", "pack", "verifier", "reward_scaling", "reward_stats",
        "policy_entropy_bonus", "reference", "teacher", "weighting"]


def test_dynamic_sampling_keeps_each_completion_with_its_own_reward_and_column(tiny_model_dir, tmp_path):
    # Round 1 rewards every completion 0 (no group varies); round 2 rewards parity: the kept groups come
    # from round 2 on, and each must carry its own reward and log_extra value, not another round's.
    run = _run(tiny_model_dir, tmp_path / "run", "[{name: 'learnable_rewards:parity_every_other_call', kwargs: {flat_first: true}}]",
               ["loss.dynamic_sampling=true", "loss.max_gen_batches=4"])
    try:
        record = produce_rollouts(run.ctx, run.sampler.next_batch(), run.sampler.next_batch, step=0, version=0)
    finally:
        run.finish()
    assert record.failure is None
    rollout, g = record.rollout, record.rollout.num_generations
    ids = rollout.completion_ids
    assert 1 <= len(record.rows) <= run.plan.batch.prompts_per_step == rollout.num_prompts
    rewards = record.rewards[:, 0].tolist()
    assert rewards == [float(sum(c) % 2 == 0) for c in ids]
    assert record.extra_columns["token_sum"] == [sum(c) for c in ids]
    for p in range(len(record.rows)):  # only groups whose rewards vary are kept
        assert len(set(rewards[p * g:(p + 1) * g])) == 2
    seen = record.stats["dynamic_sampling/groups_seen"]
    assert seen >= 2 * run.plan.batch.prompts_per_step and seen == int(seen)
