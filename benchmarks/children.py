"""Run one benchmark side in a fresh process and measure its own peak RSS.

``os.wait4`` gives the resource usage of exactly one child (``RUSAGE_CHILDREN``
would give the max over every child ever run). But Linux starts a child's
``ru_maxrss`` at its parent's RSS at fork time, and a harness that has loaded
torch or converted a model is big. So the command runs under a bare Python
launcher (about 10 MB) that forks it, ``wait4``s it and writes its usage to a
file: the number is the command's own high-water mark. Output goes to a log
file (a pipe could fill and block the child); on failure the error shows its tail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


# argv: USAGE_JSON CMD...; exits with the command's status (128 + signal when killed).
_LAUNCHER = """
import json, os, sys
out, cmd = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    try:
        os.execvp(cmd[0], cmd)
    finally:
        os._exit(127)
_, status, usage = os.wait4(pid, 0)
with open(out, "w") as f:
    json.dump({"ru_maxrss_kib": usage.ru_maxrss, "cpu_s": usage.ru_utime + usage.ru_stime}, f)
code = os.waitstatus_to_exitcode(status)
sys.exit(code if code >= 0 else 128 - code)
"""


@dataclass(frozen=True)
class ChildRun:
    returncode: int
    peak_rss_bytes: int
    cpu_s: float  # user + system CPU seconds of the whole run (start-up included)
    wall_s: float
    log_path: Path


class ChildFailed(RuntimeError):
    """A benchmark child exited with a non-zero status."""


def child_env(threads: int | None) -> dict[str, str]:
    """The parent's environment, with the repo root importable and optional thread pinning."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[key] = str(threads)
    return env


def run_child(cmd: list[str], log_path: Path, env: dict[str, str], timeout_s: float | None = None) -> ChildRun:
    """Run ``cmd`` from the repo root; raise :class:`ChildFailed` with the log tail if it fails."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    usage_path = log_path.with_name(log_path.name + ".usage.json")
    usage_path.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        # Own session: on a timeout the whole group (launcher and command) is killed.
        proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _LAUNCHER, str(usage_path), *cmd],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise ChildFailed(f"{' '.join(cmd[:4])} ... ran past {timeout_s} s; log: {log_path}\n{_tail(log_path)}") from None
    wall = time.perf_counter() - start
    if returncode != 0:
        raise ChildFailed(f"{' '.join(cmd[:4])} ... exited with {returncode}; log: {log_path}\n{_tail(log_path)}")
    usage = json.loads(usage_path.read_text())
    # Linux reports ru_maxrss in KiB.
    return ChildRun(returncode, usage["ru_maxrss_kib"] * 1024, usage["cpu_s"], wall, log_path)


def python_module_cmd(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace")
    return text[-chars:]


def own_peak_rss_bytes() -> int:
    """This process's peak RSS since its exec (``VmHWM``; ``ru_maxrss`` also counts the parent's RSS at fork)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")
