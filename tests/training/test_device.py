"""Where a run trains: the device line at start, the warning for a GPU torch cannot use, and the
process group's timeout key."""

from __future__ import annotations

import logging

import pytest
import torch

from maxent_grpo.config.load import ConfigError, load_config
from maxent_grpo.training.distributed import Dist, log_device
from tiny_runs import compiled


def test_the_run_says_where_it_trains(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    caplog.set_level(logging.INFO, logger="maxent_grpo")
    log_device(Dist())
    assert [r.getMessage() for r in caplog.records] == [f"training on cpu (1 process, torch {torch.__version__})"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch can use the GPU here")
def test_a_gpu_that_torch_cannot_use_is_warned_about(caplog, monkeypatch, tmp_path):
    # A stand-in for the NVIDIA driver's tool (no GPU here): it lists one GPU as the real one does.
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    caplog.set_level(logging.INFO, logger="maxent_grpo")
    log_device(Dist())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("nvidia-smi lists 1 GPU(s) but torch ")
    assert "training on the CPU" in warnings[0]


def test_the_process_group_timeout_is_a_positive_key():
    assert load_config(None, ["training.dist_timeout_minutes=5"]).training.dist_timeout_minutes == 5
    with pytest.raises(ConfigError, match="^training.dist_timeout_minutes: must be > 0"):
        compiled(None, ["training.dist_timeout_minutes=0"])
    # A server's wait is spent by the other processes in a collective: it must end before the collective's limit.
    with pytest.raises(ConfigError, match=r"^generation.vllm.server_wait_s: must be under training.dist_timeout_minutes \(5 min\)"):
        compiled(None, ["training.dist_timeout_minutes=5", "generation.backend=vllm_server"])
    assert load_config(None, ["training.dist_timeout_minutes=5", "generation.backend=vllm_server",
                              "generation.vllm.server_wait_s=120"]).generation.vllm.server_wait_s == 120
    compiled(None, ["training.dist_timeout_minutes=0.5"])  # another backend waits for no server
