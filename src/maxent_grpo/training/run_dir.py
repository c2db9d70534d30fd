"""One run per output folder: the lock, the refusal to mix runs, and what ``--resume`` may change.

* A folder that holds a previous run (``config.yaml``, ``metrics.jsonl`` or
  ``checkpoints/``) is refused unless the user passes ``--resume`` (continue it)
  or ``--overwrite`` (delete it first).
* ``OUTPUT_DIR/.lock`` is held with ``flock`` for the whole run and records the
  PID and host: a second run on the same folder is refused. The owner is the
  kernel's open file, not the recorded PID (which is only for the message): the
  kernel drops the lock when its process dies, so a killed run never leaves a
  stale lock, and a run restarted by ``torchrun --max-restarts`` (which kills the
  dead incarnation's whole session first) claims the folder again at once.
* ``--resume auto`` (:func:`resume_request`) continues from the latest complete
  checkpoint, or starts afresh when there is none: one command line for the first
  start and for every restart.
* On resume the checkpoint's config is compared with the new one: keys that
  decide what the run samples and trains on (:data:`FIXED_ON_RESUME`) may not
  change; free keys (:data:`FREE_ON_RESUME`: step budget, logging, checkpoint
  cadence, the servers' addresses and waits) may; any other change (the learning rate, a loss coefficient) needs
  ``--allow-config-change`` and is recorded as a comment in ``config.yaml`` with
  the step it took effect.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from maxent_grpo.errors import UserError
from maxent_grpo.run_files import write_text_atomic

LOCK_NAME = ".lock"
# --resume auto: the latest complete checkpoint of the output folder, or a fresh start.
RESUME_AUTO = "auto"
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "checkpoints")

# A change to any of these makes the resumed run a different experiment.
# ``replay``: the bank a checkpoint holds was filled and scheduled under its run's replay settings.
FIXED_ON_RESUME = (
    "method", "model", "data", "rewards", "generation.num_generations", "training.seed",
    "training.prompts_per_step", "training.batch_size", "training.strategy", "replay",
)
# These change how long the run goes on, what it writes, and where its servers are and how long it waits
# for them (a replacement server or a restarted cluster at another address), not what it learns.
FREE_ON_RESUME = (
    "training.max_steps", "logging", "checkpoint", "eval", "training.dist_timeout_minutes",
    "generation.vllm.server_url", "generation.vllm.request_timeout_s", "generation.vllm.server_wait_s",
    "rollout.transferqueue_ray_address", "rollout.wait_timeout_s",
)


class RunDirError(UserError):
    """The output folder cannot be used for this run; the message says why and what to pass."""


@dataclass(frozen=True)
class ResumeRequest:
    """What ``--resume`` asked for: the checkpoint folder ``path``, or (``path`` None, ``--resume auto``)
    the latest complete checkpoint in the output folder, starting afresh when there is none."""

    path: Path | None = None


def resume_request(value: str | Path | bool | None) -> ResumeRequest | None:
    """The resume argument of the command line (``--resume [PATH|auto]``) or of ``maxent_grpo.train``
    (``resume=PATH | "auto" | True``) as a request; None and False: no resume."""
    if value is None or value is False:
        return None
    if value is True or value == RESUME_AUTO:
        return ResumeRequest()
    if isinstance(value, (str, Path)) and str(value):
        return ResumeRequest(Path(value))
    raise RunDirError(f"resume: expected a checkpoint folder, {RESUME_AUTO!r} or True, got {value!r}")


@dataclass
class RunLock:
    """The open lock file of a claimed output folder; closing it releases the folder."""

    path: Path
    handle: TextIO | None

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


def previous_run(output_dir: Path) -> list[str]:
    """The names of a previous run's files in ``output_dir`` (empty: none)."""
    return [name for name in RUN_MARKERS if (output_dir / name).exists()]


def claim_output_dir(output_dir: Path, *, resume: bool, overwrite: bool) -> RunLock:
    """Create and lock ``output_dir`` for this run (call on the main process only).

    Raises :class:`RunDirError` when the path is a file or not writable, another
    run holds the folder, or a previous run is there and neither ``resume`` nor
    ``overwrite`` was asked for. ``overwrite`` deletes the previous run's files.
    """
    if output_dir.exists() and not output_dir.is_dir():
        raise RunDirError(f"logging.output_dir: {output_dir} is a file, not a folder; choose another --output-dir")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"logging.output_dir: cannot create {output_dir}: {err.strerror}") from err
    if not os.access(output_dir, os.W_OK | os.X_OK):
        raise RunDirError(f"logging.output_dir: {output_dir} is not writable; choose another --output-dir")
    lock = _lock(output_dir / LOCK_NAME)
    found = previous_run(output_dir)
    if found and not (resume or overwrite):
        lock.release()
        raise RunDirError(
            f"{output_dir} holds a previous run ({', '.join(found)}): pass --resume to continue it, "
            "--overwrite to delete it, or choose another --output-dir"
        )
    if found and overwrite and not resume:
        for entry in output_dir.iterdir():
            if entry.name == LOCK_NAME:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
    return lock


def _lock(path: Path) -> RunLock:
    # "a+" keeps the holder's record readable while we try: opening with "w" would erase it.
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RunDirError(
            f"{path.parent} is in use by {holder} (lock file {path}); wait for that run to end or choose "
            "another --output-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    handle.flush()
    return RunLock(path, handle)


# ---------------------------------------------------------------- resume checks


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in ("task_kwargs", "kwargs"):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class ConfigChange:
    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key}: {json.dumps(self.old, default=str)} -> {json.dumps(self.new, default=str)}"


def resume_changes(saved: dict, new: dict, *, allow_change: bool) -> list[ConfigChange]:
    """The config changes a resume makes, after checking that each is allowed.

    ``saved`` and ``new`` are ``to_dict`` trees. Raises :class:`RunDirError`
    naming the key for a change that breaks resume, or for a change that needs
    ``--allow-config-change`` when it was not given.
    """
    old_flat, new_flat = _flatten(saved), _flatten(new)
    changes = [
        ConfigChange(key, old_flat.get(key), new_flat.get(key))
        for key in sorted(set(old_flat) | set(new_flat))
        if old_flat.get(key) != new_flat.get(key)
    ]
    fixed = [c for c in changes if _under(c.key, FIXED_ON_RESUME)]
    if fixed:
        raise RunDirError(
            f"--resume: {fixed[0]} would change what the run samples or trains on, so it cannot continue "
            "this run; start a new one in another --output-dir (or with --overwrite)"
        )
    guarded = [c for c in changes if not _under(c.key, FREE_ON_RESUME)]
    if guarded and not allow_change:
        raise RunDirError(
            f"--resume: {guarded[0]} differs from the checkpoint's config; pass --allow-config-change "
            "to continue with the new value (it is recorded in config.yaml), or restore the old one"
        )
    return changes


def config_history(path: Path) -> list[str]:
    """The ``# resumed at step ...`` lines at the top of a saved ``config.yaml``."""
    if not path.is_file():
        return []
    return [line for line in path.read_text().splitlines() if line.startswith("# resumed at step ")]


def history_line(step: int, changes: list[ConfigChange]) -> str:
    listed = "; ".join(str(c) for c in changes) if changes else "no config change"
    return f"# resumed at step {step}: {listed}"


def save_config(source: dict, path: str | Path, header: list[str] | None = None) -> None:
    """Write a config (as ``config.load.to_dict`` gives it) as YAML (atomically: a reader never sees half a
    file), below ``header``'s comment lines (the run's resume history)."""
    text = "".join(line + "\n" for line in header or []) + yaml.safe_dump(source, sort_keys=False)
    write_text_atomic(path, text)
