"""Verified replay across a kill (issue 35): a run killed mid-step while its mode bank holds verified
exemplars, then resumed, replays the same modes at every step as the unbroken run and ends with the
same bank.

The tiny random model never solves a ModeBench task, so the test first teaches it pair_sum's answer
form: a short supervised fit on ``\\boxed{a + b}`` answers (a + b = n) to the task's own prompts.
The taught model is right on part of its samples, so the bank fills from its own verified samples,
as in a real run."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.checkpoint import find_latest_checkpoint
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

SOURCE = "modebench:pair_sum"
TEACH_STEPS = 150


@pytest.fixture(scope="module")
def taught_model(tiny_model_dir, tmp_path_factory):
    """The tiny model after a short fit on correct pair_sum answers (loss on the answer tokens only)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from maxent_grpo.data.prompts import format_prompt
    from maxent_grpo.tasks.modebench import modebench_rows

    torch.manual_seed(0)
    rng = random.Random(0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    prompts = [(tok(format_prompt(tok, r["prompt"]), add_special_tokens=False)["input_ids"],
                json.loads(r["mb_problem"])["target"]) for r in modebench_rows("pair_sum", size=12, seed=0)]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(TEACH_STEPS):
        ids, labels = [], []
        for prompt, n in rng.sample(prompts, 4):
            a = rng.randint(1, n - 1)
            answer = tok(f"\\boxed{{{a} + {n - a}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in ids])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
        target = torch.tensor([y + [-100] * (width - len(y)) for y in labels])
        loss = model(input_ids=input_ids, attention_mask=mask, labels=target).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out = tmp_path_factory.mktemp("taught-pair-sum")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _args(model_dir, out, steps):
    return ["train", *tiny_overrides(model_dir, out, rewards="[{name: modebench}]", steps=steps, source=SOURCE,
                                     max_new_tokens=12, extra=["method=redr", "checkpoint.save_steps=1",
                                                               "data.size=12", "training.seed=3"])]


REPLAY_KEYS = ("replay/groups", "replay/modes", "replay/loss", "replay/score_mean", "replay/score_min",
               "bank/prompts", "bank/modes", "bank/exemplars", "bank/exemplar_tokens", "bank/new_modes")


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_time")
             and k not in ("replay/time_s", "replay/time_share")} for r in rows]


@pytest.mark.slow
def test_a_kill_with_a_full_bank_then_resume_replays_the_same_modes(taught_model, tmp_path):
    full = tmp_path / "full"
    assert main(_args(taught_model, full, 4)) == 0
    expected = read_metrics(full / "metrics.jsonl")
    # The bank holds verified exemplars before the step the kill lands in, and later steps replay them.
    assert expected[1]["bank/exemplars"] >= 1, [r.get("bank/exemplars") for r in expected]
    assert all(r.get("replay/groups") == 1.0 and r["replay/modes"] >= 1 for r in expected[2:])

    out = tmp_path / "killed"
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "MAXENT_GRPO_KILL_AT": "step.after_backward@3"}
    proc = subprocess.run([sys.executable, "-m", "maxent_grpo.cli", *_args(taught_model, out, 4)], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert find_latest_checkpoint(out).name == "step-2"  # step 3 replayed, then died before its update
    assert main([*_args(taught_model, out, 4), "--resume"]) == 0

    got = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for key in REPLAY_KEYS:
        assert [r.get(key) for r in got] == [r.get(key) for r in expected], key
    assert _comparable(got) == _comparable(expected)
    banks = [json.loads((run / "checkpoints" / "step-4" / "trainer_state.json").read_text())["replay"]["bank"]
             for run in (full, out)]
    assert banks[0] == banks[1]
