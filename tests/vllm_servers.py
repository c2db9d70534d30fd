"""Starting vLLM's server for the tests exactly as the docs say: ``maxent-grpo serve MODEL``.

The CPU build's KV cache variable is removed from the environment, so the
command's own default for a machine without a GPU is what starts it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, log: Path, *, dtype: str = "float32", python: str = sys.executable,
                 taskset: str | None = None, vllm_args: tuple[str, ...] = (), lora_rank: int | None = None,
                 port: int | None = None):
    """``(process, url)`` of a documented ``maxent-grpo serve`` (eager) once it answers;
    ``taskset``: the cores it may run on; ``vllm_args``: more of vLLM's own flags; ``lora_rank``:
    ``--lora-rank`` (LoRA adapters loaded at run time); ``port``: a given one (a server back at its
    old address), else a free one."""
    port = free_port() if port is None else port
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    lora = [] if lora_rank is None else ["--lora-rank", str(lora_rank)]
    cmd = [python, "-m", "maxent_grpo.cli", "serve", str(model_dir), "--port", str(port), "--dtype", dtype, *lora,
           "--", "--enforce-eager", *vllm_args]
    if taskset is not None:
        cmd = ["taskset", "-c", taskset, *cmd]
    with open(log, "w") as fh:
        # Its own session: stop_server can then end the engine-core child with it.
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # a generous bound: start-up is slow on a loaded machine
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as resp:
                if json.loads(resp.read())["data"]:
                    return proc, url
        except OSError:
            time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"vLLM server did not start in 900 s:\n{log.read_text()[-3000:]}")


def stop_server(proc, grace_s: float = 30) -> None:
    """SIGTERM to the server's process group, then SIGKILL after ``grace_s``.

    A server left with requests it will never finish (a test froze it, or its
    client timed out mid-push) can wait on them through SIGTERM for minutes; and
    a server killed alone leaves its engine-core child behind, using a core.
    """
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # what is left of the group: the server or its engine core
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)
