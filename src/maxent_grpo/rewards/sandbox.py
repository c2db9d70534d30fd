"""Run untrusted Python (model-written code) in a separate, limited process.

`run_sandboxed(code, ...)` runs `code` as a program and returns a `SandboxResult`.
The layers, each where the machine allows (`detect_isolation()` says which hold;
docs/CODE_REWARDS.md has what each protects against and what was measured):

* always: own session killed at the wall-clock timeout; RLIMIT_CPU, AS, FSIZE,
  NPROC, NOFILE; `python -I -S`, scrubbed environment; an empty temporary
  working directory; capped output; no_new_privs; death with the parent.
* `namespaces` (util-linux `unshare`): no network, own pid namespace.
* `filesystem` (mount namespace, in `sandbox_boot.py`): host tree read-only,
  home directories and the caller's working directory hidden, private tmpfs.
* `private_uid` (caller is root): a fresh unprivileged uid, so RLIMIT_NPROC
  (per uid; root is exempt) bounds this run alone. A non-root caller gets a user
  namespace instead, where the count is per namespace.
"""

from __future__ import annotations

import functools
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

_BOOT_SOURCE = (Path(__file__).with_name("sandbox_boot.py")).read_text()
_PROGRAM = ".program.py"
_SCRATCH = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock")
_HIDDEN = ("/root", "/home")
_SYSTEM = {"/", "/bin", "/dev", "/etc", "/lib", "/lib64", "/opt", "/proc", "/sys", "/usr", "/usr/local", "/var"}
# Uids no account uses: each run takes a fresh one at random (collisions between
# concurrent runs are ~1e-9 likely and would only share their process budget).
_UID_LOW, _UID_SPAN = 1 << 24, 1 << 28


class SandboxUnavailable(RuntimeError):
    """The isolation a caller asked for cannot be had on this machine."""


@dataclass(frozen=True)
class Isolation:
    """Which protection layers hold (see the module docstring)."""

    namespaces: bool
    filesystem: bool
    private_uid: bool

    def describe(self) -> str:
        held = [name for name in ("namespaces", "filesystem", "private_uid") if getattr(self, name)]
        return "rlimits + " + (", ".join(held) if held else "nothing else (no namespaces: network and files open)")


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. `cpu_s` None means the wall-clock timeout rounded up. A run
    writing more than `file_size_mb` to stdout + stderr is killed (`output_overflow`);
    of each stream the last `max_output_bytes` are kept. `hide_paths`: directories
    to hide besides `/root`, `/home` and the caller's working directory."""

    timeout_s: float = 10.0
    memory_mb: int = 1024
    cpu_s: int | None = None
    file_size_mb: int = 16
    tmpfs_mb: int = 64
    max_processes: int = 16
    max_open_files: int = 256
    max_output_bytes: int = 64 * 1024
    hide_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not (
            math.isfinite(self.timeout_s) and self.timeout_s > 0
        ):
            raise ValueError(f"timeout_s must be a positive number, got {self.timeout_s!r}")
        for name in ("memory_mb", "file_size_mb", "tmpfs_mb", "max_processes", "max_open_files", "max_output_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.cpu_s is not None and (isinstance(self.cpu_s, bool) or not isinstance(self.cpu_s, int) or self.cpu_s < 1):
            raise ValueError(f"cpu_s must be a positive int or None, got {self.cpu_s!r}")
        if isinstance(self.hide_paths, str) or not all(isinstance(p, str) and p for p in self.hide_paths):
            raise ValueError(f"hide_paths must be a sequence of paths, got {self.hide_paths!r}")
        object.__setattr__(self, "hide_paths", tuple(self.hide_paths))  # YAML gives lists


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended. `exit_code` is negative for a signal (-9: killed);
    `stdout`/`stderr` are the last `max_output_bytes` of each (decoded with
    replacement), `*_bytes` the full amounts written."""

    exit_code: int
    timed_out: bool
    output_overflow: bool
    stdout: str
    stderr: str
    stdout_bytes: int
    stderr_bytes: int
    duration_s: float
    isolation: Isolation

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.output_overflow


def _interpreter() -> str:
    # The base interpreter, not a venv's: with -S the code gets the standard library only.
    return sys._base_executable if os.path.exists(sys._base_executable) else sys.executable


def _command(isolation: Isolation, cfg: dict) -> list[str]:
    boot = [_interpreter(), "-I", "-S", "-c", _BOOT_SOURCE, json.dumps(cfg)]
    # If the trainer dies (OOM kill), its thread's timeout dies with it: the parent-death
    # signal then ends the run (through unshare's --kill-child, the whole namespace).
    setpriv = shutil.which("setpriv")
    orphan_kill = [setpriv, "--pdeathsig", "KILL"] if setpriv else []
    if not isolation.namespaces:
        return [*orphan_kill, *boot]
    flags = ["--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--mount-proc"]
    if os.geteuid() != 0:
        flags = ["--user", "--map-root-user", *flags]
    return [*orphan_kill, shutil.which("unshare") or "unshare", *flags, "--", *boot]


def _hidden_paths(extra: Sequence[str]) -> list[str]:
    # The caller's working directory usually holds the project, its data and outputs
    # (unless it is a system directory the interpreter itself needs).
    cwd = os.path.realpath(os.getcwd())
    paths = {os.path.realpath(p) for p in (*_HIDDEN, *extra)}
    if cwd not in _SYSTEM:
        paths.add(cwd)
    return sorted(paths - {"/"})


def _keep_paths(covered: Sequence[str]) -> list[str]:
    """The interpreter's install tree, when it lies below a directory the sandbox covers."""
    prefix = os.path.realpath(sys.base_prefix)
    return [prefix] if any(prefix == c or prefix.startswith(c + "/") for c in covered) else []


@dataclass
class _Streams:
    stdout: bytearray
    stderr: bytearray
    stdout_bytes: int
    stderr_bytes: int
    timed_out: bool
    overflow: bool


def _read_until(proc: subprocess.Popen, deadline: float, cap: int, ceiling: int) -> _Streams:
    """Both pipes' last `cap` bytes and total sizes, read until they close, the deadline
    passes (timed_out) or more than `ceiling` bytes came (overflow)."""
    tails = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    totals = dict.fromkeys(tails, 0)
    selector = selectors.DefaultSelector()
    for fd in tails:
        selector.register(fd, selectors.EVENT_READ)
    timed_out = overflow = False
    while selector.get_map() and not overflow:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            timed_out = True
            break
        for key, _ in selector.select(min(remaining, 0.1)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                selector.unregister(key.fd)
                continue
            tail = tails[key.fd]
            tail += chunk
            totals[key.fd] += len(chunk)
            del tail[: max(0, len(tail) - cap)]
            # Draining a flood costs the host CPU until the timeout: past the ceiling, stop it.
            overflow = sum(totals.values()) > ceiling
        # Without a pid namespace a background child may hold the pipes open after the
        # program ended: the program's end is the run's end.
        if proc.poll() is not None and not selector.select(0):
            break
    selector.close()
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    return _Streams(tails[out], tails[err], totals[out], totals[err], timed_out, overflow)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:  # the group has already gone
        pass


def _remove_tree(path: str) -> None:
    """rmtree that also removes what the code locked (chmod 0 folders; only possible
    without the filesystem layer, where the working directory is the host's)."""

    def unlock_and_retry(function, failed_path, exc_info) -> None:
        if not issubclass(exc_info[0], PermissionError):
            raise exc_info[1]
        os.chmod(os.path.dirname(failed_path), 0o700)
        if os.path.isdir(failed_path) and not os.path.islink(failed_path):
            os.chmod(failed_path, 0o700)
            shutil.rmtree(failed_path, onerror=unlock_and_retry)
        else:
            function(failed_path)

    shutil.rmtree(path, onerror=unlock_and_retry)


def _launch(code: str, limits: SandboxLimits, isolation: Isolation) -> SandboxResult:
    workdir = tempfile.mkdtemp(prefix="maxent-sandbox-")
    hidden = _hidden_paths(limits.hide_paths)
    cfg = {
        "workdir": workdir,
        "program": _PROGRAM,
        "filesystem": isolation.filesystem,
        "uid": _UID_LOW + secrets.randbelow(_UID_SPAN) if isolation.private_uid else None,
        "keep": _keep_paths([*hidden, *_SCRATCH]),
        "hidden": hidden,
        "scratch": list(_SCRATCH),
        "tmpfs_mb": limits.tmpfs_mb,
        "limits": {
            "memory_bytes": limits.memory_mb << 20,
            "file_bytes": limits.file_size_mb << 20,
            "processes": limits.max_processes,
            "open_files": limits.max_open_files,
            "cpu_s": limits.cpu_s or math.ceil(limits.timeout_s),
        },
    }
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
    # The program reaches the sandbox as a file it reads and deletes before anything else
    # (a pipe could block this thread past the timeout on a large program).
    with open(os.path.join(workdir, _PROGRAM), "x", encoding="utf-8") as f:
        f.write(code)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            _command(isolation, cfg), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=workdir, env=env, start_new_session=True, close_fds=True,
        )
        try:
            streams = _read_until(proc, start + limits.timeout_s, limits.max_output_bytes, limits.file_size_mb << 20)
        finally:
            # Whatever is left of the group goes, whether the run ended, timed out or raised.
            _kill_group(proc.pid)
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
    finally:
        _remove_tree(workdir)
    return SandboxResult(
        exit_code=proc.returncode, timed_out=streams.timed_out, output_overflow=streams.overflow,
        stdout=streams.stdout.decode("utf-8", "replace"), stderr=streams.stderr.decode("utf-8", "replace"),
        stdout_bytes=streams.stdout_bytes, stderr_bytes=streams.stderr_bytes,
        duration_s=time.monotonic() - start, isolation=isolation,
    )


@functools.cache
def detect_isolation() -> Isolation:
    """The strongest isolation that runs a trivial program here (probed once per process)."""
    root = os.geteuid() == 0
    probe = SandboxLimits(timeout_s=20.0)
    candidates = [Isolation(True, True, root), Isolation(True, False, root), Isolation(False, False, root)]
    if shutil.which("unshare") is None:
        candidates = candidates[2:]
    if root:
        # A fresh uid cannot read an interpreter installed below /root without the filesystem
        # layer; the last resort (require_namespaces=False only) keeps the caller's uid.
        candidates.append(Isolation(False, False, False))
    for isolation in candidates:
        # Modules loaded from disk (not built in) show that the interpreter is readable.
        result = _launch("import decimal, json, socket\nprint('sandbox-ok')", probe, isolation)
        if result.passed and result.stdout.strip() == "sandbox-ok":
            return isolation
    raise SandboxUnavailable(f"no sandbox configuration runs Python here; last error: {result.stderr.strip()[-500:]}")


def require_isolation(*, namespaces: bool) -> Isolation:
    """`detect_isolation()`, or SandboxUnavailable when `namespaces` are asked for and missing."""
    isolation = detect_isolation()
    if namespaces and not (isolation.namespaces and isolation.filesystem):
        raise SandboxUnavailable(
            f"sandboxed code needs Linux namespaces (unshare: user, net, pid, mount), which this machine does not "
            f"give ({isolation.describe()}); without them the code could reach the network and write the caller's "
            "files. Set require_namespaces=false to run it with resource limits only."
        )
    return isolation


def run_sandboxed(
    code: str, *, timeout_s: float = 10.0, memory_mb: int = 1024, require_namespaces: bool = True, **limits
) -> SandboxResult:
    """Run `code` as a Python program; `limits` are the other `SandboxLimits` fields.
    Raises SandboxUnavailable when `require_namespaces` and the machine has none."""
    return _run_one(code, SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, **limits), require_namespaces)


def _run_one(code: str, limits: SandboxLimits, require_namespaces: bool) -> SandboxResult:
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    return _launch(code, limits, require_isolation(namespaces=require_namespaces))


def run_many(
    programs: Sequence[str], *, limits: SandboxLimits, max_workers: int = 4, require_namespaces: bool = True
) -> list[SandboxResult]:
    """`run_sandboxed` over `programs`, at most `max_workers` at a time (threads, each waiting
    on its own process), results in input order."""
    if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
        raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
    require_isolation(namespaces=require_namespaces)  # fail once, before any thread starts
    with ThreadPoolExecutor(max_workers=min(max_workers, max(1, len(programs)))) as pool:
        return list(pool.map(lambda p: _run_one(p, limits, require_namespaces), programs))
