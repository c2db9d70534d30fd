"""Prompt datasets: loading (files, hub cache, reasoning-gym, ModeBench, HumanEval), splitting, sampling.

Every loader returns a table with the standard columns `prompt` (a str, or a
list of chat messages) and, when the source has one, `answer` (a str); other
columns are kept and reach the reward functions. File, hub and HumanEval
sources give a `datasets.Dataset`; generated sources (reasoning-gym, ModeBench,
the calculator) give `Rows` (data/rows.py), which needs no `datasets`. Reasoning-gym
sources add `rg_entry` (the task's entry as JSON) and `task`, which the
`reasoning_gym` reward scores with.
"""

from __future__ import annotations

import difflib
import importlib.util
import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from maxent_grpo.data.human_eval import HUMAN_EVAL_SOURCE, load_human_eval
from maxent_grpo.data.rows import Rows
from maxent_grpo.errors import DataError

DEFAULT_INSTRUCTION = "Put your final answer within \\boxed{}."
RG_PREFIX = "reasoning_gym:"
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
MODEBENCH_PREFIX = "modebench:"  # maxent_grpo.tasks.modebench: tasks with several valid answers
MODEBENCH_PKG_PREFIX = "modebench_pkg:"  # maxent_grpo.tasks.modebench_package: the modebench package's tasks
CALCULATOR_SOURCE = "calculator"  # maxent_grpo.tasks.calculator: multiplication with a calculator tool
_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def _one_line(exc: BaseException) -> str:
    """The error and its root cause (datasets wraps the informative one), on one line."""
    root = exc
    while root.__cause__ is not None:
        root = root.__cause__
    parts = []
    for err in (exc, root) if root is not exc else (exc,):
        lines = str(err).strip().splitlines()
        parts.append(f"{type(err).__name__}: {lines[0] if lines else ''}")
    return " <- ".join(parts)


# ------------------------------------------------------------------ loading


def _load_file(path: Path, split: str, data_files: Any):
    import datasets

    if data_files is not None:
        raise DataError(f"data_files is for hub or builder sources, not for the file source {path}")
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    if path.stat().st_size == 0:
        raise DataError(f"data file is empty: {path}")
    if path.suffix == ".jsonl":
        # Before datasets reads it: its error gives a byte position and logs a traceback.
        _check_jsonl_lines(path)
    try:
        loaded = datasets.load_dataset(_FILE_BUILDERS[path.suffix], data_files=str(path), split="train")
    except Exception as exc:  # re-raised as a one-line DataError, never defaulted
        if "corresponds to no data" in str(exc):  # how datasets reports a file without rows
            raise DataError(f"{path}: the dataset is empty") from exc
        raise DataError(f"could not read {path}: {_one_line(exc)}") from exc
    if split != "train":
        raise DataError(f"a single file holds only the split 'train', got split={split!r} for {path}")
    return loaded


def _check_jsonl_lines(path: Path) -> None:
    """Name the first line of a JSONL file that is not one JSON object."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                raise DataError(f"{path} line {number}: invalid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {number}: expected a JSON object, got {type(row).__name__}")


def _load_hub(name: str, split: str, data_files: Any):
    import datasets

    try:
        loaded = datasets.load_dataset(name, data_files=data_files)
    except Exception as exc:  # re-raised as a one-line DataError, never defaulted
        raise DataError(
            f"could not load dataset {name!r} (not a local .jsonl/.json/.parquet file; hub datasets load "
            f"offline only from the cache): {_one_line(exc)}"
        ) from exc
    if split not in loaded:
        raise DataError(f"dataset {name!r} has no split {split!r}; splits: {sorted(loaded)}")
    return loaded[split]


def _load_reasoning_gym(task: str, size: int | None, seed: int, instruction: str | None, task_kwargs):
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if task not in DATASETS:
        close = difflib.get_close_matches(task, list(DATASETS), n=3)
        raise DataError(f"unknown reasoning-gym task {task!r}; close names: {close}")
    if size is None or size < 1:
        raise DataError(f"size must be a positive int for {RG_PREFIX}{task} (how many problems to generate), got {size!r}")
    try:
        generated = reasoning_gym.create_dataset(task, size=size, seed=seed, **(task_kwargs or {}))
    except (TypeError, ValueError, AssertionError) as exc:  # task configs validate with assert
        raise DataError(f"{RG_PREFIX}{task}: bad task_kwargs {dict(task_kwargs or {})}: {_one_line(exc)}") from exc
    rows = []
    for index, entry in enumerate(generated):
        question = entry["question"]
        try:
            rg_entry = json.dumps(entry)
        except TypeError as exc:
            raise DataError(f"{RG_PREFIX}{task} entry {index} is not JSON-serialisable: {exc}") from exc
        rows.append({"prompt": f"{question}\n\n{instruction}" if instruction else question,
                     "answer": None if entry["answer"] is None else str(entry["answer"]),
                     "rg_entry": rg_entry, "task": task})
    return Rows(rows)


def _load_modebench(task: str, size: int | None, seed: int, instruction: str | None, task_kwargs):
    from maxent_grpo.tasks.modebench import modebench_rows

    kwargs = dict(task_kwargs or {})
    unknown = sorted(set(kwargs) - {"split"})
    if unknown:
        raise DataError(f"{MODEBENCH_PREFIX}{task}: task_kwargs takes only 'split' (train | eval), got {unknown}")
    if size is None or size < 1:
        raise DataError(f"size must be a positive int for {MODEBENCH_PREFIX}{task} (problems per task), got {size!r}")
    try:
        rows = modebench_rows(task, size=size, seed=seed, split=kwargs.get("split", "train"), instruction=instruction)
    except ValueError as exc:
        raise DataError(str(exc)) from exc
    return Rows(rows)


def _load_modebench_package(domain: str, size: int | None, seed: int, task_kwargs):
    kwargs = dict(task_kwargs or {})
    unknown = sorted(set(kwargs) - {"split", "generated", "level", "example"})
    if unknown:
        raise DataError(f"{MODEBENCH_PKG_PREFIX}{domain}: task_kwargs takes split (train | eval), generated (bool), "
                        f"level (1-5) and example (bool), got {unknown}")
    if size is None or size < 1:
        raise DataError(f"size must be a positive int for {MODEBENCH_PKG_PREFIX}{domain} (problems), got {size!r}")
    if importlib.util.find_spec("modebench") is None:
        raise DataError(f"{MODEBENCH_PKG_PREFIX}{domain} needs the modebench package: pip install 'maxent-grpo[modebench]'")
    from maxent_grpo.tasks.modebench_package import package_rows

    try:
        rows = package_rows(domain, size=size, seed=seed, split=kwargs.get("split", "train"),
                            generated=kwargs.get("generated", True), level=kwargs.get("level", 1),
                            example=kwargs.get("example", False))
    except ValueError as exc:
        raise DataError(str(exc)) from exc
    return Rows(rows)


def _standardise(ds, source: str, prompt_column: str, answer_column: str, environment_prompts: bool = False,
                 cast_answers: bool = True):
    columns = list(ds.column_names)
    if prompt_column not in columns and environment_prompts:
        # The rows' environments open the episodes (TRL: reset() gives the prompt): an empty prompt column.
        ds = Rows([{**row, "prompt": ""} for row in ds]) if isinstance(ds, Rows) else ds.add_column("prompt", [""] * len(ds))
        columns = list(ds.column_names)
        prompt_column = "prompt"
    if prompt_column not in columns:
        raise DataError(f"{source}: no prompt column {prompt_column!r}; columns: {columns}")
    if answer_column != "answer" and answer_column not in columns:
        raise DataError(f"{source}: no answer column {answer_column!r}; columns: {columns}")
    for wanted, given in (("prompt", prompt_column), ("answer", answer_column)):
        if given != wanted and given in columns:
            if wanted in columns:
                raise DataError(f"{source}: cannot use column {given!r} as {wanted!r}: a column {wanted!r} exists already")
            if wanted == "prompt":
                ds = ds.rename_column(given, wanted)
            else:
                # A copy: the reward functions still get the column under its own name (kwargs["solution"]).
                ds = ds.add_column(wanted, ds[given])
    if cast_answers and "answer" in ds.column_names:
        ds = _answers_as_strings(ds, source, answer_column)
    return ds


def _answers_as_strings(ds, source: str, answer_column: str):
    """``ds`` with its ``answer`` column cast to str (None kept); one line naming the column otherwise."""
    if isinstance(ds, Rows):
        bad = next((a for a in ds["answer"] if a is not None and (isinstance(a, bool) or not isinstance(a, (str, int, float)))), None)
        if bad is not None:
            raise DataError(f"{source}: answer column {answer_column!r} must hold strings or numbers, got {bad!r}")
        answers = [a if a is None or isinstance(a, str) else str(a) for a in ds["answer"]]
        return Rows([{**row, "answer": a} for row, a in zip(ds, answers)])
    from datasets import Value

    feature = ds.features["answer"]
    if not isinstance(feature, Value):
        raise DataError(f"{source}: answer column {answer_column!r} must hold strings or numbers, got {feature}")
    if feature.dtype != "string":
        ds = ds.cast_column("answer", Value("string"))
    return ds


def _check_prompts(ds, source: str, environment_prompts: bool = False) -> None:
    if len(ds) == 0:
        raise DataError(f"{source}: the dataset is empty")
    for row, prompt in enumerate(ds["prompt"]):
        if environment_prompts and (prompt is None or prompt == ""):
            continue  # its environment's reset() gives the prompt (an episode fails when it gives none)
        if isinstance(prompt, str):
            if not prompt.strip():
                raise DataError(f"{source}: empty prompt in row {row}")
            continue
        if not isinstance(prompt, list) or not prompt:
            raise DataError(f"{source}: prompt in row {row} must be a non-empty str or list of messages, got {prompt!r}")
        for message in prompt:
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise DataError(f"{source}: prompt in row {row} has a message without a 'role': {message!r}")
            if message["role"] not in CHAT_ROLES:
                raise DataError(f"{source}: prompt in row {row} has a message with role {message['role']!r}; "
                                f"roles are {', '.join(CHAT_ROLES)}")
            if not isinstance(message.get("content"), str):
                raise DataError(f"{source}: prompt in row {row} has a message without str 'content': {message!r}")
        if not any(m["content"].strip() for m in prompt):
            raise DataError(f"{source}: empty prompt in row {row}")


@dataclass(frozen=True)
class ColumnNames:
    """The columns of a table that hold the prompt and the answer (renamed ``prompt`` and ``answer``; the
    answer column keeps its own name too)."""

    prompt: str = "prompt"
    answer: str = "answer"


def load_prompt_dataset(
    source: str,
    *,
    split: str = "train",
    columns: ColumnNames = ColumnNames(),
    size: int | None = None,
    seed: int = 0,
    data_files: Any = None,
    instruction: str | None = DEFAULT_INSTRUCTION,
    task_kwargs: Mapping[str, Any] | None = None,
    environment_prompts: bool = False,
):
    """A table of prompts (`datasets.Dataset`, or `Rows` for a generated source) with the standard
    columns `prompt` and `answer` (from the table's `columns`).

    `source` is a local `.jsonl` / `.json` / `.parquet` file, `reasoning_gym:<task>`
    (`size` problems generated offline from `seed`, each question followed by
    `instruction`, `task_kwargs` passed to the task's config), `human_eval` (the
    164 HumanEval problems from the installed package), `modebench:<task>`
    (`size` problems per task of maxent_grpo.tasks.modebench, `task_kwargs: {split: train | eval}`),
    `modebench_pkg:<domain>` (`size` tasks of the modebench package, generated offline or its frozen
    split, `task_kwargs: {split, generated, level}`; its own registered prompts, no `instruction`),
    `calculator` (`size` multiplications played with a calculator tool, column `environment`), or a `datasets`
    name (with `data_files` if it needs them; offline it loads from the cache
    only). `size` keeps at most the first `size` rows of a file or hub split. With
    `environment_prompts` (the rows play episodes) a row may have no prompt (an empty or missing
    column): its environment's `reset()` gives it, as TRL lets an environment own its data. Raises
    `DataError` with a one-line message.
    """
    if not isinstance(source, str) or not source:
        raise DataError(f"source must be a non-empty str, got {source!r}")
    if size is not None and (not isinstance(size, int) or size < 1):
        raise DataError(f"size must be a positive int or None, got {size!r}")
    if source.startswith(RG_PREFIX):
        ds = _load_reasoning_gym(source[len(RG_PREFIX) :], size, seed, instruction, task_kwargs)
    elif source == HUMAN_EVAL_SOURCE:
        if split != "train":
            raise DataError(f"{HUMAN_EVAL_SOURCE} holds one split, 'train'; got split={split!r} (use data.eval_size)")
        ds = load_human_eval(instruction, DEFAULT_INSTRUCTION)
        if size is not None and size < len(ds):
            ds = ds.select(range(size))
    elif source.startswith(MODEBENCH_PREFIX):
        ds = _load_modebench(source[len(MODEBENCH_PREFIX) :], size, seed, instruction, task_kwargs)
    elif source.startswith(MODEBENCH_PKG_PREFIX):
        ds = _load_modebench_package(source[len(MODEBENCH_PKG_PREFIX) :], size, seed, task_kwargs)
    elif source == CALCULATOR_SOURCE:
        from maxent_grpo.tasks.calculator import calculator_rows

        if size is None:
            raise DataError(f"size must be a positive int for {CALCULATOR_SOURCE} (problems generated), got None")
        ds = Rows(calculator_rows(size, seed))
    else:
        path = Path(source)
        is_file = path.suffix in _FILE_BUILDERS
        ds = _load_file(path, split, data_files) if is_file else _load_hub(source, split, data_files)
        if size is not None and size < len(ds):
            ds = ds.select(range(size))
    ds = _standardise(ds, source, columns.prompt, columns.answer, environment_prompts)
    _check_prompts(ds, source, environment_prompts)
    return ds


def given_table(table: Any, name: str, *, prompt_column: str = "prompt", answer_column: str = "answer",
                environment_prompts: bool = False, limit: int | None = None):
    """A table given as a Python object (``train_dataset=`` of ``maxent_grpo.train`` or ``GRPOTrainer``),
    checked as a loaded source is; ``name`` names it in errors.

    ``table`` is a ``datasets.Dataset``, an iterable one (``IterableDataset``: its first ``limit`` rows
    are read, all of them when ``limit`` is None), or a list of row dicts. TRL's formats: a ``prompt``
    column of strings (standard) or of message lists (conversational); every other column reaches the
    reward functions as it is (an ``answer`` column is not cast to str, as a file's is).
    """
    if isinstance(table, (list, tuple)):
        bad = next((i for i, row in enumerate(table) if not isinstance(row, Mapping)), None)
        if bad is not None:
            raise DataError(f"{name}: a list of rows must hold dicts, row {bad} is {type(table[bad]).__name__}")
        table = Rows(table)
    elif not (hasattr(table, "column_names") and hasattr(table, "select")):
        if not hasattr(table, "__iter__") or isinstance(table, (str, bytes, Mapping)):
            raise DataError(f"{name}: expected a datasets.Dataset, an IterableDataset or a list of row dicts, "
                            f"got {type(table).__name__}")
        rows = list(itertools.islice(iter(table), limit))
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, Mapping)), None)
        if bad is not None:
            raise DataError(f"{name}: row {bad} is a {type(rows[bad]).__name__}, not a dict of columns")
        table = Rows(rows)
    ds = _standardise(table, name, prompt_column, answer_column, environment_prompts, cast_answers=False)
    _check_prompts(ds, name, environment_prompts)
    return ds


def split_train_eval(dataset, eval_size: int | float, seed: int):
    """(train, eval): a seeded random split holding `eval_size` rows (an int) or
    that fraction of the rows (a float in (0, 1)) out for evaluation."""
    n = len(dataset)
    if isinstance(eval_size, bool) or not isinstance(eval_size, (int, float)):
        raise ValueError(f"eval_size must be an int or a float, got {eval_size!r}")
    if isinstance(eval_size, float):
        if not 0.0 < eval_size < 1.0:
            raise ValueError(f"eval_size as a fraction must be in (0, 1), got {eval_size}")
        eval_size = max(1, round(eval_size * n))
    if not 1 <= eval_size < n:
        raise ValueError(f"eval_size must be in [1, {n - 1}] for a dataset of {n} rows, got {eval_size}")
    split = dataset.train_test_split(test_size=eval_size, seed=seed)  # shuffled (datasets' default)
    return split["train"], split["test"]


# ---------------------------------------------------------------- sampling


class PromptSampler:
    """Batches of dataset rows in a seeded order that a resumed run reproduces.

    Each epoch visits the rows in the permutation drawn from `(seed, epoch)` (or
    in order when `shuffle=False`) and drops the last incomplete batch.
    `num_epochs=None` cycles forever; otherwise `next_batch` raises StopIteration
    after the last epoch. `state_dict()` / `load_state_dict()` capture `epoch` and
    `position` (rows consumed in the current epoch).
    """

    def __init__(self, dataset, batch_size: int, *, seed: int, shuffle: bool = True, num_epochs: int | None = None):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if batch_size > len(dataset):
            raise ValueError(f"batch_size={batch_size} is larger than the dataset ({len(dataset)} rows)")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
            raise ValueError(f"num_epochs must be a positive int or None, got {num_epochs!r}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))

    def next_batch(self) -> list[dict[str, Any]]:
        if self.position + self.batch_size > len(self.dataset):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [dict(self.dataset[int(i)]) for i in indices]

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        return self.next_batch()

    def drawn_indices(self) -> set[int]:
        """The dataset indices of every row drawn so far: each finished epoch's batches, then the
        current epoch's up to ``position`` (what a run trained on, from a checkpoint's state)."""
        drawn = {int(i) for i in self._order[: self.position]}
        for epoch in range(self.epoch):
            if len(drawn) == len(self.dataset):
                break
            drawn.update(int(i) for i in self._permutation(epoch)[: self.batches_per_epoch * self.batch_size])
        return drawn

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "dataset_size": len(self.dataset),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        expected = {"seed": self.seed, "batch_size": self.batch_size, "shuffle": self.shuffle,
                    "dataset_size": len(self.dataset)}
        for key, value in expected.items():
            if key not in state:
                raise ValueError(f"sampler state has no {key!r}")
            if state[key] != value:
                raise ValueError(f"sampler state has {key}={state[key]!r} but this sampler has {key}={value!r}")
        epoch, position = state["epoch"], state["position"]
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(position, int) or not 0 <= position <= len(self.dataset):
            raise ValueError(f"sampler state has an invalid epoch={epoch!r} / position={position!r}")
        self.epoch, self.position = epoch, position
        self._order = self._permutation(epoch)
