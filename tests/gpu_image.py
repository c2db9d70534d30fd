"""A replica here of the GPU machine's image (docs/SCALING.md, "The GPU check"): a ``sitecustomize``
that makes the path finder miss the packages the image lacks (``importlib.util.find_spec`` says None as
it would there), and the environment the GPU check's commands run in (tests/test_gpu_check.py,
tests/test_gpu_stages.py).
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What the image lacks; the GPU check carries wheels for the first two (scripts/gpu_check.py).
MISSING = ("datasets", "reasoning_gym", "math_verify", "trl", "vllm")
# What it still lacks once the check has installed its wheels.
MISSING_WITH_WHEELS = ("reasoning_gym", "math_verify", "vllm")


def blocker(missing: tuple[str, ...]) -> str:
    """The ``sitecustomize.py`` that hides ``missing`` (top-level package names)."""
    return f'''
import importlib.machinery

_MISSING = {missing!r}
_find = importlib.machinery.PathFinder.find_spec


def _find_spec(cls, name, path=None, target=None):
    if name.partition(".")[0] in _MISSING:
        return None  # as on the GPU machine: not installed
    return _find(name, path, target)


# A classmethod, as the original: pytest keeps PathFinder.find_spec as a bound method of its own.
importlib.machinery.PathFinder.find_spec = classmethod(_find_spec)
'''


def replica_env(block: Path, home: Path, missing: tuple[str, ...]) -> dict:
    """The environment of a command on the replica: ``block`` gets the ``sitecustomize``, ``home`` the caches."""
    block.mkdir(parents=True, exist_ok=True)
    (block / "sitecustomize.py").write_text(blocker(missing))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(block), str(REPO / "src"), str(REPO)])
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(home / "hf"), WANDB_MODE="offline",
               MAXENT_GRPO_BENCH_CACHE=str(home / "bench"), MAXENT_GRPO_CACHE=str(home / "cache"),
               TMPDIR=str(home))
    return env
