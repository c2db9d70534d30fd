"""loss.sync_ref_model in a run (TR-DPO; core/reference_sync.py): in float64, after each due step
the reference saved with the checkpoint is alpha * policy + (1 - alpha) * the reference before,
and unchanged between; a run resumed from a checkpoint after a sync goes on exactly; settings that
cannot work are refused naming the key."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from maxent_grpo.cli import main
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides

REWARDS = "[{name: boxed_accuracy}, {name: length, kwargs: {max_length: 100}}]"
ALPHA = 0.25
SETTINGS = ["method=grpo", "model.dtype=float64", "loss.beta=0.04", "loss.sync_ref_model=true",
            f"loss.ref_model_mixup_alpha={ALPHA}", "loss.ref_model_sync_steps=2", "training.learning_rate=1e-3",
            "checkpoint.save_steps=1", "checkpoint.keep_last=null"]


def _weights(path):
    return {k: v.to(torch.float64) for k, v in load_file(path).items()}


def test_the_reference_follows_the_policy_and_resumes_exactly(tiny_model_dir, tmp_path):
    full = tmp_path / "full"
    assert main(["train", *tiny_overrides(tiny_model_dir, full, rewards=REWARDS, steps=4, extra=SETTINGS)]) == 0
    rows = read_metrics(full / "metrics.jsonl")
    assert [r["reference/synced"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    ckpt = full / "checkpoints"
    reference = _weights(tiny_model_dir / "model.safetensors")  # the start weights, float32 -> float64 exactly
    assert set(load_file(ckpt / "step-1" / "reference.safetensors")) == set(reference)
    for step in (1, 2, 3, 4):
        saved = load_file(ckpt / f"step-{step}" / "reference.safetensors")
        assert all(v.dtype == torch.float64 for v in saved.values())
        if step % 2 == 0:
            policy = _weights(ckpt / f"step-{step}" / "model.safetensors")
            expected = {k: ALPHA * policy[k] + (1 - ALPHA) * reference[k] for k in reference}
            for k in reference:
                assert torch.allclose(saved[k], expected[k], rtol=0, atol=1e-15), k
            moved = max(float((saved[k] - reference[k]).abs().max()) for k in reference)
            assert moved > 1e-6  # the policy had moved: the update is seen
            reference = saved
        else:
            assert all(torch.equal(saved[k], reference[k]) for k in reference)
    # Resumed from step 2 (just after a sync), the run goes on as the uninterrupted one.
    part = tmp_path / "part"
    assert main(["train", *tiny_overrides(tiny_model_dir, part, rewards=REWARDS, steps=2, extra=SETTINGS)]) == 0
    assert main(["train", *tiny_overrides(tiny_model_dir, part, rewards=REWARDS, steps=4, extra=SETTINGS),
                 "--resume"]) == 0
    resumed = read_metrics(part / "metrics.jsonl")
    assert [r["kl"] for r in resumed] == [r["kl"] for r in rows]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in rows]
    final = load_file(part / "checkpoints" / "step-4" / "reference.safetensors")
    assert all(torch.equal(final[k], reference[k]) for k in reference)


@pytest.mark.parametrize("setting,match", [
    (["loss.beta=0.0"], "loss.sync_ref_model: needs a reference model"),
    (["model.lora.enabled=true"], "loss.sync_ref_model: is not supported with model.lora.enabled"),
    (["loss.ref_model_mixup_alpha=0"], "loss.ref_model_mixup_alpha"),
    (["loss.ref_model_sync_steps=0"], "loss.ref_model_sync_steps"),
])
def test_bad_settings_name_the_key(setting, match, tiny_model_dir, tmp_path, capsys):
    extra = ["method=grpo", "loss.beta=0.04", "loss.sync_ref_model=true", *setting]
    assert main(["train", *tiny_overrides(tiny_model_dir, tmp_path / "run", rewards=REWARDS, extra=extra)]) != 0
    assert match in capsys.readouterr().err


def test_sync_ref_model_is_refused_under_fsdp2():
    from maxent_grpo.errors import ConfigError
    from tiny_runs import compiled

    with pytest.raises(ConfigError, match=r"^loss.sync_ref_model: .*training.strategy=fsdp2"):
        compiled(None, ["training.strategy=fsdp2", "loss.beta=0.04", "loss.sync_ref_model=true"])
