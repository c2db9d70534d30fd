"""Import a user's reward function: ``module:function`` or ``path/to/file.py:function``.

A TRL user keeps ``my_rewards.py`` next to the script or the config. So a
module name is looked up on ``sys.path`` and then in the current folder (the
``maxent-grpo`` script does not put it on the path as ``python script.py``
would); a ``.py`` path is read relative to the current folder. ``load_config``
has already turned a module or file that sits beside the config file into that
file's absolute path.
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
    """A ``module:function`` or ``file.py:function`` reward cannot be imported."""


def split_reference(path: str) -> tuple[str, str]:
    """``("module" or "file.py", "function")``; the last ``:`` separates them (a Windows drive has one too)."""
    module, sep, attr = path.rpartition(":")
    if not sep or not module or not attr:
        raise RewardImportError(f"reward function path must look like 'module:function' or 'file.py:function', got {path!r}")
    return module, attr


def import_reference(path: str) -> Any:
    """The object ``path`` names."""
    module_name, attr = split_reference(path)
    module = _load_file(path, Path(module_name)) if module_name.endswith(".py") else _load_module(path, module_name)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RewardImportError(f"reward function {path!r}: {module_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _load_module(path: str, module_name: str):
    cwd = os.getcwd()
    if cwd not in sys.path:
        # Last, so an installed package of the same name still wins.
        sys.path.append(cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise RewardImportError(
                f"reward function {path!r}: no module {module_name!r} in the current folder, beside the config "
                "file, or installed; give its file as path/to/file.py:function"
            ) from exc
        raise RewardImportError(f"reward function {path!r}: importing {module_name!r} failed: {exc}") from exc
    except ImportError as exc:
        raise RewardImportError(f"reward function {path!r}: importing {module_name!r} failed: {exc}") from exc


def _load_file(path: str, file: Path):
    file = file.expanduser().resolve()
    if not file.is_file():
        raise RewardImportError(f"reward function {path!r}: file {file} not found")
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
        raise RewardImportError(f"reward function {path!r}: {file} failed to import: {exc}") from exc
    return module


def resolve_reference(name: str, config_dir: Path | None) -> str:
    """``name`` with its file made absolute, so the saved config works from any folder.

    A ``.py`` path is taken relative to the current folder, else to ``config_dir``.
    A module that cannot be found on ``sys.path`` or in the current folder but sits
    in ``config_dir`` becomes that file's path. Nothing is imported here.
    """
    module, attr = split_reference(name)
    if module.endswith(".py"):
        for base in (Path.cwd(), config_dir):
            if base is not None and (base / module).is_file():
                return f"{(base / module).resolve()}:{attr}"
        return name  # import_reference reports the missing file
    top = module.split(".")[0]
    if importlib.util.find_spec(top) is not None or (Path.cwd() / f"{top}.py").is_file() or (Path.cwd() / top).is_dir():
        return name
    beside = config_dir / (module.replace(".", "/") + ".py") if config_dir is not None else None
    if beside is not None and beside.is_file():
        return f"{beside.resolve()}:{attr}"
    return name
