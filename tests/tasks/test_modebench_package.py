"""ModeBench through the modebench package (tasks/modebench_package.py, ALGORITHMS.md §18): the
generated tasks are the package's Task form and its grader accepts their references; our
count of countdown modes is the package's count of keys; the split is leak-free; the
source, the reward and the mode keys as the run uses them."""

from __future__ import annotations

import json

import pytest

from maxent_grpo.data.datasets import load_prompt_dataset
from maxent_grpo.errors import DataError
from maxent_grpo.rewards.registry import REWARD_FUNCTIONS
from maxent_grpo.tasks.modebench import answer_key, mode_info, row_task
from maxent_grpo.tasks.modebench_package import GENERATED_DOMAINS, Unscorable, _text, _trees, package_rows

_api = pytest.importorskip("modebench.api", reason="modebench is not installed (the GPU machine's image)")
Task, grade = _api.Task, _api.grade


def _task(row) -> Task:
    return Task(**json.loads(row["mbp_task"]))


@pytest.mark.parametrize("domain", GENERATED_DOMAINS)
def test_generated_references_grade_correct_and_prompts_are_the_registered_ones(domain):
    from modebench.api import make_prompt

    rows = package_rows(domain, size=20, seed=3)
    assert len(rows) == 20 and len({r["mbp_task"] for r in rows}) == 20
    for row in rows:
        task = _task(row)
        assert task.level == 1 and task.domain == domain
        assert row["prompt"] == make_prompt(task)
        result = grade(task, row["answer"])
        assert result["status"] == "correct" and result["canonical_key"].startswith(
            {"countdown": "countdown:", "graph_coloring": "graph_coloring:", "python_factors": "python_factor:"}[domain])


def test_countdown_mode_counts_are_the_packages_distinct_keys():
    for row in package_rows("countdown", size=15, seed=0):
        answer = _task(row).answer
        keys = {grade(_task(row), _text(tree))["canonical_key"]
                for tree, value in _trees(tuple(answer["numbers"])) if value == answer["target"]}
        assert len(keys) == answer["num_modes"] >= 2


def test_graph_coloring_counts_and_python_factor_counts():
    for row in package_rows("graph_coloring", size=10, seed=1):
        answer = _task(row).answer
        assert answer["num_solutions"] >= 2 and len(answer["edges"]) >= 1
    for row in package_rows("python_factors", size=10, seed=1):
        cases = _task(row).answer["cases"]
        expected = 1
        for n in cases:
            expected *= sum(1 for d in range(2, n) if n % d == 0)
        assert _task(row).answer["num_modes"] == expected >= 2


@pytest.mark.parametrize("domain", GENERATED_DOMAINS)
def test_eval_never_holds_a_training_problem_and_is_one_fixed_list(domain):
    def refs(rows):
        return {json.dumps(_task(r).answer, sort_keys=True) for r in rows}

    evals = package_rows(domain, size=30, seed=0, split="eval")
    assert evals == package_rows(domain, size=30, seed=7, split="eval")
    for seed in (0, 1, 2):
        assert not refs(evals) & refs(package_rows(domain, size=60, seed=seed))


def test_the_source_and_its_one_line_errors():
    ds = load_prompt_dataset("modebench_pkg:graph_coloring", size=4, seed=0, task_kwargs={"split": "eval"})
    assert len(ds) == 4 and ds[0]["prompt"][0]["role"] == "system"
    for source, kwargs, match in [
        ("modebench_pkg:sudoku", None, "unknown ModeBench domain"),
        ("modebench_pkg:mathir", None, "cannot be generated offline"),
        ("modebench_pkg:countdown", {"bogus": 1}, "task_kwargs takes"),
    ]:
        with pytest.raises(DataError, match=match):
            load_prompt_dataset(source, size=4, seed=0, task_kwargs=kwargs)


def test_the_reward_mode_keys_and_an_unscorable_outcome():
    rows = package_rows("countdown", size=2, seed=0)
    reward = REWARD_FUNCTIONS["modebench_pkg"]()
    good = rows[0]["answer"]
    completions = [good, "\\boxed{1+1}", "no idea", "x"]
    values = reward(prompts=[None] * 4, completions=completions, mbp_task=[rows[0]["mbp_task"]] * 3 + [None])
    assert values == [1.0, 0.0, 0.0, None]
    key = grade(_task(rows[0]), good)["canonical_key"]
    assert answer_key(rows[0], good) == key and answer_key(rows[0], "no idea") is None
    assert mode_info(rows[0], good) == (key, _task(rows[0]).answer["num_modes"])
    assert row_task(rows[0]) == "countdown"
    broken = dict(json.loads(rows[0]["mbp_task"]))
    broken["answer"] = {"verifier": "countdown", "numbers": [], "target": 3}
    with pytest.raises(Unscorable, match="invalid_reference"):
        reward(prompts=[None], completions=[good], mbp_task=[json.dumps(broken)])


def test_a_batchs_grades_reach_the_verifier_once_per_completion(monkeypatch):
    from maxent_grpo.tasks.modebench_package import Grades

    calls, real = [], _api.grade
    monkeypatch.setattr(_api, "grade", lambda task, response: calls.append(response) or real(task, response))
    rows = package_rows("countdown", size=1, seed=0)
    good = rows[0]["answer"]
    grades = Grades()
    reward = REWARD_FUNCTIONS["modebench_pkg"]()
    assert reward(prompts=[None] * 3, completions=[good, good, "no"], mbp_task=[rows[0]["mbp_task"]] * 3,
                  mode_grades=grades) == [1.0, 1.0, 0.0]
    key = grade(_task(rows[0]), good)["canonical_key"]
    calls.clear()
    assert answer_key(rows[0], good, grades) == key and mode_info(rows[0], "no", grades)[0] is None
    assert calls == [] and grades.calls == 2
    broken = dict(json.loads(rows[0]["mbp_task"]))
    broken["answer"] = {"verifier": "countdown", "numbers": [], "target": 3}
    row = {"mbp_task": json.dumps(broken)}
    for _ in range(2):  # the unscorable outcome is kept, and raised again without a second call
        with pytest.raises(Unscorable, match="invalid_reference"):
            grades.grade(row, good)
    assert calls == [good] and grades.calls == 3


def test_the_example_turn_is_a_solved_training_problem_before_the_registered_prompt():
    from modebench.api import make_prompt

    bare = package_rows("graph_coloring", size=3, seed=0, split="eval")
    shown = package_rows("graph_coloring", size=3, seed=0, split="eval", example=True)
    assert [r["mbp_task"] for r in shown] == [r["mbp_task"] for r in bare]  # the same problems and grading
    for row in shown:
        system, user, assistant, problem = row["prompt"]
        assert [system, problem] == make_prompt(_task(row))
        assert (user["role"], assistant["role"]) == ("user", "assistant") and user["content"] != problem["content"]
        assert assistant["content"].startswith("\\boxed{") and assistant["content"].endswith("}")
    # The same example on every row; a training problem (never an eval one) that its own answer solves.
    assert len({json.dumps(r["prompt"][1:3]) for r in shown}) == 1
    assert shown[0]["prompt"][1]["content"] not in {json.loads(r["mbp_task"])["problem"]
                                                    for r in package_rows("graph_coloring", size=60, seed=0, split="eval")}
    with pytest.raises(DataError, match="example: true needs generated tasks"):
        load_prompt_dataset("modebench_pkg:countdown", size=2, seed=0,
                            task_kwargs={"generated": False, "example": True})
