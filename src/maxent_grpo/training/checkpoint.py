"""Checkpoints that a crash cannot corrupt: save, verify, find the latest good one, resume.

Layout: ``OUTPUT_DIR/checkpoints/step-N/`` holds the model (Hugging Face format; only
the adapter for a peft model), the tokenizer, ``optimizer.pt`` (or, for an FSDP2
run, ``optimizer/``: the sharded state in ``torch.distributed.checkpoint``'s
format, see ``sharded_checkpoint.py``), ``scheduler.pt``,
``rng_state.pt``, ``trainer_state.json`` and, written last, ``manifest.json`` with the
size and sha256 of every other file.

A checkpoint is written into ``checkpoints/.tmp-step-N-<pid>``, every file is
fsynced, and only then is the folder renamed to ``step-N`` (a rename is atomic on
POSIX). A process killed at any moment therefore leaves either a ``.tmp-*`` folder,
which is never read, or a complete ``step-N``. The manifest additionally catches
files damaged after the fact (a disk filling up, a partial copy between machines).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from maxent_grpo.errors import UserError
from maxent_grpo.kill_points import kill_point
from maxent_grpo.run_files import fsync_dir, write_text_atomic

__all__ = [
    "CHECKPOINTS_DIRNAME",
    "CheckpointError",
    "find_latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "read_trainer_state",
    "save_checkpoint",
    "verify_checkpoint",
]

CHECKPOINTS_DIRNAME = "checkpoints"
MANIFEST_NAME = "manifest.json"
TRAINER_STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
SHARDED_OPTIMIZER_DIR = "optimizer"
SHARDED_OPTIMIZER_METADATA = "optimizer/.metadata"
SCHEDULER_NAME = "scheduler.pt"
RNG_STATE_NAME = "rng_state.pt"
# The reference model's parameters when it follows the policy (loss.sync_ref_model).
REFERENCE_NAME = "reference.safetensors"
PEFT_ADAPTER_WEIGHTS = "adapter_model.safetensors"
MANIFEST_VERSION = 1



class CheckpointError(UserError, ValueError):
    """A checkpoint folder given by the user is missing, damaged or of another kind of run."""


_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-.*-(\d+)$")
_HASH_CHUNK = 1 << 20


# ----------------------------------------------------------------------------- save


@dataclass(frozen=True)
class CheckpointContents:
    """What one checkpoint holds.

    ``model`` is the unwrapped model (a ``PreTrainedModel`` or a ``PeftModel``); ``trainer_state`` must be
    JSON-serialisable. For a sharded model, ``model_state_dict`` holds its gathered full weights and
    ``sharded_optimizer`` (instead of ``optimizer``) a folder the ranks have written their optimizer shards
    to; it is moved into the checkpoint as ``optimizer/``. ``reference_state``: the parameters of a
    reference that follows the policy (``reference.safetensors``).
    """

    model: Any
    tokenizer: Any | None
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any | None
    trainer_state: dict
    model_state_dict: dict[str, torch.Tensor] | None = None
    sharded_optimizer: Path | None = None
    reference_state: dict[str, torch.Tensor] | None = None


def save_checkpoint(output_dir: str | Path, step: int, contents: CheckpointContents, *,
                    keep_last: int | None) -> Path:
    """Write ``contents`` to ``OUTPUT_DIR/checkpoints/step-{step}`` atomically and prune old checkpoints.

    ``keep_last`` keeps that many checkpoints (the newest by step, always including this one); ``None``
    keeps all. Call it on one process only. Returns the checkpoint folder.
    """
    trainer_state = contents.trainer_state
    if (contents.optimizer is None) == (contents.sharded_optimizer is None):
        raise ValueError("give exactly one of optimizer and sharded_optimizer")
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be None or a positive int, got {keep_last!r}")
    if not isinstance(trainer_state, dict):
        raise ValueError(f"trainer_state must be a dict, got {type(trainer_state).__name__}")
    # Fail before writing anything if the state cannot be stored.
    try:
        state_text = json.dumps(trainer_state, indent=2, sort_keys=True)
    except TypeError as exc:
        raise ValueError(f"trainer_state must be JSON-serialisable: {exc}") from exc

    root = Path(output_dir) / CHECKPOINTS_DIRNAME
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        _write_contents(tmp, step, contents, state_text)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed save (disk full...) leaves no debris
        raise

    kill_point("save.before_rename", step)
    if final.exists():
        # Re-saving a step (after resuming from an earlier one): move the old one out of
        # the way first, so a crash in between leaves the older checkpoints intact.
        displaced = root / f".tmp-replaced-step-{step}-{os.getpid()}"
        os.rename(final, displaced)
        os.rename(tmp, final)
        fsync_dir(root)
        shutil.rmtree(displaced)
    else:
        os.rename(tmp, final)
        fsync_dir(root)

    if keep_last is not None:
        _prune(root, keep_last=keep_last, keep=final)
    return final


def describe_write_error(err: BaseException, where: str | Path) -> str:
    """One line for a write the machine refused (a full disk, EFBIG, permissions): the
    reason and the file, or ``where`` when the error names none."""
    if isinstance(err, OSError):
        return f"{err.strerror or err} ({err.filename or where})"
    # safetensors reports the same I/O errors as its own SafetensorError; torch.save's zip writer
    # (inside DCP) as a RuntimeError
    text = str(err).removeprefix("Error while serializing: ").strip()
    return f"{text.splitlines()[0] if text else type(err).__name__} ({where})"


def save_failed(output_dir: str | Path, step: int, failure: str) -> CheckpointError:
    """The error of a save that failed with ``failure`` (every process raises the same): it names
    the step and the checkpoint to resume from, which the failed save has left intact."""
    latest = find_latest_checkpoint(output_dir)
    kept = f"the latest complete checkpoint is {latest}" if latest else "there is no earlier checkpoint"
    return CheckpointError(f"could not save the checkpoint of step {step}: {failure}; {kept}")


def _write_contents(tmp: Path, step: int, c: CheckpointContents, state_text: str) -> None:
    model, tokenizer, optimizer, lr_scheduler = c.model, c.tokenizer, c.optimizer, c.lr_scheduler
    model_state_dict, sharded_optimizer, reference_state = c.model_state_dict, c.sharded_optimizer, c.reference_state
    model_format = "peft" if _is_peft_model(model) else "full"
    if model_state_dict is None:
        model.save_pretrained(tmp)
    else:
        model.save_pretrained(tmp, state_dict=model_state_dict)
    kill_point("save.after_first_file", step)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if sharded_optimizer is not None:
        os.rename(sharded_optimizer, tmp / SHARDED_OPTIMIZER_DIR)
    else:
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER_NAME)
    kill_point("save.between_files", step)
    if lr_scheduler is not None:
        torch.save(lr_scheduler.state_dict(), tmp / SCHEDULER_NAME)
    torch.save(_capture_rng_state(), tmp / RNG_STATE_NAME)
    if reference_state is not None:
        from safetensors.torch import save_file

        save_file({k: v.detach().contiguous().cpu() for k, v in reference_state.items()}, tmp / REFERENCE_NAME)
    (tmp / TRAINER_STATE_NAME).write_text(state_text)

    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        size, digest = _fsync_and_hash(path)
        files[path.relative_to(tmp).as_posix()] = {"size": size, "sha256": digest}
    manifest = {"version": MANIFEST_VERSION, "step": step, "model_format": model_format, "files": files}
    # The manifest goes last: a folder with a manifest has everything the manifest lists.
    write_text_atomic(tmp / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True))
    for sub in sorted((p for p in tmp.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        fsync_dir(sub)
    fsync_dir(tmp)


def _is_peft_model(model: Any) -> bool:
    # A model can only be a PeftModel if peft has been imported; avoids importing it (slow).
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _capture_rng_state() -> dict:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy
    except ImportError:  # numpy is optional: nothing of it to restore then
        numpy = None
    if numpy is not None:
        np_state = numpy.random.get_state(legacy=False)
        # Stored as plain torch/python values so that torch.load(weights_only=True) reads it.
        state["numpy"] = {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype("int64")),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        s = state["numpy"]
        numpy.random.set_state(
            {
                "bit_generator": s["bit_generator"],
                "state": {"key": s["key"].numpy().astype(numpy.uint32), "pos": s["pos"]},
                "has_gauss": s["has_gauss"],
                "gauss": s["gauss"],
            }
        )
    if "cuda" in state and torch.cuda.is_available():
        saved = state["cuda"]
        if len(saved) != torch.cuda.device_count():
            warnings.warn(
                f"checkpoint holds CUDA RNG states for {len(saved)} devices, this process sees "
                f"{torch.cuda.device_count()}: CUDA RNG states not restored",
                stacklevel=3,
            )
        else:
            torch.cuda.set_rng_state_all(saved)


def _fsync_and_hash(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return size, digest.hexdigest()


def _prune(root: Path, *, keep_last: int, keep: Path) -> None:
    complete = [p for p in list_checkpoints(root.parent) if (p / MANIFEST_NAME).is_file()]
    survivors = set(complete[-keep_last:]) | {keep}
    for path in complete:
        if path not in survivors:
            # Rename first: a crash during the rmtree leaves a .tmp folder, not a half-deleted step.
            doomed = root / f".tmp-pruned-{path.name}-{os.getpid()}"
            os.rename(path, doomed)
            shutil.rmtree(doomed)


# ----------------------------------------------------------------------------- find and verify


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """The ``step-N`` folders under ``OUTPUT_DIR/checkpoints``, oldest step first (not verified)."""
    root = Path(output_dir) / CHECKPOINTS_DIRNAME
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def verify_checkpoint(path: str | Path) -> bool:
    """True when the manifest exists and every file it lists has its recorded size and sha256."""
    return _verification_problem(Path(path)) is None


def _verification_problem(path: Path) -> str | None:
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        return f"no {MANIFEST_NAME} (incomplete checkpoint)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"unreadable {MANIFEST_NAME}: {exc}"
    if (
        not isinstance(manifest, dict)
        or manifest.get("version") != MANIFEST_VERSION
        or not isinstance(manifest.get("files"), dict)
        or manifest.get("model_format") not in ("full", "peft")
    ):
        return f"{MANIFEST_NAME} has an unknown format"
    files = manifest["files"]
    for required in (TRAINER_STATE_NAME, RNG_STATE_NAME):
        if required not in files:
            return f"{MANIFEST_NAME} does not list {required}"
    if OPTIMIZER_NAME not in files and SHARDED_OPTIMIZER_METADATA not in files:
        return f"{MANIFEST_NAME} lists no optimizer state"
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected["size"]:
            return f"{name} has {size} bytes, the manifest says {expected['size']}"
    for name, expected in files.items():
        if _sha256(path / name) != expected["sha256"]:
            return f"{name} does not match its sha256"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def find_latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest ``step-N`` checkpoint that verifies, or ``None``.

    Damaged checkpoints are skipped with a warning naming them. Leftover ``.tmp-*``
    folders of processes that no longer run (interrupted saves) are removed.
    """
    _remove_stale_tmp_dirs(Path(output_dir) / CHECKPOINTS_DIRNAME)
    for path in reversed(list_checkpoints(output_dir)):
        problem = _verification_problem(path)
        if problem is None:
            return path
        warnings.warn(f"skipping damaged checkpoint {path}: {problem}", stacklevel=2)
    return None


def _remove_stale_tmp_dirs(root: Path) -> None:
    if not root.is_dir():
        return
    for path in root.iterdir():
        m = _TMP_DIR.match(path.name)
        if m and path.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


# ----------------------------------------------------------------------------- load


def load_checkpoint(
    path: str | Path,
    *,
    model: Any,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any | None,
    verify: bool = True,
) -> dict:
    """Restore model weights (in place), optimizer, scheduler and RNG states; return trainer_state.

    ``model`` must have the architecture that was saved (for a peft checkpoint: a
    ``PeftModel`` with the same adapter config). ``optimizer=None`` skips the
    optimizer state (evaluation). ``verify=False`` skips the sha256 check when the
    caller has just verified the checkpoint (``find_latest_checkpoint`` does).
    """
    path = Path(path)
    _check_checkpoint_dir(path, verify=verify)
    manifest = json.loads((path / MANIFEST_NAME).read_text())

    if manifest["model_format"] == "peft":
        _load_peft_weights(path, model)
    else:
        if _is_peft_model(model):
            raise CheckpointError(f"model is a PeftModel but checkpoint {path} holds a full model")
        _load_full_weights(path, model)

    if optimizer is not None:
        if not (path / OPTIMIZER_NAME).is_file():
            raise CheckpointError(f"checkpoint {path} holds a sharded optimizer state (an FSDP2 run): "
                             "resume it with training.strategy=fsdp2")
        optimizer.load_state_dict(torch.load(path / OPTIMIZER_NAME, map_location="cpu", weights_only=True))
    return restore_run_state(path, lr_scheduler)


def load_reference_state(path: str | Path, reference: torch.nn.Module) -> None:
    """Copy the checkpoint's reference parameters (``reference.safetensors``) into ``reference`` in place."""
    from safetensors.torch import load_file

    file = Path(path) / REFERENCE_NAME
    if not file.is_file():
        raise CheckpointError(f"--resume: loss.sync_ref_model but {path} holds no {REFERENCE_NAME} (its run's "
                              "reference did not follow the policy)")
    saved = load_file(file)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name not in saved or saved[name].shape != param.shape:
                raise CheckpointError(f"--resume: {file} has no parameter {name} of shape {tuple(param.shape)}")
            param.copy_(saved[name])


def _check_checkpoint_dir(path: Path, *, verify: bool) -> None:
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint folder (expected OUTPUT_DIR/checkpoints/step-N)")
    problem = _verification_problem(path) if verify else None
    if problem is not None:
        raise CheckpointError(f"{path} is not a valid checkpoint: {problem}")


def read_trainer_state(path: str | Path) -> dict:
    """The ``trainer_state.json`` of checkpoint ``path`` (checked to be a complete checkpoint)."""
    path = Path(path)
    _check_checkpoint_dir(path, verify=False)
    return json.loads((path / TRAINER_STATE_NAME).read_text())


def restore_run_state(path: Path, lr_scheduler: Any | None) -> dict:
    """Restore the scheduler and RNG states of checkpoint ``path``; return its trainer_state."""
    has_scheduler = (path / SCHEDULER_NAME).is_file()
    if lr_scheduler is not None:
        if not has_scheduler:
            raise ValueError(f"lr_scheduler was given but checkpoint {path} holds no {SCHEDULER_NAME}")
        lr_scheduler.load_state_dict(torch.load(path / SCHEDULER_NAME, map_location="cpu", weights_only=True))
    _restore_rng_state(torch.load(path / RNG_STATE_NAME, map_location="cpu", weights_only=True))
    return json.loads((path / TRAINER_STATE_NAME).read_text())


def read_full_weights(path: Path) -> dict[str, torch.Tensor]:
    """The Hugging Face weights of checkpoint ``path`` (every ``model*.safetensors``), on the CPU."""
    from safetensors.torch import load_file

    shards = sorted(path.glob("model*.safetensors"))
    if not shards:
        raise CheckpointError(f"checkpoint {path} has no model*.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(shard, device="cpu"))
    return state


def _load_full_weights(path: Path, model: torch.nn.Module) -> None:
    state = read_full_weights(path)
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise CheckpointError(f"checkpoint {path} has weights the model does not: {result.unexpected_keys[:5]}")
    # save_pretrained drops the copies of tied weights (lm_head = embeddings): a missing
    # key is fine only when its tensor shares storage with a loaded one.
    current = model.state_dict()
    loaded_ptrs = {current[k].data_ptr() for k in state}
    untied_missing = [k for k in result.missing_keys if current[k].data_ptr() not in loaded_ptrs]
    if untied_missing:
        raise CheckpointError(f"checkpoint {path} lacks model weights: {untied_missing[:5]}")


def _load_peft_weights(path: Path, model: Any) -> None:
    if not _is_peft_model(model):
        raise CheckpointError(f"checkpoint {path} holds a peft adapter: model must be a PeftModel")
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(path / PEFT_ADAPTER_WEIGHTS, device="cpu")
    result = set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise CheckpointError(f"checkpoint {path} has adapter weights the model does not: {result.unexpected_keys[:5]}")
