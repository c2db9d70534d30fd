"""Why a run is not learning (training/learning_signal.py): the causes named for a batch without
learning signal, the constant-reward watch, and each case made to happen on the tiny model."""

from __future__ import annotations

import json
import logging
import math

import torch

from maxent_grpo.cli import main
from maxent_grpo.training.learning_signal import ConstantRewardWatch, constant_value, no_signal_cause
from tiny_runs import tiny_overrides

NAN = math.nan


def test_causes_of_a_batch_without_signal():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.5], [0.0, 1.0], [0.0, 0.5]])
    names = ("format", "length")
    cut = torch.tensor([True, True, False, False])
    assert no_signal_cause(rewards, names, cut, 8) == (
        "50% of the completions were cut at generation.max_new_tokens=8 (raise it, or shorten the answers the "
        "prompt asks for); reward 'format' gave every completion 0")
    # Below half cut, truncation is not named; no constant function: the rewards differ between prompts only.
    assert no_signal_cause(rewards[:, 1:], names[1:], torch.tensor([True, False, False, False]), 8) == (
        "each prompt's completions got equal rewards, different between prompts")
    assert constant_value(torch.tensor([NAN, NAN])) is not None and math.isnan(constant_value(torch.tensor([NAN, NAN])))
    assert constant_value(torch.tensor([NAN, 1.0])) is None


def test_constant_reward_watch():
    watch = ConstantRewardWatch(patience=3)
    ones, mixed = torch.tensor([[1.0, 0.0], [1.0, 1.0]]), torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    said = [watch.observe(b, ("a", "b")) for b in (ones, ones, mixed, ones, ones, ones, ones)]
    # "a" is 1 in every batch: named at the third, and only once; "b" is constant in one batch only
    # (mixed), which is not a run of three.
    assert [len(s) for s in said] == [0, 0, 1, 0, 0, 0, 0]
    assert said[2] == ["reward 'a' gave every completion 1 in each of the last 3 batches, and no other value since "
                       "the run began: it adds nothing to the advantages (a constant function, a task the model never "
                       "solves, or one it solved from the start)"]
    # A change of value starts the count again; NaN (no reward) is no value.
    fresh = ConstantRewardWatch(patience=2)
    assert fresh.observe(torch.tensor([[1.0]]), ("c",)) == []
    assert fresh.observe(torch.tensor([[2.0]]), ("c",)) == []
    assert fresh.observe(torch.tensor([[NAN]]), ("c",)) == []
    assert fresh.observe(torch.tensor([[2.0]]), ("c",)) == []
    assert len(fresh.observe(torch.tensor([[2.0]]), ("c",))) == 1


def test_a_saturated_reward_is_told_from_a_constant_one():
    """A reward that varied and then sits at its highest value for every completion has been learned (the
    default run's format reward on some seeds); one that sits at its lowest after higher ones is lost."""
    learned = ConstantRewardWatch(patience=2)
    batches = [torch.tensor([[0.0], [1.0]]), torch.tensor([[1.0], [0.5]]), torch.tensor([[1.0], [1.0]]),
               torch.tensor([[1.0], [1.0]])]
    said = [learned.observe(b, ("format",)) for b in batches]
    assert said[:3] == [[], [], []]
    assert said[3] == ["reward 'format' gave every completion 1 in each of the last 2 batches, its highest this run "
                       "(it gave as low as 0 before): saturated, the model has learned what it rewards; it adds "
                       "nothing more to the advantages"]
    lost = ConstantRewardWatch(patience=2)
    said = [lost.observe(b, ("accuracy",)) for b in (torch.tensor([[0.0], [1.0]]), torch.zeros(2, 1), torch.zeros(2, 1))]
    assert said[2] == ["reward 'accuracy' gave every completion 0 in each of the last 2 batches, its lowest this run "
                       "(it gave up to 1 before): the model no longer earns it; it adds nothing to the advantages"]
    between = ConstantRewardWatch(patience=1)
    assert between.observe(torch.tensor([[0.0], [1.0]]), ("x",)) == []
    assert between.observe(torch.tensor([[0.5], [0.5]]), ("x",)) == [
        "reward 'x' gave every completion 0.5 in each of the last 1 batches (it gave 0 to 1 before): it adds nothing "
        "to the advantages"]
    # NaN (no reward) widens nothing.
    assert lost.bounds["accuracy"] == (0.0, 1.0)
    lost.observe(torch.tensor([[NAN], [NAN]]), ("accuracy",))
    assert lost.bounds["accuracy"] == (0.0, 1.0)


def _train(tiny_model_dir, out, caplog, rewards, *extra, steps=3, max_new_tokens=8):
    args = tiny_overrides(tiny_model_dir, out, rewards=rewards, steps=steps, max_new_tokens=max_new_tokens,
                          extra=["training.learning_rate=0.01", "logging.report_to=[tensorboard]", *extra])
    with caplog.at_level(logging.WARNING, logger="maxent_grpo"):
        assert main(["train", *args]) == 0
    return [r.getMessage() for r in caplog.records]


def _tracker_lines(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    return [e.tensor_proto.string_val[0].decode() for e in events.Tensors("warnings/text_summary")]


def test_every_completion_cut_at_the_length_limit_is_named(tiny_model_dir, tmp_path, caplog):
    """Two new tokens: the tiny model almost never ends that soon, and a cut answer has no format."""
    out = tmp_path / "run"
    lines = _train(tiny_model_dir, out, caplog, "[{name: format}]", max_new_tokens=2, steps=1)
    said = [x for x in lines if x.startswith("no learning signal")]
    assert len(said) == 1
    assert "of the completions were cut at generation.max_new_tokens=2" in said[0]
    assert "reward 'format' gave every completion 0" in said[0]
    assert any(said[0] in text for text in _tracker_lines(out))


def test_a_reward_equal_for_every_completion_is_named(tiny_model_dir, tmp_path, caplog):
    out = tmp_path / "run"
    lines = _train(tiny_model_dir, out, caplog, "[{name: 'learnable_rewards:always_one'}]", steps=1)
    said = [x for x in lines if x.startswith("no learning signal")]
    assert len(said) == 1 and "reward 'learnable_rewards:always_one' gave every completion 1" in said[0]
    assert said[0].endswith("(1 such batches so far; skipped/no_signal in metrics.jsonl)")


def test_a_constant_reward_beside_a_varying_one_is_named_once(tiny_model_dir, tmp_path, caplog):
    """even_first_token varies within groups (a signal every step); always_one adds nothing."""
    out = tmp_path / "run"
    lines = _train(tiny_model_dir, out, caplog,
                   "[{name: 'learnable_rewards:even_first_token'}, {name: 'learnable_rewards:always_one'}]", steps=4)
    constant = [x for x in lines if x.startswith("reward ")]
    assert constant == ["reward 'learnable_rewards:always_one' gave every completion 1 in each of the last 3 batches, "
                        "and no other value since the run began: it adds nothing to the advantages (a constant "
                        "function, a task the model never solves, or one it solved from the start)"]
    assert not any(x.startswith("no learning signal") for x in lines)
    assert constant[0] in _tracker_lines(out)[0]


def test_a_resumed_constant_reward_watch_neither_repeats_nor_forgets_a_warning():
    """Nor what it has seen: "a" varies in the first batch only, so its line says saturated at any cut."""
    ones = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    batches = [torch.tensor([[0.0, 0.0], [1.0, 1.0]])] + [ones] * 5
    whole = ConstantRewardWatch(patience=3)
    said = [whole.observe(b, ("a", "b")) for b in batches]
    assert said[3] == ["reward 'a' gave every completion 1 in each of the last 3 batches, its highest this run (it "
                       "gave as low as 0 before): saturated, the model has learned what it rewards; it adds nothing "
                       "more to the advantages"]
    for cut in range(1, len(batches)):
        first = ConstantRewardWatch(patience=3)
        before = [first.observe(b, ("a", "b")) for b in batches[:cut]]
        resumed = ConstantRewardWatch(patience=3)
        resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through trainer_state.json
        assert before + [resumed.observe(b, ("a", "b")) for b in batches[cut:]] == said
    assert [len(s) for s in said] == [0, 0, 0, 1, 0, 0]
    # A checkpoint from before the bounds were kept still loads; the bounds restart from the resumed batches.
    old = ConstantRewardWatch(patience=3)
    old.load_state_dict({"runs": {"a": [1.0, 2]}, "said": []})
    assert old.observe(ones, ("a", "b")) == ["reward 'a' gave every completion 1 in each of the last 3 batches, and "
                                             "no other value since the run began: it adds nothing to the advantages "
                                             "(a constant function, a task the model never solves, or one it solved "
                                             "from the start)"]
