"""The TransferQueue plane on a Ray cluster the trainer ranks join (``rollout.transferqueue_ray_address``):
a head node and a second node started with ``ray start`` on this machine, two torchrun agents as two nodes
(tests/torchrun_nodes.py), one plane for both ranks (rank 0 starts it, rank 1 connects); the run's metrics
equal those of the same run on the local plane.

What the cluster needs here, and why:

* the nodes bind the machine's address, not loopback: ``ray start --address`` refuses to start a second node
  under the plane's loopback default (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: "Multi-node Ray clusters are
  not supported on Windows and OSX"), and a head started under it listens on loopback only, where a second
  node, which resolves ``127.0.0.1`` to the machine's address, cannot reach it (Ray 2.60);
* a token of the test's own (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``) for the nodes and the trainers:
  Ray >= 2.60 starts every cluster with token authentication, and a process joining by address must name
  the mode and hold the token (else ~/.ray/auth_token would be written and read);
* each node is a ``ray start --block`` in a session of its own, stopped by a signal to it: its processes
  share its fate. ``ray stop --force``, the usual way, stops every Ray process of this user (another test's
  private instance, a user's cluster), which is why the test starts and stops its own nodes by process id;
* its own ``--temp-dir``: the address file ``ray start`` writes (what ``ray.init()`` and ``address=auto``
  join) stays out of /tmp/ray, so no other process on the machine joins this cluster by accident.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from torchrun_nodes import finish, free_port, log_tails, one_node, run_args, run_metrics, two_nodes

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

RAY = Path(sys.executable).with_name("ray")
NODES_ALIVE = (
    "import json, ray; ray.init(address={address!r}, configure_logging=False, log_to_driver=False); "
    "print(json.dumps([n['Resources'] for n in ray.nodes() if n['Alive']]))"
)


def _node_env(token: str) -> dict:
    """The environment of the nodes (their actors inherit it) and of the trainers: the token, TransferQueue's
    thread count as the plane sets it, and Ray's own choice of address (see the module's docstring)."""
    return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "TQ_NUM_THREADS": str(min(8, psutil.cpu_count(logical=False) or 1))}


def _ray_start(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    with open(log, "w") as fh:
        return subprocess.Popen([str(RAY), "start", "--block", "--disable-usage-stats", *args], env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _alive_nodes(address: str, env: dict) -> list[dict]:
    """The resources of each alive node, read by a driver in a process of its own (this one's Ray, if an earlier
    test entered it, holds another token)."""
    out = subprocess.run([sys.executable, "-c", NODES_ALIVE.format(address=address)], env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _stop(nodes: list[subprocess.Popen]) -> None:
    """SIGTERM to each node's ``ray start --block`` (the second node first): it drains and stops its node's
    processes. Any of them still alive a minute later is killed, by its id."""
    processes = []
    for node in nodes:
        if node.poll() is None:
            processes += psutil.Process(node.pid).children(recursive=True)
    for node in reversed(nodes):
        if node.poll() is None:
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
                node.wait()
    _, alive = psutil.wait_procs(processes, timeout=60)
    for process in alive:
        process.kill()


@contextmanager
def ray_cluster(logs: Path, env: dict) -> Iterator[tuple[str, list[subprocess.Popen]]]:
    """A head node (2 CPUs, resource node_a) and a second node (2 CPUs, node_b) on this machine; yields the
    head's address. The temp dir is short: Ray's socket paths under it must fit in 107 characters."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--temp-dir", temp_dir,
              "--object-store-memory", str(128 * 2**20)]
    nodes: list[subprocess.Popen] = []
    try:
        nodes.append(_ray_start(["--head", "--port", str(port), "--include-dashboard", "false", "--resources",
                                 '{"node_a": 1}', *common], logs / "ray-head.log", env))
        deadline = time.monotonic() + 300
        while nodes[0].poll() is None and time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        nodes.append(_ray_start(["--address", address, "--resources", '{"node_b": 1}', *common],
                                logs / "ray-node.log", env))
        yield address, nodes
    finally:
        _stop(nodes)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_two_trainer_nodes_share_one_plane_on_a_two_node_ray_cluster(tiny_model_dir, tmp_path):
    if shutil.which(str(RAY)) is None:
        pytest.skip("the transferqueue extra (Ray's `ray` command) is not installed")
    steps, staleness = 3, "rollout.max_staleness=1"
    local = tmp_path / "local"
    reference = one_node(run_args(tiny_model_dir, local, steps, staleness), tmp_path / "local.log")
    assert finish([reference]) == [0], log_tails([tmp_path / "local.log"])
    env = _node_env(secrets.token_hex(32))
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    out = tmp_path / "run"
    with ray_cluster(tmp_path, env) as (address, nodes):
        deadline = time.monotonic() + 300
        while len(alive := _alive_nodes(address, env)) < 2 and time.monotonic() < deadline:
            assert all(n.poll() is None for n in nodes), log_tails([tmp_path / "ray-head.log", tmp_path / "ray-node.log"])
            time.sleep(1)
        assert sorted(next(k for k in r if k.startswith("node_")) for r in alive) == ["node_a", "node_b"]
        args = run_args(tiny_model_dir, out, steps, staleness, "rollout.data_plane=transferqueue",
                        f"rollout.transferqueue_ray_address={address}")
        extra = {k: env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
        assert finish(two_nodes(args, logs, envs=(extra, extra))) == [0, 0], log_tails(logs)
    text = logs[0].read_text()  # rank 0, on node 0, logs every rank's line
    cluster = f"rollout.data_plane: TransferQueue on the Ray cluster at {address} "
    assert f"{cluster}(rollout.transferqueue_ray_address {address}), 2 nodes, 4 CPUs; rank 0 started" in text, text
    assert "2 nodes, 4 CPUs; rank 1 connected to the controller rank 0 started" in text
    expected = run_metrics(local)
    assert [r["step"] for r in expected] == [1, 2, 3] and any(r["loss"] != 0 for r in expected)
    assert run_metrics(out) == expected
