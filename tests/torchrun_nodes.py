"""Torchrun agents as the nodes of one job on this machine, for the multi-process tests (tests/training/
test_nodes.py, test_ray_cluster.py): the tiny model's run arguments, starting agents (two nodes of one worker,
or one node of two), waiting for them, signalling a whole node, and the run's metrics without timings.

The workers inherit this process's environment (``PYTHONPATH`` included), so they import the code under test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from maxent_grpo.training.metrics import read_metrics

SETS = [
    "data.source=reasoning_gym:chain_sum", "data.size=64", "generation.num_generations=4",
    "generation.max_new_tokens=8", "training.prompts_per_step=2", "training.micro_batch_size=4",
    "logging.progress_bar=false", "checkpoint.save_steps=1", "generation.dtype=null",
    "training.autocast_bf16=false", "data.task_kwargs={}", "checkpoint.keep_last=3",
    "training.learning_rate=0.01", "loss.beta=0.04", "rewards=[{name: length, kwargs: {max_length: 100}}]",
]


def run_sets(model_dir, *extra) -> list[str]:
    return [f"model.name_or_path={model_dir}", *SETS, *extra]


def run_args(model_dir, out, steps, *extra) -> list[str]:
    return ["train", "--output-dir", str(out), "--max-steps", str(steps), "--seed", "3",
            *[a for s in run_sets(model_dir, *extra) for a in ("--set", s)]]


def comparable(rows):
    """Metrics without wall-clock timings."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and not k.endswith("_time")} for r in rows]


def run_metrics(out) -> list[dict]:
    return comparable(read_metrics(Path(out) / "metrics.jsonl"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_env(**extra) -> dict:
    return {**os.environ, "MAXENT_GRPO_LOG": "INFO", "OMP_NUM_THREADS": "1", **extra}


def launch(launcher: list[str], args: list[str], log: Path, env: dict) -> subprocess.Popen:
    """One torchrun agent in its own session (the test can end it and its workers together)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "maxent_grpo.cli", *args]
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[int]:
    """Every agent's exit code; agents still running at the deadline are killed with their workers."""
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for proc in procs:
        if proc.poll() is None:
            signal_node(proc, signal.SIGKILL)
            proc.wait()
    return codes


def workers(agent: subprocess.Popen) -> dict[int, int]:
    """The agent's workers (its child processes) as {pid: RANK}, read from their environment."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0") if ppid == agent.pid else []
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # gone meanwhile, or not ours
        ranks = [int(v.split(b"=")[1]) for v in environ if v.startswith(b"RANK=")]
        if ranks:
            found[int(entry.name)] = ranks[0]
    return found


def signal_node(agent: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to a whole node: the agent's session and each worker's (torchrun starts every worker in a
    session of its own)."""
    for pid in workers(agent):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass  # the worker ended meanwhile
    os.killpg(agent.pid, sig)


def two_nodes(args, logs: list[Path], *, max_restarts: int = 0, envs=(None, None)) -> list[subprocess.Popen]:
    """Two agents of one job (``--nnodes 2 --nproc-per-node 1``) meeting at a c10d rendezvous on this machine.
    Node 0 starts first and hosts the rendezvous store (node 1 joins once the port answers)."""
    port = free_port()
    launcher = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"nodes-{port}", "--max-restarts",
                str(max_restarts)]
    first = launch(launcher, args, logs[0], agent_env(**(envs[0] or {})))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    return [first, launch(launcher, args, logs[1], agent_env(**(envs[1] or {})))]


def one_node(args, log: Path, *, max_restarts: int = 0, env=None) -> subprocess.Popen:
    launcher = ["--standalone", "--nproc-per-node", "2", "--max-restarts", str(max_restarts)]
    return launch(launcher, args, log, agent_env(**(env or {})))


def log_tails(paths) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in paths)


