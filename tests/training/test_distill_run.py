"""On-policy distillation in a run (training/teacher.py): a student that differs from its teacher
(the same tiny model with its final norm scaled by 4, so its token distributions are sharper)
trained on the teacher's reverse KL alone; its logged per-token KL to the teacher falls over 10
steps. A teacher with its own chat template scores the completions after its own rendering of the
prompt; distillation runs under FSDP2; a teacher with another vocabulary and bad settings are refused
in one line naming the key."""

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
    from benchmarks.tiny_model import build_tiny_tokenizer

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
    (["teacher.chat_template=teacher", "environment.name=calculator"], "teacher.chat_template"),
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



def test_teacher_prompt_rows_replace_each_groups_prompt_and_keep_the_completions():
    from maxent_grpo.training.teacher import teacher_prompt_rows

    # 2 prompts x 2 completions, student prompts of length 3 (left-padded with 0), completions of 2.
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [4, 4, 4, 7, 7], [4, 4, 4, 1, 2]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    new_ids, new_mask, plen = teacher_prompt_rows(ids, mask, 3, [[11, 12, 13, 14], [15]], 2, 0)
    assert plen == 4
    assert new_ids.tolist() == [[11, 12, 13, 14, 7, 8], [11, 12, 13, 14, 9, 0], [0, 0, 0, 15, 7, 7],
                                [0, 0, 0, 15, 1, 2]]
    assert new_mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1]]
    with pytest.raises(ValueError, match="prompts"):
        teacher_prompt_rows(ids, mask, 3, [[1]], 2, 0)


@pytest.fixture(scope="module")
def teacher_with_own_template(tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from benchmarks.tiny_model import CHATML_TEMPLATE

    out = tmp_path_factory.mktemp("templated-teacher")
    shutil.copytree(tiny_model_dir, out, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = "<|im_start|>system\nYou are a teacher.<|im_end|>\n" + CHATML_TEMPLATE
    tok.save_pretrained(out)
    return out


def test_a_teacher_with_its_own_template_scores_the_completions_after_its_prompt(
        teacher_with_own_template, tiny_model_dir):
    """Each row: the teacher's rendering of the prompt, then the student's completion tokens, scored by a
    plain forward of the teacher (no padding) and a log_softmax."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from maxent_grpo.core.logprobs import Scoring
    from maxent_grpo.data.prompts import format_prompt
    from maxent_grpo.training.distributed import Dist
    from maxent_grpo.training.strategy import DDPStrategy
    from maxent_grpo.training.teacher import TeacherPlan, teacher_scorer

    student = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = [{"prompt": "What is 2 + 3?"}, {"prompt": [{"role": "user", "content": "What is 10 + 1?"}]}]
    completions = [[40, 41, 42], [43, 44, 0], [45, 0, 0], [46, 47, 48]]  # right-padded with 0
    lengths = [3, 2, 1, 3]
    prompts = [student(format_prompt(student, r["prompt"]), add_special_tokens=False)["input_ids"] for r in rows]
    lp = max(map(len, prompts))
    ids = torch.zeros(4, lp + 3, dtype=torch.long)
    mask = torch.zeros(4, lp + 3, dtype=torch.long)
    for i in range(4):
        p = prompts[i // 2]
        ids[i, lp - len(p):lp] = torch.tensor(p)
        mask[i, lp - len(p):lp] = 1
        ids[i, lp:] = torch.tensor(completions[i])
        mask[i, lp:lp + lengths[i]] = 1
    plan = TeacherPlan(str(teacher_with_own_template), "float64", own_template=True, system_prompt=None, few_shot=())
    score = teacher_scorer(plan, str(teacher_with_own_template), Scoring(share_prompts=False), DDPStrategy(Dist()))
    got = score(rows, ids, mask, lp)

    teacher_tok = AutoTokenizer.from_pretrained(teacher_with_own_template)
    model = AutoModelForCausalLM.from_pretrained(teacher_with_own_template, torch_dtype=torch.float64)
    for i in range(4):
        text = format_prompt(teacher_tok, rows[i // 2]["prompt"])
        assert text.startswith("<|im_start|>system\nYou are a teacher.")
        p = teacher_tok(text, add_special_tokens=False)["input_ids"]
        seq = torch.tensor([p + completions[i][:lengths[i]]])
        with torch.no_grad():
            logsm = torch.log_softmax(model(seq).logits[0, len(p) - 1:-1], -1)
        want = logsm.gather(-1, seq[0, len(p):, None]).squeeze(-1)
        assert torch.allclose(got[i, :lengths[i]], want, rtol=0, atol=1e-10)
    # The student's own template scores other prompts: other values.
    plain = teacher_scorer(TeacherPlan(str(teacher_with_own_template), "float64", own_template=False,
                                       system_prompt=None, few_shot=()),
                           str(teacher_with_own_template), Scoring(share_prompts=False), DDPStrategy(Dist()))
    assert not torch.allclose(plain(rows, ids, mask, lp)[0, :3], got[0, :3])


def test_a_run_with_the_teachers_own_template(teacher_with_own_template, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    extra = ["method=grpo", f"teacher.name_or_path={teacher_with_own_template}", "teacher.chat_template=teacher"]
    assert main(["train", *tiny_overrides(tiny_model_dir, out, rewards=REWARDS, extra=extra)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["distill/kl"] != 0 for r in rows)


def test_distillation_with_stale_rollouts(sharper_student, tiny_model_dir, tmp_path):
    """rollout.max_staleness 1: the batch trained at step 2 was sampled before step 1's update; the
    teacher scores it when it is trained, and the term gets the sampler -> trainer correction."""
    out = tmp_path / "run"
    extra = ["method=grpo", f"teacher.name_or_path={tiny_model_dir}", "rollout.max_staleness=1"]
    assert main(["train", *tiny_overrides(sharper_student, out, rewards=REWARDS, steps=3, extra=extra)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["distill/kl"] > 0 for r in rows)
