"""Prompt datasets: real files, reasoning-gym generation, chat formatting, the sampler."""

from __future__ import annotations

import json

import pytest

# The GPU machine's image has no datasets: `pytest -m gpu` from the root must still collect.
datasets = pytest.importorskip("datasets", reason="datasets is not installed (the GPU machine's image)")

from maxent_grpo.rewards.builtin import make_reasoning_gym
from maxent_grpo.data.datasets import (
    DEFAULT_INSTRUCTION, ColumnNames, PromptSampler, load_prompt_dataset, split_train_eval,
)
from maxent_grpo.data.prompts import FewShotExample, format_prompt
from maxent_grpo.errors import ConfigError, DataError
from maxent_grpo.config.load import load_config
from tiny_runs import compiled


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------ files


def test_jsonl_renames_columns_casts_answers_and_keeps_the_rest(tmp_path):
    rows = [{"question": f"q{i}", "solution": i * 10, "level": i % 2} for i in range(5)]
    ds = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", rows), columns=ColumnNames("question", "solution"))
    # The answer column keeps its own name too: a TRL reward reads kwargs["solution"].
    assert sorted(ds.column_names) == ["answer", "level", "prompt", "solution"]
    assert ds["solution"][:] == [i * 10 for i in range(5)]
    assert ds["prompt"][:] == [f"q{i}" for i in range(5)]
    assert ds["answer"][:] == [str(i * 10) for i in range(5)]
    assert ds["level"][:] == [0, 1, 0, 1, 0]
    assert load_prompt_dataset(str(tmp_path / "d.jsonl"), columns=ColumnNames(prompt="question"), size=2)["prompt"][:] == ["q0", "q1"]


def test_parquet_and_json_with_chat_prompts(tmp_path):
    chat = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"what is {i}+1?"}] for i in range(3)]
    datasets.Dataset.from_dict({"prompt": chat, "answer": ["1", "2", "3"]}).to_parquet(str(tmp_path / "d.parquet"))
    ds = load_prompt_dataset(str(tmp_path / "d.parquet"))
    assert ds[1]["prompt"] == chat[1] and ds[1]["answer"] == "2"
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}]))
    ds = load_prompt_dataset(str(tmp_path / "d.json"))
    assert ds.column_names == ["prompt"] and len(ds) == 2  # no answer column is fine until a reward needs it


def test_builder_name_with_data_files(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    assert load_prompt_dataset("json", data_files=path)["answer"][:] == ["1"]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: str(p / "missing.jsonl"), r"data file not found: .*missing\.jsonl"),
        (lambda p: (p / "e.jsonl").write_text("") and None or str(p / "e.jsonl"), r"data file is empty: .*e\.jsonl"),
        (lambda p: (p / "b.jsonl").write_text('{"prompt": "a", "ans\n') and str(p / "b.jsonl"), r"b\.jsonl line 1: invalid JSON"),
        (lambda p: (p / "b.parquet").write_text("garbage") and str(p / "b.parquet"), r"could not read .*b\.parquet: .*Parquet"),
        (lambda p: (p / "z.json").write_text("[]") and str(p / "z.json"), r"z\.json: the dataset is empty"),
        (lambda p: (p / "w.jsonl").write_text("\n\n") and str(p / "w.jsonl"), r"w\.jsonl"),
        (lambda p: write_jsonl(p / "c.jsonl", [{"text": "a", "answer": "1"}]),
         r"c\.jsonl: no prompt column 'prompt'; columns: \['text', 'answer'\]"),
        (lambda p: write_jsonl(p / "r.jsonl", [{"prompt": "a"}, {"prompt": "b"}, {"prompt": "  "}]),
         r"r\.jsonl: empty prompt in row 2"),
        (lambda p: write_jsonl(p / "m.jsonl", [{"prompt": [{"role": "user", "content": ""}]}]),
         r"m\.jsonl: empty prompt in row 0"),
        (lambda p: write_jsonl(p / "n.jsonl", [{"prompt": [{"role": "user"}]}, {"prompt": [{"role": "user", "content": "x"}]}]),
         r"n\.jsonl: prompt in row 0 has a message without str 'content'"),
        (lambda p: write_jsonl(p / "l.jsonl", [{"prompt": "a", "answer": [1, 2]}]), r"l\.jsonl: answer column 'answer' must hold"),
    ],
)
def test_file_errors_are_one_line_and_name_the_problem(tmp_path, setup, message):
    with pytest.raises(DataError, match=message) as info:
        load_prompt_dataset(setup(tmp_path))
    one_line_error(info)


def test_parquet_without_rows_is_empty(tmp_path):
    datasets.Dataset.from_dict({"prompt": []}, features=datasets.Features({"prompt": datasets.Value("string")})).to_parquet(
        str(tmp_path / "e.parquet"))
    with pytest.raises(DataError, match=r"e\.parquet: the dataset is empty"):
        load_prompt_dataset(str(tmp_path / "e.parquet"))


def test_size_split_and_rename_conflicts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "q": "b"}])
    assert len(load_prompt_dataset(path, size=5)) == 1  # size is an upper bound for files
    with pytest.raises(DataError, match="only the split 'train', got split='test'"):
        load_prompt_dataset(path, split="test")
    with pytest.raises(DataError, match="cannot use column 'q' as 'prompt': a column 'prompt' exists already"):
        load_prompt_dataset(path, columns=ColumnNames(prompt="q"))
    with pytest.raises(DataError, match="size must be a positive int"):
        load_prompt_dataset(path, size=0)
    with pytest.raises(DataError, match=r"d\.jsonl: no answer column 'solution'; columns: \['prompt', 'q'\]"):
        load_prompt_dataset(path, columns=ColumnNames(answer="solution"))


def test_hub_name_offline_is_a_clear_one_line_error():
    with pytest.raises(DataError, match=r"could not load dataset 'someone/not-cached-anywhere' .*offline") as info:
        load_prompt_dataset("someone/not-cached-anywhere")
    one_line_error(info)


# ------------------------------------------------------------ reasoning-gym


def test_reasoning_gym_source_generates_scorable_rows():
    ds = load_prompt_dataset("reasoning_gym:chain_sum", size=6, seed=11)
    assert ds.column_names == ["prompt", "answer", "rg_entry", "task"] and len(ds) == 6
    assert all(p.endswith("\n\n" + DEFAULT_INSTRUCTION) for p in ds["prompt"])
    assert set(ds["task"]) == {"chain_sum"}
    entries = [json.loads(e) for e in ds["rg_entry"]]
    assert [e["answer"] for e in entries] == ds["answer"][:]
    assert all(e["question"] in p for e, p in zip(entries, ds["prompt"]))
    # same seed, same problems; another seed, other problems
    assert load_prompt_dataset("reasoning_gym:chain_sum", size=6, seed=11)["rg_entry"][:] == ds["rg_entry"][:]
    assert load_prompt_dataset("reasoning_gym:chain_sum", size=6, seed=12)["rg_entry"][:] != ds["rg_entry"][:]
    # the reward scores the columns as the dataset wrote them: right -> 1, wrong -> 0
    answers = ds["answer"][:]
    completions = [rf"\boxed{{{a}}}" for a in answers] + [rf"\boxed{{{int(a) - 1}}}" for a in answers]
    scores = make_reasoning_gym()(prompts=ds["prompt"][:] * 2, completions=completions,
                                  rg_entry=ds["rg_entry"][:] * 2, task=ds["task"][:] * 2)
    assert scores == [1.0] * 6 + [0.0] * 6


def test_reasoning_gym_instruction_task_kwargs_and_errors():
    ds = load_prompt_dataset("reasoning_gym:chain_sum", size=3, seed=0, instruction=None,
                             task_kwargs={"min_terms": 5, "max_terms": 5})
    entries = [json.loads(e) for e in ds["rg_entry"]]
    assert ds["prompt"][:] == [e["question"] for e in entries]
    assert all(e["metadata"]["num_terms"] == 5 for e in entries)
    custom = load_prompt_dataset("reasoning_gym:chain_sum", size=1, instruction="Answer in <answer> tags.")
    assert custom[0]["prompt"].endswith("\n\nAnswer in <answer> tags.")
    with pytest.raises(DataError, match=r"unknown reasoning-gym task 'chain_summ'; close names: \['chain_sum'"):
        load_prompt_dataset("reasoning_gym:chain_summ", size=2)
    with pytest.raises(DataError, match="size must be a positive int for reasoning_gym:chain_sum"):
        load_prompt_dataset("reasoning_gym:chain_sum")
    with pytest.raises(DataError, match=r"reasoning_gym:chain_sum: bad task_kwargs \{'min_terms': 9, 'max_terms': 2\}"):
        load_prompt_dataset("reasoning_gym:chain_sum", size=2, task_kwargs={"min_terms": 9, "max_terms": 2})
    with pytest.raises(DataError, match="bad task_kwargs"):
        load_prompt_dataset("reasoning_gym:chain_sum", size=2, task_kwargs={"colour": 1})


# -------------------------------------------------------------- formatting


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_format_prompt_applies_the_chat_template(tokenizer):
    expected = "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert format_prompt(tokenizer, "What is 2 + 3?") == expected
    with_system = format_prompt(tokenizer, "hi", system_prompt="Be brief.")
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert format_prompt(tokenizer, messages) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="has its own system message"):
        format_prompt(tokenizer, messages, system_prompt="other")


def test_few_shot_examples_become_turns_after_the_system_message(tokenizer):
    shots = [FewShotExample("1 + 1 =", "\\boxed{2}"), FewShotExample("2 + 2 =", "\\boxed{4}")]
    turns = (
        "<|im_start|>user\n1 + 1 =<|im_end|>\n<|im_start|>assistant\n\\boxed{2}<|im_end|>\n"
        "<|im_start|>user\n2 + 2 =<|im_end|>\n<|im_start|>assistant\n\\boxed{4}<|im_end|>\n"
    )
    tail = "<|im_start|>user\n3 + 3 =<|im_end|>\n<|im_start|>assistant\n"
    assert format_prompt(tokenizer, "3 + 3 =", few_shot=shots) == turns + tail
    system = "<|im_start|>system\nS<|im_end|>\n"
    assert format_prompt(tokenizer, "3 + 3 =", system_prompt="S", few_shot=shots) == system + turns + tail
    own_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "3 + 3 ="}]
    assert format_prompt(tokenizer, own_system, few_shot=shots) == system + turns + tail


def test_few_shot_config_is_validated():
    cfg = load_config(None, {"data.few_shot": [{"prompt": "1 + 1 =", "completion": "2"}]})
    assert cfg.data.few_shot == [FewShotExample("1 + 1 =", "2")]
    with pytest.raises(ConfigError, match=r"data\.few_shot\[0\]\.completion: required key is missing"):
        compiled(None, {"data.few_shot": [{"prompt": "1 + 1 ="}]})
    with pytest.raises(ConfigError, match=r"data\.few_shot\[0\]\.answer"):
        compiled(None, {"data.few_shot": [{"prompt": "1 + 1 =", "answer": "2"}]})


def test_format_prompt_without_chat_template_names_the_model(tiny_model_dir):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tiny_model_dir)
    bare.chat_template = None
    with pytest.raises(ValueError, match=rf"tokenizer of '{tiny_model_dir}' has no chat template"):
        format_prompt(bare, "hi")


# ------------------------------------------------------------ split, sampler


def numbered(n):
    return datasets.Dataset.from_dict({"prompt": [f"p{i}" for i in range(n)], "idx": list(range(n))})


def test_split_train_eval_is_a_seeded_partition():
    ds = numbered(20)
    train, held = split_train_eval(ds, 5, seed=1)
    assert len(train) == 15 and len(held) == 5
    assert sorted(train["idx"][:] + held["idx"][:]) == list(range(20))
    assert split_train_eval(ds, 5, seed=1)[1]["idx"][:] == held["idx"][:]
    assert split_train_eval(ds, 5, seed=2)[1]["idx"][:] != held["idx"][:]
    assert len(split_train_eval(ds, 0.25, seed=1)[1]) == 5
    for bad in (0, 20, 1.5, True):
        with pytest.raises(ValueError, match="eval_size"):
            split_train_eval(ds, bad, seed=1)


def drain(sampler, k):
    return [[row["idx"] for row in sampler.next_batch()] for _ in range(k)]


def test_sampler_epochs_are_permutations_with_drop_last():
    sampler = PromptSampler(numbered(10), 3, seed=5)
    assert sampler.batches_per_epoch == 3
    epoch0, epoch1 = drain(sampler, 3), drain(sampler, 3)
    for epoch in (epoch0, epoch1):
        flat = [i for batch in epoch for i in batch]
        assert len(flat) == 9 and len(set(flat)) == 9  # one row of 10 dropped, none repeated
    assert epoch0 != epoch1
    assert sampler.epoch == 1 and sampler.position == 9
    assert drain(PromptSampler(numbered(10), 3, seed=5), 3) == epoch0
    assert drain(PromptSampler(numbered(10), 3, seed=6), 3) != epoch0
    rows = PromptSampler(numbered(4), 2, seed=0, shuffle=False).next_batch()
    assert rows == [{"prompt": "p0", "idx": 0}, {"prompt": "p1", "idx": 1}]


def test_sampler_stops_after_num_epochs():
    sampler = PromptSampler(numbered(5), 2, seed=0, num_epochs=2)
    assert len(list(sampler)) == 4
    with pytest.raises(StopIteration):
        sampler.next_batch()


def test_sampler_resume_continues_exactly():
    continuing = PromptSampler(numbered(11), 4, seed=3)
    drain(continuing, 5)  # crosses an epoch boundary (2 batches an epoch)
    state = json.loads(json.dumps(continuing.state_dict()))  # as a checkpoint stores it
    resumed = PromptSampler(numbered(11), 4, seed=3)
    resumed.load_state_dict(state)
    assert drain(resumed, 6) == drain(continuing, 6)
    assert resumed.state_dict() == continuing.state_dict()


def test_drawn_indices_are_every_row_drawn_so_far_also_from_a_restored_state():
    for batches in (0, 1, 2, 3, 5):  # 2 batches an epoch: none, within, at the end of, across epochs
        sampler = PromptSampler(numbered(11), 4, seed=3)
        drawn = {i for batch in drain(sampler, batches) for i in batch}
        assert sampler.drawn_indices() == drawn
        restored = PromptSampler(numbered(11), 4, seed=3)
        restored.load_state_dict(json.loads(json.dumps(sampler.state_dict())))
        assert restored.drawn_indices() == drawn


def test_sampler_rejects_bad_arguments_and_foreign_state():
    with pytest.raises(ValueError, match="batch_size=5 is larger than the dataset"):
        PromptSampler(numbered(4), 5, seed=0)
    with pytest.raises(ValueError, match="num_epochs"):
        PromptSampler(numbered(4), 2, seed=0, num_epochs=0)
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(numbered(4), 2, seed=-1)
    state = PromptSampler(numbered(8), 2, seed=0).state_dict()
    with pytest.raises(ValueError, match="seed=0 but this sampler has seed=1"):
        PromptSampler(numbered(8), 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="dataset_size=8 but this sampler has dataset_size=9"):
        PromptSampler(numbered(9), 2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid epoch"):
        PromptSampler(numbered(8), 2, seed=0).load_state_dict({**state, "position": 99})
