"""Beyond one machine: ``--resume auto`` (one command line for the first start and every restart),
two torchrun agents as two nodes on one machine, a worker lost with and without torchrun's restarts.

Every multi-process test here runs real ``torchrun`` agents with gloo workers on the tiny model
(tests/torchrun_nodes.py starts them).
"""

from __future__ import annotations

import signal
import time

import pytest

import maxent_grpo
from maxent_grpo.cli import main
from maxent_grpo.training.checkpoint import find_latest_checkpoint, list_checkpoints, verify_checkpoint
from torchrun_nodes import finish, log_tails, one_node, run_args, run_metrics, run_sets, signal_node, two_nodes, workers

# ---------------------------------------------------------------- --resume auto, one process


def test_resume_auto_starts_fresh_then_continues_exactly(tiny_model_dir, tmp_path):
    """``--resume auto`` on an empty folder starts at step 0; the same command with a longer budget
    (here through ``maxent_grpo.train(resume="auto")``) continues from the latest complete checkpoint,
    and every step's metrics equal those of an uninterrupted run."""
    full, auto = tmp_path / "full", tmp_path / "auto"
    assert main(run_args(tiny_model_dir, full, 4)) == 0
    assert main([*run_args(tiny_model_dir, auto, 2), "--resume", "auto"]) == 0
    assert [r["step"] for r in run_metrics(auto)] == [1, 2]
    assert find_latest_checkpoint(auto).name == "step-2"
    summary = maxent_grpo.train(
        None, overrides=[*run_sets(tiny_model_dir), f"logging.output_dir={auto}", "training.max_steps=4",
                         "training.seed=3"], resume="auto",
    )
    assert summary.steps == 4 and summary.checkpoint.name == "step-4"
    assert "# resumed at step 2" in (auto / "config.yaml").read_text()
    expected = run_metrics(full)
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert run_metrics(auto) == expected


def test_resume_auto_refuses_another_run_without_a_checkpoint(tiny_model_dir, tmp_path, capsys):
    """A folder whose run has no complete checkpoint yet restarts from step 0 under ``--resume auto``
    only as the same run: another seed is refused in one line, before any model loads."""
    out = tmp_path / "run"
    out.mkdir()
    from maxent_grpo.config.load import load_config, to_dict
    from maxent_grpo.training.run_dir import save_config

    save_config(to_dict(load_config(None, [*run_sets(tiny_model_dir), "training.seed=3"])), out / "config.yaml")
    assert main([*run_args(tiny_model_dir, out, 2), "--seed", "4", "--resume", "auto"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "training.seed: 3 -> 4" in err[0], err
    assert not (out / "metrics.jsonl").exists()


# ---------------------------------------------------------------- torchrun agents


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def one_node_run(request, tiny_model_dir, tmp_path_factory):
    """The reference: one agent, two workers (``--standalone --nproc-per-node 2``), 3 steps."""
    root = tmp_path_factory.mktemp(f"one-node-{request.param}")
    args = run_args(tiny_model_dir, root / "run", 3, f"training.strategy={request.param}")
    assert finish([one_node(args, root / "agent.log")]) == [0], log_tails([root / "agent.log"])
    return request.param, run_metrics(root / "run")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_nodes_train_as_one_node_does(one_node_run, tiny_model_dir, tmp_path):
    """Two torchrun agents (two nodes of one worker each) train into one shared output folder: every
    step's metrics equal the one-node run's, and each checkpoint is complete in that folder."""
    strategy, expected = one_node_run
    out = tmp_path / "run"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    args = run_args(tiny_model_dir, out, 3, f"training.strategy={strategy}")
    assert finish(two_nodes(args, logs)) == [0, 0], log_tails(logs)
    assert [r["step"] for r in expected] == [1, 2, 3]
    assert run_metrics(out) == expected
    steps = list_checkpoints(out)
    assert [p.name for p in steps] == ["step-1", "step-2", "step-3"]
    assert all(verify_checkpoint(p) for p in steps)
    if strategy == "fsdp2":
        assert (steps[-1] / "optimizer" / ".metadata").is_file()  # both ranks' shards, one folder
    assert '"world_size": 2' in (out / "run_info.json").read_text()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_lost_worker_is_restarted_and_the_run_ends_as_an_uninterrupted_one(one_node_run, tiny_model_dir, tmp_path):
    """Node 0's worker, rank 0 and so the holder of the output folder's lock, dies by SIGKILL after step 2's
    backward (kill_points); under ``torchrun --max-restarts 1`` both agents restart their workers with the
    same command line, ``--resume auto`` continues from step 1's checkpoint (the dead holder's lock in the way
    of nothing), and every step's metrics equal the uninterrupted run's."""
    strategy, expected = one_node_run
    out = tmp_path / "run"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    args = [*run_args(tiny_model_dir, out, 3, f"training.strategy={strategy}"), "--resume", "auto"]
    kill = {"MAXENT_GRPO_KILL_AT": "step.after_backward@2"}
    assert finish(two_nodes(args, logs, max_restarts=1, envs=(kill, None))) == [0, 0], log_tails(logs)
    assert "process group: gloo" in logs[0].read_text()  # rank 0 logs, and it ran on node 0
    assert "exitcode: -9" in logs[0].read_text() or "exitcode  : -9" in logs[0].read_text()
    text = "\n".join(p.read_text() for p in logs)
    assert "no complete checkpoint" in text  # the first incarnation started afresh
    # The second incarnation (node 0's restarted worker is rank 0 again) continues from step 1's checkpoint.
    assert f"--resume auto (torchrun restart 1): continuing from {out / 'checkpoints' / 'step-1'}" in text
    assert run_metrics(out) == expected
    assert [p.name for p in list_checkpoints(out)] == ["step-1", "step-2", "step-3"]
    assert all(verify_checkpoint(p) for p in list_checkpoints(out))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_frozen_node_stops_the_run_in_bounded_time_naming_the_lost_rank(tiny_model_dir, tmp_path):
    """Node 1 (agent and worker) freezes after step 1 (SIGSTOP: its sockets stay open, as a node cut off the
    network leaves them); without restarts node 0's worker gives up after ``training.dist_timeout_minutes``
    plus the roll call, with one line naming the lost rank, and its agent exits non-zero: no hang."""
    out = tmp_path / "run"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    args = run_args(tiny_model_dir, out, 50, "training.dist_timeout_minutes=0.5", "checkpoint.save_steps=0")
    node0, node1 = two_nodes(args, logs)
    try:
        deadline = time.monotonic() + 600
        while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline and node0.poll() is None:
            time.sleep(0.2)
        assert (out / "metrics.jsonl").is_file(), log_tails(logs)
        (lost,) = workers(node1).values()
        signal_node(node1, signal.SIGSTOP)
        frozen = time.monotonic()
        code = finish([node0], timeout=600)[0]
        took = time.monotonic() - frozen
    finally:
        signal_node(node1, signal.SIGKILL)
        node1.wait()
    text = logs[0].read_text()
    print(f"node 0 exited {took:.1f} s after node 1 froze (timeout 30 s + roll call)")
    assert code not in (0, None), log_tails(logs)
    assert "a collective waits at most 0.5 min for the others (training.dist_timeout_minutes)" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("maxent-grpo: error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"maxent-grpo: error: lost rank {lost} of 2: "), log_tails(logs)
