"""Reward functions for the training tests, written in TRL's GRPOTrainer style.

Imported by name (``learnable_rewards:shortness``) the way a user's own module
would be: pytest puts this folder on sys.path.
"""


def shortness(prompts, completions, completion_ids, **kwargs):
    """1 for an immediate end of sequence, falling linearly to 0 at 16 tokens: learnable by a random tiny model."""
    return [max(0.0, 1.0 - len(ids) / 16.0) for ids in completion_ids]


def conversational_length(completions, **kwargs):
    """A TRL-style function for conversational data: reads completion[0]["content"]."""
    return [float(len(c[0]["content"])) / 100.0 for c in completions]


def wrong_count(prompts, completions, **kwargs):
    return [0.0] * (len(completions) + 1)


def returns_nan(prompts, completions, **kwargs):
    return [float("nan")] * len(completions)


def raises(prompts, completions, **kwargs):
    raise RuntimeError("scorer crashed")


def shortness_then_flat(calls: int):
    """A factory: ``shortness`` for ``calls`` calls (batches), then 0 for every completion, so that every
    later batch has zero advantages (nothing to learn; only the KL term and AdamW's moments move the policy)."""
    seen = [0]

    def reward(prompts, completions, completion_ids, **kwargs):
        seen[0] += 1
        if seen[0] > calls:
            return [0.0] * len(completion_ids)
        return shortness(prompts, completions, completion_ids)

    return reward


def fails_after(calls: int):
    """A factory: the reward works for ``calls`` calls (steps), then raises every time."""
    seen = [0]

    def reward(prompts, completions, completion_ids, **kwargs):
        seen[0] += 1
        if seen[0] > calls:
            raise RuntimeError(f"judge unreachable (call {seen[0]})")
        return [len(c) / 100.0 for c in completions]

    return reward


def always_one(prompts, completions, **kwargs):
    return [1.0] * len(completions)


def always_none(prompts, completions, **kwargs):
    return [None] * len(completions)


def hangs(prompts, completions, **kwargs):
    import threading

    threading.Event().wait()  # never returns


def kills_process_at(pid: int, call: int):
    """A factory: ``shortness``, and at its ``call``-th call (one per batch) SIGKILL process ``pid``
    (a generation server dying mid-run)."""
    import os
    import signal

    seen = [0]

    def reward(prompts, completions, completion_ids, **kwargs):
        seen[0] += 1
        if seen[0] == call:
            os.kill(pid, signal.SIGKILL)
        return shortness(prompts, completions, completion_ids)

    return reward


def parity(prompts, completions, completion_ids, **kwargs):
    """1.0 when the completion's token ids sum to an even number, else 0.0: a binary reward that
    varies on random text (MaxRL needs 0/1 rewards)."""
    return [float(sum(ids) % 2 == 0) for ids in completion_ids]


def even_first_token(prompts, completions, completion_ids, **kwargs):
    """1 when the completion's first token id is even, else 0: about half of a random tiny model's
    completions, so most groups hold both rewarded and unrewarded completions."""
    return [float(bool(ids) and ids[0] % 2 == 0) for ids in completion_ids]


def parity_every_other_call(flat_first: bool):
    """A factory: alternately 0 for every completion (a round with no varied group) and ``parity``,
    starting flat when ``flat_first``; each completion's token-id sum is logged as the ``token_sum``
    column. Dynamic sampling must draw a second round and keep its groups with their own rewards and columns."""
    seen = [0 if flat_first else 1]

    def reward(prompts, completions, completion_ids, log_extra, **kwargs):
        seen[0] += 1
        log_extra("token_sum", [sum(ids) for ids in completion_ids])
        if seen[0] % 2 == 1:
            return [0.0] * len(completion_ids)
        return parity(prompts, completions, completion_ids)

    return reward


def fails_at(step: int, times: int, tally: str):
    """A factory: ``parity``, except that the first ``times`` batches drawn for optimizer step
    ``step`` (TRL's ``trainer_state.global_step``) raise: each is skipped, and the next one drawn for the
    same step. The failures are counted in the file ``tally``, as an outside judge's outage would be: a
    run resumed from a checkpoint written after a failure does not fail again where it did."""
    from pathlib import Path

    count = Path(tally)

    def reward(prompts, completions, completion_ids, trainer_state, **kwargs):
        failed = int(count.read_text()) if count.is_file() else 0
        if trainer_state.global_step == step and failed < times:
            count.write_text(str(failed + 1))
            raise RuntimeError(f"judge unreachable at step {step} (failure {failed + 1})")
        return parity(prompts, completions, completion_ids)

    return reward


def flat_from(step: int):
    """A factory: ``parity`` for the batches of the steps before ``step``, then 0 for every completion
    (a reward the model no longer earns)."""

    def reward(prompts, completions, completion_ids, trainer_state, **kwargs):
        if trainer_state.global_step >= step:
            return [0.0] * len(completion_ids)
        return parity(prompts, completions, completion_ids)

    return reward
