"""Answers, built-in rewards (real math-verify and reasoning-gym) and the registry."""

from __future__ import annotations

import json
import math
import threading
from collections import Counter

import pytest
import torch

from maxent_grpo.tasks.answers import canonical_answer, completion_text, extract_boxed, extract_final_answer
from maxent_grpo.rewards.builtin import (
    make_accuracy,
    make_boxed_accuracy,
    make_cosine_length,
    make_format,
    make_length,
    make_reasoning_gym,
    make_reasoning_steps,
    make_repetition_penalty,
    make_tag_count,
    make_tag_format,
)
from maxent_grpo.rewards.registry import (
    REWARD_FUNCTIONS,
    RewardFunctionError,
    RewardSpec,
    build_reward_spec,
    evaluate_rewards,
    resolve_reward_function,
)


def call(fn, completions, **columns):
    return fn(prompts=["p"] * len(completions), completions=completions, **columns)


def chat(text):
    return [{"role": "assistant", "content": text}]


# ------------------------------------------------------------------ answers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{\frac{1}{2}} done", r"\frac{1}{2}"),
        (r"\boxed{1} and later \boxed{2}", "2"),
        (r"\boxed{{a}{b}}", "{a}{b}"),
        (r"\boxed{ 3 } then \boxed{4", "3"),  # truncated last box: the earlier complete one
        (r"\boxed{} <answer> 7 </answer>", "7"),  # an empty box is no answer
        ("<answer>1</answer> ... <answer>2</answer>", "2"),
        (r"<answer>5</answer> but \boxed{6}", "6"),  # boxed wins over tags
        (r"\fbox{x}", "x"),
        ("no answer here", None),
        ("<answer>  </answer>", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_extract_boxed_ignores_answer_tags_and_is_linear_on_pathological_text():
    assert extract_boxed("<answer>3</answer>") is None
    nasty = "\\boxed{" * 20000 + "1"  # nothing closes: must not be quadratic
    assert extract_boxed(nasty) is None
    assert extract_boxed(nasty + "}") == "1"


@pytest.mark.parametrize(
    "pair",
    [("4", "4.0"), ("4", "$4$"), ("4", " 4. "), ("1000", "1,000"), ("0.5", "+0.50"), ("0", "-0.0"),
     (r"\frac{1}{2}", r"\dfrac{1}{2}"), ("x+1", "x + 1"), (r"5", r"\text{5}"), ("-3", "-3.000")],
)
def test_canonical_answer_equates_equal_answers(pair):
    assert canonical_answer(pair[0]) == canonical_answer(pair[1])


@pytest.mark.parametrize("pair", [("4", "40"), ("0.5", "5"), ("A", "a"), ("1,000", "1.000"), ("-4", "4"), ("12", "1,2")])
def test_canonical_answer_keeps_different_answers_apart(pair):
    assert canonical_answer(pair[0]) != canonical_answer(pair[1])


def test_completion_text_forms():
    assert completion_text("plain") == "plain"
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "first"},
            {"role": "tool", "content": "t"}, {"role": "assistant", "content": "last"}]
    assert completion_text(conv) == "last"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]}]
    assert completion_text(parts) == "ab"
    with pytest.raises(ValueError, match="no assistant message"):
        completion_text([{"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match="completion must be"):
        completion_text(3)


# ------------------------------------------------------------- math rewards


def test_accuracy_uses_math_verify_and_skips_rows_without_gold():
    fn = make_accuracy()
    completions = [r"The answer is \boxed{\frac{1}{2}}.", r"\boxed{0.5}", r"\boxed{2}", "no idea", r"\boxed{3}", "x"]
    golds = ["0.5", r"\frac{1}{2}", "3", "3", None, "   "]
    assert call(fn, completions, answer=golds) == [1.0, 1.0, 0.0, 0.0, None, None]
    # TRL's conversational completions are scored on the assistant message.
    assert call(fn, [chat(r"\boxed{4}")], answer=["4"]) == [1.0]


def test_accuracy_text_golds_and_unparseable_golds():
    # A bare gold is retried inside $...$, so plain words compare as math-verify strings.
    out = call(make_accuracy(), [r"\boxed{Paris}", r"\boxed{London}", r"\boxed{x}"], answer=["Paris", "Paris", "$$"])
    assert out == [1.0, 0.0, None]


def test_accuracy_names_the_missing_column():
    with pytest.raises(ValueError, match="reward 'accuracy' needs the dataset column 'answer'.*'task'"):
        call(make_accuracy(), ["1"], task=["t"])


def test_accuracy_needs_main_thread_unless_timeouts_are_off():
    errors, results = [], []

    def run(fn):
        try:
            results.append(call(fn, [r"\boxed{2}"], answer=["2"]))
        except RuntimeError as exc:
            errors.append(str(exc))

    for fn in (make_accuracy(), make_accuracy(timeout_seconds=None)):
        thread = threading.Thread(target=run, args=(fn,))
        thread.start()
        thread.join()
    assert len(errors) == 1 and "main thread" in errors[0] and "timeout_seconds=None" in errors[0]
    assert results == [[1.0]]
    with pytest.raises(ValueError, match="timeout_seconds"):
        make_accuracy(timeout_seconds=0)


def test_boxed_accuracy_canonical_then_math_verify():
    fn = make_boxed_accuracy()
    completions = [r"\boxed{4.0}", r"<answer>1,000</answer>", r"\boxed{\frac{2}{4}}", r"\boxed{5}", "4", r"\boxed{x}"]
    golds = ["4", "1000", "0.5", "4", "4", None]
    assert call(fn, completions, answer=golds) == [1.0, 1.0, 1.0, 0.0, 0.0, None]
    # a gold that carries its own boxed solution is reduced to its final answer
    assert call(fn, [r"\boxed{7}"], answer=[r"3 + 4 = \boxed{7}"]) == [1.0]


# ------------------------------------------------------------------ format


def test_format_styles_and_pattern():
    texts = [r"so \boxed{3}", r"\boxed{}", "<answer>3</answer>", r"\boxed{3", "Final: 3"]
    assert call(make_format(), texts) == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert call(make_format(style="answer_tag"), texts) == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert call(make_format(pattern=r"Final: \d+$"), texts) == [0.0, 0.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="style"):
        make_format(style="xml")
    with pytest.raises(ValueError, match="pattern"):
        make_format(pattern="(")


def test_tag_format_and_tag_count():
    good = "<think>\nadd them\n</think>\n<answer>5</answer>\n"
    texts = [good, "<think>a</think><answer></answer>", "<answer>5</answer>",
             "pre <think>a</think><answer>5</answer>", "<think>a</think><think>b</think><answer>5</answer>", ""]
    assert call(make_tag_format(), texts) == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert call(make_tag_count(), texts) == [1.0, 1.0, 0.5, 1.0, 0.5, 0.0]


def test_reasoning_steps_counts_markers():
    text = "Step 1: read\nStep 2: add\n- note\nFinally, done"
    assert call(make_reasoning_steps(), [text, "First, a. Then, b.", "just 5"]) == [1.0, 2 / 3, 0.0]
    assert call(make_reasoning_steps(min_steps=8), [text]) == [0.5]
    with pytest.raises(ValueError, match="min_steps"):
        make_reasoning_steps(min_steps=0)


# ------------------------------------------------------------------ length


def _cosine_reference(correct: bool, length: int, max_len: int, lo_c, hi_c, lo_w, hi_w) -> float:
    # (1 + cos(pi p)) / 2 == cos(pi p / 2)^2; correct falls from hi_c, wrong rises from lo_w.
    weight = math.cos(math.pi * min(length, max_len) / max_len / 2) ** 2
    return lo_c + (hi_c - lo_c) * weight if correct else hi_w + (lo_w - hi_w) * weight


def test_cosine_length_matches_reference_and_is_monotone():
    opts = dict(min_value_wrong=-2.0, max_value_wrong=-0.25, min_value_correct=0.1, max_value_correct=1.5, max_len=10)
    fn = make_cosine_length(**opts, unit="tokens")
    lengths = [0, 1, 3, 5, 9, 10, 25]
    for correct in (True, False):
        text = r"\boxed{7}" if correct else r"\boxed{8}"
        out = call(fn, [text] * len(lengths), answer=["7"] * len(lengths), completion_ids=[[0] * n for n in lengths])
        ref = [_cosine_reference(correct, n, 10, opts["min_value_correct"], opts["max_value_correct"],
                                 opts["min_value_wrong"], opts["max_value_wrong"]) for n in lengths]
        assert out == pytest.approx(ref, abs=1e-12)
        assert out[3] == pytest.approx(sum(ref[0::5][:2]) / 2)  # half way is the midpoint
        diffs = [b - a for a, b in zip(out, out[1:])]
        assert all(d < 0 for d in diffs[:-1]) if correct else all(d > 0 for d in diffs[:-1])
        assert diffs[-1] == pytest.approx(0.0)  # beyond max_len the value is held
    assert call(make_cosine_length(), ["x"], answer=[None]) == [None]
    with pytest.raises(ValueError, match="min_value_correct"):
        make_cosine_length(min_value_correct=2.0)


def test_cosine_length_counts_characters_by_default():
    fn = make_cosine_length(max_len=20)
    short, long = r"\boxed{7}", r"\boxed{7}" + " " * 11
    assert call(fn, [short, long], answer=["7", "7"]) == pytest.approx(
        [_cosine_reference(True, len(short), 20, 0.5, 1.0, -1.0, -0.5), 0.5])


def test_length_reward_directions_and_units():
    texts = ["", "abcde", "x" * 30]
    assert call(make_length(max_length=10), texts) == [0.0, -0.5, -1.0]
    assert call(make_length(max_length=10, direction="favour"), texts) == [0.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="needs the dataset column 'completion_ids'"):
        call(make_length(unit="tokens"), texts)
    assert call(make_length(max_length=4, unit="tokens"), ["a", "b"], completion_ids=[[1], [1, 2, 3, 4, 5]]) == [-0.25, -1.0]
    with pytest.raises(ValueError, match="direction"):
        make_length(direction="up")
    with pytest.raises(ValueError, match="unit"):
        make_length(unit="bytes")


def _repetition_reference(text: str, n: int, max_penalty: float) -> float:
    words = text.lower().split()
    if len(words) < n:
        return 0.0
    counts = Counter(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))
    repeats = sum(c - 1 for c in counts.values())
    return max_penalty * repeats / sum(counts.values())


def test_repetition_penalty_matches_reference():
    texts = ["a b a b a b", "one two three four", "the the the the the", "A b A B", "a b", ""]
    for n, max_penalty in [(1, -1.0), (2, -0.5), (3, -2.0)]:
        out = call(make_repetition_penalty(ngram_size=n, max_penalty=max_penalty), texts)
        assert out == pytest.approx([_repetition_reference(t, n, max_penalty) for t in texts], abs=1e-12)
    assert call(make_repetition_penalty(ngram_size=2), ["a b a b a b"]) == pytest.approx([-0.6])
    assert call(make_repetition_penalty(), ["no repeats at all here"]) == [0.0]
    with pytest.raises(ValueError, match="max_penalty"):
        make_repetition_penalty(max_penalty=0.5)
    with pytest.raises(ValueError, match="ngram_size"):
        make_repetition_penalty(ngram_size=0)


# ------------------------------------------------------------ reasoning-gym


def test_reasoning_gym_scores_with_the_task_scorer():
    import reasoning_gym

    entries = list(reasoning_gym.create_dataset("chain_sum", size=4, seed=3))
    golds = [e["answer"] for e in entries]
    wrong = [str(int(g) + 1) for g in golds]
    completions = [rf"... \boxed{{{g}}}" for g in golds] + [rf"\boxed{{{w}}}" for w in wrong] + ["I give up"] * 4
    rg_entry = [json.dumps(e) for e in entries] * 3
    fn = make_reasoning_gym()
    out = call(fn, completions, rg_entry=rg_entry, task=["chain_sum"] * 12)
    assert out == [1.0] * 4 + [0.0] * 8
    # without a task column the entry's metadata names the task; dict entries work too
    assert call(fn, [chat(rf"\boxed{{{golds[0]}}}")], rg_entry=[entries[0]]) == [1.0]
    assert call(fn, ["x"], rg_entry=[None]) == [None]
    with pytest.raises(ValueError, match="'rg_entry'"):
        call(fn, ["x"], answer=["1"])


# ------------------------------------------------------------------ registry


# Factories whose options have no default, each built in its own test file.
NEEDS_OPTIONS = {"soft_overlong": "tests/rewards/test_overlong.py", "reward_model": "tests/rewards/test_reward_model.py"}


def test_every_registered_factory_builds_with_defaults():
    import inspect

    for name, factory in REWARD_FUNCTIONS.items():
        required = [p for p in inspect.signature(factory).parameters.values()
                    if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if required:
            assert name in NEEDS_OPTIONS, f"{name} needs {[p.name for p in required]}: build it in a test of its own"
            continue
        fn = factory()
        assert fn.__name__ == name
        assert resolve_reward_function(name).__name__ == name
    assert set(NEEDS_OPTIONS) <= set(REWARD_FUNCTIONS)


def test_resolve_unknown_name_suggests_nearest():
    with pytest.raises(ValueError, match=r"unknown reward function 'acuracy'.*did you mean 'accuracy'"):
        resolve_reward_function("acuracy")
    with pytest.raises(ValueError, match="no module .no_such_module_xyz. beside the config file, in the current folder"):
        resolve_reward_function("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute"):
        resolve_reward_function("math:no_such_fn")
    with pytest.raises(ValueError, match="non-callable"):
        resolve_reward_function("math:pi")


TRL_STYLE_MODULE = '''
def exact_answer(completions, **kwargs):
    """Written for TRL: conversational completions, dataset columns in kwargs, no prompts argument."""
    return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, kwargs["answer"])]


def make_constant(value):
    def constant(prompts, completions, **kwargs):
        return [value] * len(completions)
    return constant
'''


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_mod.py").write_text(TRL_STYLE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards_mod"


def test_trl_style_function_runs_unchanged(user_rewards):
    spec = build_reward_spec([
        {"name": f"{user_rewards}:exact_answer", "weight": 2.0},
        {"name": f"{user_rewards}:make_constant", "kwargs": {"value": 0.25}},
        "boxed_accuracy",
    ])
    assert spec.names == (f"{user_rewards}:exact_answer", f"{user_rewards}:make_constant", "boxed_accuracy")
    completions = [chat("4"), chat(r"\boxed{5}"), chat(" 5 ")]
    out = evaluate_rewards(spec, [[{"role": "user", "content": "q"}]] * 3, completions, {"answer": ["4", "5", "5"]})
    expected = torch.tensor([[1.0, 0.25, 0.0], [0.0, 0.25, 1.0], [1.0, 0.25, 0.0]], dtype=torch.float64)
    assert out.dtype == torch.float64 and torch.equal(out, expected)
    assert torch.equal(spec.weight_tensor(), torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64))


def test_build_reward_spec_entry_forms_and_errors():
    from maxent_grpo.config.load import RewardEntry

    spec = build_reward_spec([RewardEntry("format", 0.5, {"style": "answer_tag"}), "tag_count"])
    assert spec.weights == (0.5, 1.0)
    assert call(spec.funcs[0], ["<answer>1</answer>"]) == [1.0]
    with pytest.raises(ValueError, match=r"rewards\[0\]: unknown keys \['wieght'\]"):
        build_reward_spec([{"name": "format", "wieght": 1}])
    with pytest.raises(ValueError, match=r"rewards\[1\] \(format\): bad kwargs \['colour'\]"):
        build_reward_spec(["accuracy", {"name": "format", "kwargs": {"colour": 1}}])
    with pytest.raises(ValueError, match="repeated"):
        build_reward_spec(["format", "format"])
    with pytest.raises(ValueError, match="weight"):
        build_reward_spec([{"name": "format", "weight": "high"}])
    with pytest.raises(ValueError, match="non-finite"):
        build_reward_spec([{"name": "format", "weight": float("inf")}])
    with pytest.raises(ValueError, match="at least one"):
        build_reward_spec([])
    with pytest.raises(ValueError, match="list of entries"):
        build_reward_spec("format")


def _spec(fn, name="bad"):
    return RewardSpec((name,), (fn,), (1.0,))


def test_evaluate_rewards_none_becomes_nan():
    out = evaluate_rewards(_spec(lambda prompts, completions, **kw: [None, 1, 0.5]), ["p"] * 3, ["a", "b", "c"], {})
    assert torch.isnan(out[0, 0]) and out[1:, 0].tolist() == [1.0, 0.5]


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda prompts, completions, **kw: [1.0], r"reward function 'bad': returned 1 values for 3 completions"),
        (lambda prompts, completions, **kw: [1.0, float("nan"), 0.0], r"'bad': row 1: returned non-finite nan"),
        (lambda prompts, completions, **kw: [1.0, 0.0, float("inf")], r"'bad': row 2: returned non-finite inf"),
        (lambda prompts, completions, **kw: [1.0, "1", 0.0], r"'bad': row 1: returned '1' \(str\), not a number"),
        (lambda prompts, completions, **kw: torch.ones(3), r"'bad': returned Tensor, expected a list"),
        (lambda prompts, completions, **kw: 1 / 0, r"'bad': raised ZeroDivisionError: division by zero"),
    ],
)
def test_evaluate_rewards_rejects_bad_outputs(fn, message):
    with pytest.raises(RewardFunctionError, match=message) as info:
        evaluate_rewards(_spec(fn), ["p"] * 3, ["a", "b", "c"], {})
    assert isinstance(info.value, ValueError) and info.value.function_name == "bad"


def test_evaluate_rewards_wraps_a_builtin_missing_its_column():
    spec = build_reward_spec(["accuracy"])
    with pytest.raises(RewardFunctionError, match="'accuracy': raised ValueError: .*'answer'") as info:
        evaluate_rewards(spec, ["p"], ["1"], {})
    assert isinstance(info.value.__cause__, ValueError)


def test_evaluate_rewards_checks_its_inputs():
    spec = build_reward_spec(["format"])
    with pytest.raises(ValueError, match=r"columns\['answer'\] has 1 values for 2 completions"):
        evaluate_rewards(spec, ["p", "p"], ["a", "b"], {"answer": ["1"]})
    with pytest.raises(ValueError, match="prompts has 1 entries"):
        evaluate_rewards(spec, ["p"], ["a", "b"], {})
