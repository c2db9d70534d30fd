"""On-policy distillation in a run (training/teacher.py): a student that differs from its teacher
(the same tiny model with its final norm scaled by 4, so its token distributions are sharper)
trained on the teacher's reverse KL alone; its logged per-token KL to the teacher falls over 10
steps. A teacher with another vocabulary and bad settings are refused in one line naming the key."""

from __future__ import annotations

import shutil

import pytest
import torch

from maxent_grpo.cli import main
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

REWARDS = "[{name: boxed_accuracy}]"


@pytest.fixture(scope="module")
def sharper_student(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("student")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    model.save_pretrained(out)
    return out


def test_the_students_kl_to_the_teacher_falls(sharper_student, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    extra = ["method=grpo", f"teacher.name_or_path={tiny_model_dir}", "teacher.rewards=false",
             "training.learning_rate=0.002", "training.micro_batch_size=16", "checkpoint.save_final=false"]
    args = tiny_overrides(sharper_student, out, rewards=REWARDS, steps=10, num_generations=8, max_new_tokens=16,
                          extra=extra)
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    kl = [r["distill/kl"] for r in rows]
    assert len(kl) == 10 and all("time/teacher" in r for r in rows)
    # Measured on this CPU: 0.36 at step 1, 0.075-0.094 over steps 8-10.
    assert sum(kl[-3:]) / 3 < 0.5 * kl[0]
    assert sum(kl[-3:]) / 3 < sum(kl[:3]) / 3


def test_a_teacher_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path, capsys):
    from maxent_grpo.tiny import build_tiny_tokenizer

    other = tmp_path / "other-teacher"
    shutil.copytree(tiny_model_dir, other)
    build_tiny_tokenizer(vocab_size=300).save_pretrained(other)
    extra = ["method=grpo", f"teacher.name_or_path={other}"]
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path / "run", rewards=REWARDS, extra=extra)]) != 0
    err = capsys.readouterr().err
    assert "teacher.name_or_path" in err and "another tokenizer" in err


@pytest.mark.parametrize("setting,match", [
    (["teacher.coef=0"], "teacher.coef"),
    (["teacher.kl_estimator=k9"], "teacher.kl_estimator"),
    (["method=maxent_listwise", "teacher.rewards=false"], "teacher.rewards"),
])
def test_bad_settings_name_the_key(setting, match, tiny_model_dir, tmp_path, capsys):
    extra = ["method=grpo", f"teacher.name_or_path={tiny_model_dir}", *setting]
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path / "run", rewards=REWARDS, extra=extra)]) != 0
    assert match in capsys.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_distillation_runs_under_fsdp2(sharper_student, tiny_model_dir, tmp_path):
    """Two FSDP2 processes: the teacher is loaded and sharded like the reference and scored in lockstep."""
    import os
    import subprocess
    import sys

    out = tmp_path / "run"
    args = tiny_overrides(sharper_student, out, rewards=REWARDS, steps=2, extra=[
        "method=grpo", "training.strategy=fsdp2", f"teacher.name_or_path={tiny_model_dir}", "loss.beta=0.04"])
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "-m", "maxent_grpo.cli", "train", *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["distill/kl"] > 0 and "kl" in r for r in rows)

