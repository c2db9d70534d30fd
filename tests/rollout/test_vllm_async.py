"""rollout.max_staleness with vLLM's server (``.venv-vllm``): the server samples the next batch while
the trainer trains, runs stay deterministic (each batch's requests carry its own seeds), a resumed
run restores the batch in flight, a server that dies mid-run and does not come back stops the run with a
checkpoint, and one replaced mid-run loses no step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test.sh runs these tests in .venv-vllm")

from maxent_grpo.cli import main  # noqa: E402
from maxent_grpo.training.checkpoint import find_latest_checkpoint  # noqa: E402
from maxent_grpo.training.metrics import read_metrics  # noqa: E402
from tiny_runs import tiny_overrides  # noqa: E402
from vllm_servers import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def server(vllm_model_dir, tmp_path_factory):
    proc, url = start_server(vllm_model_dir, tmp_path_factory.mktemp("server") / "server.log")
    yield url
    stop_server(proc)


def _args(model_dir, out, url, steps, *, reward="{name: 'learnable_rewards:shortness'}", extra=()):
    return ["train", *tiny_overrides(model_dir, out, rewards=f"[{reward}]", steps=steps, extra=[
        "generation.backend=vllm_server", f"generation.vllm.server_url={url}", "generation.max_new_tokens=12",
        "training.learning_rate=0.01", "rollout.max_staleness=1", "checkpoint.save_steps=1", *extra,
    ])]


def _comparable(out):
    rows = read_metrics(out / "metrics.jsonl")
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_time")} for r in rows]


def _assert_same_run(got, expected):
    """The same completions and rewards; log-prob figures to float rounding (the server batches
    concurrent requests as they arrive, which moves its fp32 log-probs in the last bits)."""
    assert [sorted(r) for r in got] == [sorted(r) for r in expected]
    for g, e in zip(got, expected):
        for key, value in e.items():
            if value is None or key == "step" or key.startswith(("reward", "completions/", "async/", "num_tokens", "frac_")):
                assert g[key] == value, (e["step"], key)
            else:
                assert g[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (e["step"], key)


def test_the_server_samples_ahead_and_runs_are_deterministic(server, vllm_model_dir, tmp_path):
    first, again, resumed = tmp_path / "first", tmp_path / "again", tmp_path / "resumed"
    assert main(_args(vllm_model_dir, first, server, 4)) == 0
    rows = read_metrics(first / "metrics.jsonl")
    assert [r["async/version"] for r in rows] == [0, 0, 1, 2]
    assert [r["async/staleness_max"] for r in rows] == [0, 1, 1, 1]
    # From step 1 on the trainer waited on a batch the server sampled while it trained.
    assert all("time/wait_rollouts" in r for r in rows) and all("time/sampler_idle" in r for r in rows[1:])
    assert all(r["sampling/importance_sampling_ratio/mean"] > 0 for r in rows)
    assert main(_args(vllm_model_dir, again, server, 4)) == 0
    _assert_same_run(_comparable(again), _comparable(first))
    assert main(_args(vllm_model_dir, resumed, server, 2)) == 0
    assert main([*_args(vllm_model_dir, resumed, server, 4), "--resume"]) == 0
    _assert_same_run(_comparable(resumed), _comparable(first))


def test_a_server_killed_mid_run_and_not_back_stops_it_with_a_checkpoint(vllm_model_dir, tmp_path, capsys):
    proc, url = start_server(vllm_model_dir, tmp_path / "server.log")
    try:
        # The 3rd batch's rewards kill the server; the push of step 2's weights then finds it gone, waits
        # generation.vllm.server_wait_s for it, and stops.
        reward = f"{{name: 'learnable_rewards:kills_process_at', kwargs: {{pid: {proc.pid}, call: 3}}}}"
        out = tmp_path / "run"
        code = main(_args(vllm_model_dir, out, url, 6, reward=reward, extra=[
            "generation.vllm.request_timeout_s=120", "checkpoint.save_steps=0", "generation.vllm.server_wait_s=4",
        ]))
    finally:
        stop_server(proc)
    assert code == 1
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("maxent-grpo:")]
    assert len(ours) == 1 and "the sampler failed after step 2" in ours[0] and "Traceback" not in err, err
    assert "did not answer again within 4 s (generation.vllm.server_wait_s)" in ours[0], ours[0]
    latest = find_latest_checkpoint(out)
    assert latest is not None and latest.name == "step-2" and str(latest) in ours[0]
    state = json.loads((latest / "trainer_state.json").read_text())
    # Batch 2 was sampled (by version 1) before the server died: the checkpoint keeps it.
    assert [(r["step"], r["version"]) for r in state["rollouts_in_flight"][0]] == [(2, 1)]
    assert len(read_metrics(out / "metrics.jsonl")) == 2


def test_a_hung_server_is_reported_not_waited_on(vllm_model_dir, tmp_path):
    """The server is frozen (SIGSTOP) once step 2 is logged: whether the trainer is then waiting
    for the batch in flight (rollout.wait_timeout_s) or pushing weights (request_timeout_s), the run
    ends in one line with a checkpoint instead of hanging."""
    import os
    import signal
    import subprocess
    import sys
    import time

    proc, url = start_server(vllm_model_dir, tmp_path / "server.log")
    out = tmp_path / "run"
    args = _args(vllm_model_dir, out, url, 40, extra=[
        "generation.vllm.request_timeout_s=60", "rollout.wait_timeout_s=60", "checkpoint.save_steps=0",
    ])
    tests = str(Path(__file__).resolve().parents[1])  # learnable_rewards, imported by name
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    run = subprocess.Popen([sys.executable, "-m", "maxent_grpo.cli", *args], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env=env)
    try:
        metrics = out / "metrics.jsonl"
        while run.poll() is None and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGSTOP)
        _, err = run.communicate(timeout=300)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        stop_server(proc)
    assert run.returncode == 1, err
    ours = [line for line in err.splitlines() if line.startswith("maxent-grpo:")]
    assert len(ours) == 1 and "the sampler failed after step" in ours[0] and "Traceback" not in err, err
    assert any(s in ours[0] for s in ("rollout.wait_timeout_s", "request_timeout_s")), ours[0]
    latest = find_latest_checkpoint(out)
    assert latest is not None and str(latest) in ours[0]
    assert len(read_metrics(out / "metrics.jsonl")) == int(latest.name.split("-")[1])


@pytest.mark.multiprocess
def test_two_processes_stop_together_when_the_server_dies(vllm_model_dir, tmp_path):
    """Two gloo processes (torchrun), ``server_wait_s: 0``: only the main one pushes weights, so only it sees the push
    fail; the other learns it in the push's own collective. Both stop after step 2 with one checkpoint
    and its metrics line in about a minute. Before, the other process sat in a barrier until
    ``training.dist_timeout_minutes`` (30 here: the run hit the subprocess timeout instead). And a
    server killed by one rank's reward while it wrote the other rank's reply left that rank an
    http.client error, not the client's own, which ended it with a traceback while the first waited
    in an all-reduce (issue 33; test_vllm_server_client.py cuts replies off deterministically)."""
    import os
    import signal
    import subprocess
    import sys

    proc, url = start_server(vllm_model_dir, tmp_path / "server.log")
    out = tmp_path / "run"
    reward = f"{{name: 'learnable_rewards:kills_process_at', kwargs: {{pid: {proc.pid}, call: 3}}}}"
    tests = str(Path(__file__).resolve().parents[1])  # learnable_rewards, imported by name
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    args = _args(vllm_model_dir, out, url, 6, reward=reward, extra=[
        "generation.vllm.request_timeout_s=120", "checkpoint.save_steps=0", "training.dist_timeout_minutes=30",
        "generation.vllm.server_wait_s=0",  # not waited for: the run stops at once
    ])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "maxent_grpo.cli", *args]
    try:
        # Its own session: on a timeout the workers go too, not only torchrun.
        with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as run:
            try:
                _, err = run.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(run.pid, signal.SIGKILL)
                raise
    finally:
        stop_server(proc)
    assert run.returncode != 0
    ours = [line for line in err.splitlines() if line.startswith("maxent-grpo:")]
    assert ours and all("the sampler failed after step 2" in line for line in ours), err[-3000:]
    latest = find_latest_checkpoint(out)
    assert latest is not None and latest.name == "step-2" and all(str(latest) in line for line in ours), ours
    assert len(read_metrics(out / "metrics.jsonl")) == 2


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_server_replaced_mid_run_under_two_processes_loses_no_step(vllm_model_dir, tmp_path):
    """Two gloo processes (torchrun) sample from a server that is killed once step 2 is logged, and a
    replacement starts at the same address. The run waits for it (generation.vllm.server_wait_s), says
    so, sends it the last pushed weights, samples a lost batch again, and ends: every step's metrics are
    the uninterrupted run's.

    Where the loss lands (a push, or a batch being sampled on one process or both) depends on timing; each
    way must end as the uninterrupted run does (test_vllm_server_client.py holds each way deterministically)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from urllib.parse import urlparse

    tests = str(Path(__file__).resolve().parents[1])  # learnable_rewards, imported by name
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}

    def torchrun(out, url, *, replace_after_lines=None, server_proc=None):
        args = _args(vllm_model_dir, out, url, 6, extra=[
            "generation.vllm.request_timeout_s=120", "generation.vllm.server_wait_s=1200"])
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "maxent_grpo.cli", *args]
        replacement = None
        with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as run:
            try:
                if replace_after_lines is not None:
                    metrics = out / "metrics.jsonl"
                    while run.poll() is None and (
                            not metrics.exists() or len(metrics.read_text().splitlines()) < replace_after_lines):
                        time.sleep(0.2)
                    stop_server(server_proc, grace_s=0)
                    replacement, _ = start_server(vllm_model_dir, tmp_path / "server-replacement.log",
                                                  port=urlparse(url).port)
                _, err = run.communicate(timeout=1500)
            except subprocess.TimeoutExpired:
                os.killpg(run.pid, signal.SIGKILL)
                raise
            finally:
                if replacement is not None:
                    stop_server(replacement)
        return run.returncode, err

    full, replaced = tmp_path / "full", tmp_path / "replaced"
    proc, url = start_server(vllm_model_dir, tmp_path / "server.log")
    try:
        code, err = torchrun(full, url)
        assert code == 0, err[-3000:]
    finally:
        stop_server(proc)
    proc, url = start_server(vllm_model_dir, tmp_path / "server-lost.log")
    code, err = torchrun(replaced, url, replace_after_lines=2, server_proc=proc)
    assert code == 0, err[-3000:]
    assert f"generation server {url} stopped answering" in err and f"generation server {url} answered again" in err, \
        err[-3000:]
    assert [r["step"] for r in _comparable(replaced)] == [1, 2, 3, 4, 5, 6]
    _assert_same_run(_comparable(replaced), _comparable(full))
