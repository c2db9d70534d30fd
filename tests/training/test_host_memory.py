"""Freed host memory handed back between the policy's passes (training/host_memory.py)."""

import copy
import importlib.util
import platform
from pathlib import Path

import pytest
import torch

from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.core.step import StepHooks, grpo_step
from maxent_grpo.training.host_memory import host_memory_release

_spec = importlib.util.spec_from_file_location("ddp_step_worker", Path(__file__).resolve().parents[1] / "ddp_step_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_nothing_to_release_on_a_gpu():
    assert host_memory_release("cuda") is None


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_release_returns_free_heap_pages_to_the_os():
    release = host_memory_release("cpu")
    assert release is not None
    # 160 MiB in 32 KiB blocks (below glibc's mmap threshold: they come from the heap), then all but
    # the last freed: the last block pins the heap's top, so free() alone returns nothing.
    blocks = [bytearray(32 * 1024) for _ in range(5120)]
    for b in blocks:
        b[::4096] = b"\x01" * len(b[::4096])  # touch every page
    keep = blocks[-1]
    del blocks
    before = _rss_bytes()
    release()
    after = _rss_bytes()
    assert before - after > 100 * 2**20, (before, after)
    assert keep[0] == 1


def test_release_runs_before_each_forward_and_backward_and_changes_nothing(tiny_model_dir):
    base = worker.load_model(str(tiny_model_dir))
    rows = worker.build_rows(base)
    bounds = [(0, 2), (2, 4), (4, 6), (6, 8)]
    results = []
    release = host_memory_release("cpu")
    for hook in (None, "release"):
        model = copy.deepcopy(base)
        calls = []

        def counted_release():
            calls.append(1)
            if release is not None:  # the trainer's own call where the C library has one (glibc)
                release()

        before = [p.detach().clone() for p in model.parameters()]
        result = grpo_step(
            model, torch.optim.SGD(model.parameters(), lr=1.0), worker.micro_batches(rows, bounds),
            worker.spec(loss_type="dapo", beta=0.0), Scoring(share_prompts=True),
            hooks=StepHooks(release=None if hook is None else counted_release),
        )
        if hook is not None:
            assert len(calls) == 2 * len(bounds)  # before each micro-batch's forward and its backward
        results.append((result.loss, [b - p.detach() for b, p in zip(before, model.parameters())]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == loss_b
    assert all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def test_the_setting_turns_the_release_on_in_a_run(tiny_model_dir, tmp_path, monkeypatch):
    """training.release_host_memory (off by default) gives the run the release, called between passes."""
    import maxent_grpo.training.setup as setup
    from maxent_grpo.cli import main
    from tiny_runs import tiny_overrides

    real, calls = setup.host_memory_release, []

    def counting(device_type):
        release = real(device_type)

        def counted():
            calls.append(1)
            if release is not None:
                release()
        return counted

    monkeypatch.setattr(setup, "host_memory_release", counting)
    for flag in ("false", "true"):
        calls.clear()
        args = tiny_overrides(tiny_model_dir, tmp_path / flag, rewards="[{name: length, kwargs: {max_length: 100}}]",
                              steps=1, extra=[f"training.release_host_memory={flag}"])
        assert main(["train", *args]) == 0
        assert (len(calls) > 0) is (flag == "true")
