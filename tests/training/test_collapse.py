"""The collapse warning (training/collapse.py): the signature's rule at its margins, and a tiny-model
run made to collapse onto one-token answers, warned on the console and in the tracker."""

from __future__ import annotations

import json
import logging
import statistics

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.collapse import CollapseWatch, collapse_signature
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import collapsing_model, tiny_overrides


def _row(step, entropy, length, reward, spread=0.5):
    return {"step": step, "entropy": entropy, "completions/mean_length": length, "reward": reward,
            "reward_std": spread}


def _history(later, window=2):
    """``window`` steady steps (entropy 1, length 10, reward 0.5, spread 0.5), then ``window`` of ``later``."""
    return [_row(i + 1, 1.0, 10.0, 0.5) for i in range(window)] + [
        _row(window + i + 1, *later) for i in range(window)]


def test_signature_holds_at_its_margins_and_not_inside_them():
    # entropy x1.05, length x0.8, reward down a quarter of the spread (0.125): all three at the margin.
    found = collapse_signature(_history((1.05, 8.0, 0.375)), 2)
    assert found is not None
    assert (found.earlier, found.later) == ((1, 2), (3, 4))
    assert found.entropy == pytest.approx((1.0, 1.05)) and found.length == (10.0, 8.0)
    for later in [(1.04, 8.0, 0.375), (1.05, 8.1, 0.375), (1.05, 8.0, 0.376), (0.9, 4.0, 0.1), (2.0, 12.0, 0.1),
                  (2.0, 4.0, 0.6)]:
        assert collapse_signature(_history(later), 2) is None, later
    # Too little history, a missing metric, or no reward spread to measure the fall by: no verdict.
    assert collapse_signature(_history((2.0, 4.0, 0.1))[1:], 2) is None
    rows = _history((2.0, 4.0, 0.1))
    rows[0]["entropy"] = None
    assert collapse_signature(rows, 2) is None
    flat = [_row(1, 1.0, 10.0, 0.5, 0.0), _row(2, 2.0, 4.0, 0.1, 0.0)]
    assert collapse_signature(flat, 1) is None
    assert collapse_signature(_history((2.0, 4.0, 0.1)), 0) is None


def test_watch_says_it_once_per_stretch():
    watch = CollapseWatch(1, "a lower training.learning_rate")
    said = [watch.observe(r) for r in [
        _row(1, 1.0, 10.0, 0.5), _row(2, 2.0, 4.0, 0.1),  # collapse: said
        _row(3, 3.0, 3.0, 0.0),  # still collapsing: not said again
        _row(4, 3.0, 3.0, 0.0),  # cleared
        _row(5, 4.0, 2.0, -0.2),  # a new stretch: said
    ]]
    assert [s is not None for s in said] == [False, True, False, False, True]
    assert said[1] == ("collapse signature, steps 2-2 against 1-1: token entropy 1.000 -> 2.000 up, mean length "
                       "10.0 -> 4.0 and reward 0.500 -> 0.100 down (short answers are being reinforced); "
                       "try a lower training.learning_rate")
    off = CollapseWatch(0, "x")
    assert all(off.observe(r) is None for r in _history((2.0, 4.0, 0.1), 1))


def test_a_collapsing_run_is_warned_on_the_console_and_in_the_tracker(tiny_model_dir, tmp_path, caplog):
    """The reward pays for long completions; the weighted MLE on near-uniform weights (q_temperature 100)
    pushes each completion up by 1/T_i per token, so the end-of-sequence token of short ones most
    (docs/ALGORITHMS.md §4). At lr 1e-3 the answers fall to one token, the reward with them, and the
    entropy over the fewer, first tokens rises: the signature."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = collapsing_model(tiny_model_dir, tmp_path / "model")
    out = tmp_path / "run"
    args = tiny_overrides(model, out, steps=12, num_generations=8, max_new_tokens=16, prompts_per_step=2,
                          rewards="[{name: length, kwargs: {max_length: 16, direction: favour, unit: tokens}}]",
                          extra=["method=maxent_listwise", "maxent.listwise_loss=weighted_mle", "maxent.q_temperature=100", "training.learning_rate=1e-3",
                                 "training.micro_batch_size=8", "logging.collapse_window=3",
                                 "logging.report_to=[tensorboard]"])
    with caplog.at_level(logging.WARNING, logger="maxent_grpo"):
        assert main(["train", *args]) == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("collapse signature")]
    assert lines, "the run did not collapse"
    assert all("try maxent.listwise_loss=centered_mle" in line for line in lines)

    # The first warning comes at the first step where the windows, recomputed from metrics.jsonl, show it.
    rows = read_metrics(out / "metrics.jsonl")

    def holds(end):
        a, b = rows[end - 6:end - 3], rows[end - 3:end]
        m = lambda rs, k: statistics.fmean(r[k] for r in rs)  # noqa: E731
        return (m(b, "entropy") >= 1.05 * m(a, "entropy")
                and m(b, "completions/mean_length") <= 0.8 * m(a, "completions/mean_length")
                and m(a, "reward") - m(b, "reward") >= 0.25 * m(a, "reward_std") > 0)

    first = next(end for end in range(6, len(rows) + 1) if holds(end))
    assert lines[0].startswith(f"collapse signature, steps {first - 2}-{first} against {first - 5}-{first - 3}:")

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("warnings/collapse")][0] == first
    # The warnings table holds every warning of the run (a batch without signal may come first).
    tables = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors("warnings/text_summary")}
    assert lines[0] in tables[first]


def test_a_watch_resumed_from_its_checkpoint_state_says_what_the_uninterrupted_one_says():
    rows = [_row(1, 1.0, 10.0, 0.5), _row(2, 1.0, 10.0, 0.5), _row(3, 2.0, 4.0, 0.1), _row(4, 2.0, 4.0, 0.1),
            _row(5, 2.0, 4.0, 0.1), _row(6, 3.0, 2.0, -0.3)]
    whole = CollapseWatch(2, "x")
    said = [whole.observe(r) for r in rows]
    for cut in range(1, len(rows)):
        first = CollapseWatch(2, "x")
        before = [first.observe(r) for r in rows[:cut]]
        saved = json.loads(json.dumps(first.state_dict()))  # through trainer_state.json
        resumed = CollapseWatch(2, "x")
        resumed.load_state_dict(saved)
        assert before + [resumed.observe(r) for r in rows[cut:]] == said
    assert sum(s is not None for s in said) == 1
