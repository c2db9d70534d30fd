"""Import a user's code the config names: ``module:function`` or ``path/to/file.py:Class``.

Reward functions, tools and environment classes (``kind`` names which, in errors). A TRL
user keeps ``my_rewards.py`` next to the script or the config. ``load_config`` has already
turned a module or file that sits beside the config file into that file's absolute path
(:func:`resolve_reference`: the config's folder first); what is left is looked up on
``sys.path`` and then in the current folder (the ``maxent-grpo`` script does not put it on
the path as ``python script.py`` would), a ``.py`` path relative to the current folder.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from maxent_grpo.errors import UserError


class RewardImportError(UserError, ValueError):
    """A ``module:function`` or ``file.py:Class`` the config names cannot be imported."""


def split_reference(path: str, kind: str = "reward function") -> tuple[str, str]:
    """``("module" or "file.py", "function")``; the last ``:`` separates them (a Windows drive has one too)."""
    module, sep, attr = path.rpartition(":")
    if not sep or not module or not attr:
        what = "Class" if kind == "environment class" else "function"
        raise RewardImportError(f"{kind} path must look like 'module:{what}' or 'file.py:{what}', got {path!r}")
    return module, attr


def import_reference(path: str, kind: str = "reward function") -> Any:
    """The object ``path`` names; ``kind`` (reward function, tool, environment class) names it in errors."""
    module_name, attr = split_reference(path, kind)
    where = f"{kind} {path!r}"
    module = _load_file(where, Path(module_name)) if module_name.endswith(".py") else _load_module(where, module_name)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardImportError(f"{where}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _load_module(where: str, module_name: str):
    cwd = os.getcwd()
    if cwd not in sys.path:
        # Last, so an installed package of the same name still wins.
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise RewardImportError(
                f"{where}: no module {module_name!r} beside the config file, in the current folder, "
                "or installed; give its file as path/to/file.py:name"
            ) from exc
        raise RewardImportError(f"{where}: importing {module_name!r} failed: {exc}") from exc
    except ImportError as exc:
        raise RewardImportError(f"{where}: importing {module_name!r} failed: {exc}") from exc


def _load_file(where: str, file: Path):
    file = file.expanduser().resolve()
    if not file.is_file():
        raise RewardImportError(f"{where}: file {file} not found")
    name = f"maxent_grpo_user.{file.stem}_{abs(hash(str(file))):x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    # Registered before running it, as a normal import does (dataclasses and pickling look it up).
    sys.modules[name] = module
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))  # its own helper modules beside it
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[name]
        raise RewardImportError(f"{file} line {exc.lineno}: syntax error: {exc.msg}") from exc
    except ImportError as exc:
        del sys.modules[name]
        raise RewardImportError(f"{where}: {file} failed to import: {exc}") from exc
    return module


def resolve_reference(name: str, config_dir: Path | None, kind: str = "reward function") -> str:
    """``name`` with its file made absolute, so the saved config works from any folder.

    The config file's folder comes first, as the file is written beside its code: a ``.py``
    path is taken relative to ``config_dir``, else to the current folder; a module that
    sits in ``config_dir`` becomes that file's path, any other stays a module name.
    Nothing is imported here.
    """
    module, attr = split_reference(name, kind)
    if module.endswith(".py"):
        for base in (config_dir, Path.cwd()):
            if base is not None and (base / module).is_file():
                return f"{(base / module).resolve()}:{attr}"
        return name  # import_reference reports the missing file
    beside = config_dir / (module.replace(".", "/") + ".py") if config_dir is not None else None
    if beside is not None and beside.is_file():
        return f"{beside.resolve()}:{attr}"
    return name
