"""Checkpoints: exact round trip, pruning, damage detection, and crash safety under SIGKILL."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest
import torch

from maxent_grpo.training.checkpoint import (
    find_latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    CheckpointContents,
    save_checkpoint,
    verify_checkpoint,
)


def _make(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=1, num_training_steps=10)
    return model, tokenizer, optimizer, scheduler


def _train_step(model, optimizer, scheduler):
    # The batch is drawn from the global RNG, so a wrongly restored RNG changes the update.
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def _draws():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


TRAINER_STATE = {
    "step": 2,
    "sampler": {"epoch": 0, "position": 17, "seed": 3},
    "controller": {"tau": 0.31, "beta": 0.04, "tau_log": -1.17, "tau_entropy_ema": 1.9, "step": 2},
    "accumulators": {"reward_sum": 1.5, "count": 4},
}


def test_round_trip_restores_everything_exactly(tiny_model_dir, tmp_path):
    torch.manual_seed(0)
    model, tokenizer, optimizer, scheduler = _make(tiny_model_dir)
    for _ in range(2):
        _train_step(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path, 2, CheckpointContents(
        model=model, tokenizer=tokenizer, optimizer=optimizer, lr_scheduler=scheduler, trainer_state=TRAINER_STATE,
    ), keep_last=None)
    assert path == tmp_path / "checkpoints" / "step-2"
    assert verify_checkpoint(path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pt", "trainer_state.json", "model.safetensors",
            "config.json", "tokenizer.json"} <= manifest["files"].keys()
    saved_weights = _weights(model)
    saved_optimizer = {k: v.clone() for s in optimizer.state.values() for k, v in s.items()}
    draws = _draws()
    # The reference future: one more step taken straight after the save.
    _train_step(model, optimizer, scheduler)
    continued = _weights(model)

    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    model2, _, optimizer2, scheduler2 = _make(tiny_model_dir)
    state = load_checkpoint(path, model=model2, optimizer=optimizer2, lr_scheduler=scheduler2)
    assert state == TRAINER_STATE
    _assert_same_tensors(_weights(model2), saved_weights)
    restored_optimizer = {k: v.clone() for s in optimizer2.state.values() for k, v in s.items()}
    assert len(restored_optimizer) == len(saved_optimizer) == 3  # step, exp_avg, exp_avg_sq
    assert all(torch.equal(restored_optimizer[k], saved_optimizer[k]) for k in saved_optimizer)
    assert scheduler2.last_epoch == 2 and scheduler2.get_last_lr() == pytest.approx([1e-2 * 8 / 9])
    assert _draws() == draws
    # Replay the future: same batch, same moments, same lr -> bit-identical weights.
    _train_step(model2, optimizer2, scheduler2)
    _assert_same_tensors(_weights(model2), continued)


@pytest.mark.slow
def test_peft_checkpoint_saves_and_restores_only_the_adapter(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def make():
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        params = [p for p in peft_model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        return peft_model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    model, optimizer, scheduler = make()
    _train_step(model, optimizer, scheduler)
    path = save_checkpoint(tmp_path, 1, CheckpointContents(model=model, tokenizer=None, optimizer=optimizer,
                           lr_scheduler=scheduler, trainer_state={"step": 1}), keep_last=1)
    assert (path / "adapter_model.safetensors").is_file() and not (path / "model.safetensors").exists()
    trained = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    model2, optimizer2, scheduler2 = make()
    assert not all(torch.equal(model2.state_dict()[k], v) for k, v in trained.items())
    assert load_checkpoint(path, model=model2, optimizer=optimizer2, lr_scheduler=scheduler2) == {"step": 1}
    _assert_same_tensors({k: v for k, v in model2.state_dict().items() if "lora_" in k}, trained)
    # A plain model cannot take a peft checkpoint.
    with pytest.raises(ValueError, match="PeftModel"):
        load_checkpoint(path, model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                        optimizer=None, lr_scheduler=None)


def _save(tmp_path, step, parts, keep_last=None):
    model, tokenizer, optimizer, scheduler = parts
    return save_checkpoint(tmp_path, step, CheckpointContents(model=model, tokenizer=tokenizer, optimizer=optimizer,
                           lr_scheduler=scheduler, trainer_state={"step": step}), keep_last=keep_last)


def test_keep_last_prunes_to_the_newest(tiny_model_dir, tmp_path):
    parts = _make(tiny_model_dir)
    for step in (5, 10, 15, 20, 25):
        _save(tmp_path, step, parts, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-20", "step-25"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-20", "step-25"]
    # Re-saving an existing step replaces it and keeps it.
    _save(tmp_path, 20, parts, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-20", "step-25"]
    assert all(verify_checkpoint(p) for p in list_checkpoints(tmp_path))
    with pytest.raises(ValueError, match="keep_last"):
        _save(tmp_path, 30, parts, keep_last=0)
    with pytest.raises(ValueError, match="trainer_state"):
        save_checkpoint(tmp_path, 30, CheckpointContents(model=parts[0], tokenizer=None, optimizer=parts[2],
                        lr_scheduler=None, trainer_state={"x": object()}), keep_last=None)


def test_a_failed_save_leaves_nothing_behind(tiny_model_dir, tmp_path):
    model, _, optimizer, scheduler = _make(tiny_model_dir)
    with pytest.raises(AttributeError):  # the "tokenizer" cannot be saved, half-way through
        save_checkpoint(tmp_path, 3, CheckpointContents(model=model, tokenizer=object(), optimizer=optimizer,
                        lr_scheduler=scheduler, trainer_state={"step": 3}), keep_last=None)
    assert list((tmp_path / "checkpoints").iterdir()) == []


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "no_manifest", "bad_manifest"])
def test_damaged_checkpoint_is_skipped_with_a_warning(tiny_model_dir, tmp_path, damage):
    parts = _make(tiny_model_dir)
    _save(tmp_path, 1, parts)
    latest = _save(tmp_path, 2, parts)
    target = latest / ("model.safetensors" if damage == "flip" else "optimizer.pt")
    if damage == "truncate":
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "delete":
        target.unlink()
    elif damage == "no_manifest":
        (latest / "manifest.json").unlink()
    else:
        (latest / "manifest.json").write_text('{"version": 1, "fil')
    assert not verify_checkpoint(latest)
    with pytest.warns(UserWarning, match="step-2"):
        found = find_latest_checkpoint(tmp_path)
    assert found == tmp_path / "checkpoints" / "step-1"
    with pytest.raises(ValueError, match="not a valid checkpoint"):
        load_checkpoint(latest, model=parts[0], optimizer=parts[2], lr_scheduler=parts[3])


def test_tmp_folders_are_ignored_and_stale_ones_removed(tiny_model_dir, tmp_path):
    parts = _make(tiny_model_dir)
    good = _save(tmp_path, 1, parts)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "checkpoints" / f".tmp-step-7-{dead.pid}"
    live = tmp_path / "checkpoints" / f".tmp-step-8-{os.getpid()}"
    shutil.copytree(good, stale)  # complete-looking, but never renamed into place
    shutil.copytree(good, live)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_latest_checkpoint(tmp_path) == good
    assert not stale.exists()
    assert live.exists()  # a save in progress by a live process is left alone
    assert find_latest_checkpoint(tmp_path / "nowhere") is None


KILL_SCRIPT = textwrap.dedent(
    """
    # Torch only (no transformers import) so that each restarted process starts fast.
    import sys
    import torch
    from safetensors.torch import save_file


    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1_500_000))  # optimizer.pt ~18 MB: saves take a while

        def save_pretrained(self, path):
            save_file({k: v.contiguous() for k, v in self.state_dict().items()}, f"{path}/model.safetensors")


    def make():
        model = Model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)


    if __name__ == "__main__":
        from maxent_grpo.training.checkpoint import (
            CheckpointContents, find_latest_checkpoint, load_checkpoint, save_checkpoint,
        )

        out = sys.argv[1]
        model, optimizer, scheduler = make()
        start = 0
        latest = find_latest_checkpoint(out)
        if latest is not None:
            start = load_checkpoint(latest, model=model, optimizer=optimizer, lr_scheduler=scheduler)["step"]
        for step in range(start + 1, start + 1000):
            model.weight.grad = torch.randn_like(model.weight)
            optimizer.step()
            save_checkpoint(out, step, CheckpointContents(model=model, tokenizer=None, optimizer=optimizer,
                            lr_scheduler=scheduler, trainer_state={"step": step, "blob": list(range(20000))}),
                            keep_last=2)
    """
)


def _check_after_kill(out, saver, last_step: int) -> int:
    """What a SIGKILL at any moment must leave: the latest checkpoint loads, exactly, and is newer
    than ``last_step``; the dead writer's staging folder is cleaned up. Returns its step."""
    model, optimizer, scheduler = saver.make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an atomic save never leaves a damaged step-N behind
        latest = find_latest_checkpoint(out)
    assert latest is not None
    state = load_checkpoint(latest, model=model, optimizer=optimizer, lr_scheduler=scheduler, verify=False)
    assert state["step"] == int(latest.name[5:]) > last_step
    assert len(state["blob"]) == 20000
    assert optimizer.state[model.weight]["step"].item() == state["step"]
    assert len(list_checkpoints(out)) <= 3
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    return state["step"]


def _saver(tmp_path):
    import importlib.util

    script = tmp_path / "saver.py"
    script.write_text(KILL_SCRIPT)
    spec = importlib.util.spec_from_file_location("saver", script)
    saver = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(saver)
    return script, saver


@pytest.mark.slow
def test_sigkill_inside_each_phase_of_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    """The writer kills itself at a named point of a save (kill_points): after the first file,
    between two files, and with the folder complete but not yet renamed. Each kill lands inside
    the save, whatever the machine's speed."""
    script, saver = _saver(tmp_path)
    out = tmp_path / "run"
    last_step = 0
    for point in ("save.after_first_file", "save.between_files", "save.before_rename"):
        target = last_step + 2  # the save of last_step + 1 completes first
        env = {**os.environ, "MAXENT_GRPO_KILL_AT": f"{point}@{target}"}
        proc = subprocess.Popen([sys.executable, str(script), str(out)], env=env)
        assert proc.wait(timeout=600) == -signal.SIGKILL, f"{point}: the saver was not killed there"
        # The save of `target` was under way: its staging folder carries the dead writer's pid.
        assert (out / "checkpoints" / f".tmp-step-{target}-{proc.pid}").is_dir(), point
        assert not (out / "checkpoints" / f"step-{target}").exists()
        last_step = _check_after_kill(out, saver, last_step)
        assert last_step == target - 1


@pytest.mark.slow
def test_sigkill_at_random_moments_during_saves_never_leaves_an_unloadable_checkpoint(tmp_path):
    """Extra coverage at moments nobody chose: wherever each kill lands (in a save or between
    two), the latest checkpoint loads exactly."""
    script, saver = _saver(tmp_path)
    out = tmp_path / "run"
    rng = random.Random(0)
    last_step = 0
    for _ in range(2):
        proc = subprocess.Popen([sys.executable, str(script), str(out)])
        # Wait (for an event, not a time) until this process has written something new.
        deadline = time.monotonic() + 600  # only a hung saver reaches it
        while not list_checkpoints(out) or int(list_checkpoints(out)[-1].name[5:]) <= last_step:
            assert proc.poll() is None, "saver exited early"
            assert time.monotonic() < deadline, "saver wrote no checkpoint"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.8))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        last_step = _check_after_kill(out, saver, last_step)
