"""Starting vLLM's server for the tests exactly as the docs say: ``maxent-grpo serve MODEL``.

The CPU build's KV cache variable is removed from the environment, so the
command's own default for a machine without a GPU is what starts it.
"""

from __future__ import annotations

import json
import os
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
                 taskset: str | None = None, vllm_args: tuple[str, ...] = ()):
    """``(process, url)`` of a documented ``maxent-grpo serve`` (eager) once it answers;
    ``taskset``: the cores it may run on; ``vllm_args``: more of vLLM's own flags."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    cmd = [python, "-m", "maxent_grpo.cli", "serve", str(model_dir), "--port", str(port), "--dtype", dtype,
           "--", "--enforce-eager", *vllm_args]
    if taskset is not None:
        cmd = ["taskset", "-c", taskset, *cmd]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
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
    proc.kill()
    raise RuntimeError(f"vLLM server did not start in 900 s:\n{log.read_text()[-3000:]}")


def stop_server(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=60)
