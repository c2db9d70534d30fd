"""A generation server lost mid-batch and back at its address: the run waits, sends it the last pushed
weights, samples the lost batch again, and loses no step, synchronous and with a batch sampled ahead.

The server is a stand-in (tests/vllm_stand_in.py) so that it dies on a chosen request: the order of what
the run sends after the loss is the property under test. The same loss against vLLM's server, under two
processes and compared step for step with an uninterrupted run, is in tests/rollout/test_vllm_async.py.
"""

from __future__ import annotations

import logging

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.metrics import read_metrics
from tiny_runs import tiny_overrides
from vllm_stand_in import BACK, StandInServer


def _args(model_dir, out, url, staleness, *extra):
    return ["train", *tiny_overrides(model_dir, out, rewards="[{name: 'learnable_rewards:shortness'}]", steps=3, extra=[
        "generation.backend=vllm_server", f"generation.vllm.server_url={url}", f"rollout.max_staleness={staleness}",
        "checkpoint.save_steps=0", *extra,
    ])]


@pytest.mark.parametrize("staleness", [0, 1], ids=["synchronous", "sampled-ahead"])
def test_a_server_lost_mid_batch_and_back_loses_no_step(tiny_model_dir, tmp_path, staleness, caplog):
    # Requests 1-2 are the first batch's two prompts; the 3rd (the second batch) gets no reply.
    server = StandInServer(die_at_completion=3, back_after_s=3)
    out = tmp_path / "run"
    try:
        with caplog.at_level(logging.WARNING, logger="maxent_grpo"):
            assert main(_args(tiny_model_dir, out, server.url, staleness, "generation.vllm.server_wait_s=120")) == 0
    finally:
        server.stop()
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # No batch skipped (the stand-in's completions are all alike: no learning signal, which is not a skip).
    assert not any(k.startswith("skipped/") and k != "skipped/no_signal" and v for r in rows for k, v in r.items())
    text = caplog.text
    assert f"generation server {server.url} stopped answering" in text and "answered again after" in text
    assert "sampling the batch again once the weights are back" in text and "loaded again (weights-" in text
    # Back, the server gets the weights it last had before any batch is sampled from it again.
    after = [(m, p) for m, p, _ in server.requests[server.requests.index(BACK) + 1:] if m == "POST"]
    assert after[:3] == [("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache"), ("POST", "/v1/completions")]
    pushes = [b["kwargs"]["weights_path"] for b in server.posted("/collective_rpc")]
    # The start's push, the restore (the same folder again), then one push per step that leaves one to sample.
    assert pushes[1] == pushes[0] if staleness else pushes[2] == pushes[1], pushes


def test_a_server_not_back_in_time_stops_the_run_with_one_line(tiny_model_dir, tmp_path, capsys):
    server = StandInServer(die_at_completion=3)  # never back
    out = tmp_path / "run"
    try:
        code = main(_args(tiny_model_dir, out, server.url, 0, "generation.vllm.server_wait_s=3"))
    finally:
        server.stop()
    assert code == 1
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("maxent-grpo:")]
    assert len(ours) == 1 and "Traceback" not in err, err
    assert "the sampler failed after step 1" in ours[0], ours[0]
    assert "did not answer again within 3 s (generation.vllm.server_wait_s)" in ours[0], ours[0]
    assert "checkpoint" in ours[0] and (out / "checkpoints" / "step-1").is_dir(), ours[0]
    assert len(read_metrics(out / "metrics.jsonl")) == 1
