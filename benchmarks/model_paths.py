"""Where the benchmark models live on disk: the tiny random model and SmolLM2.

Children of the harness load a plain Hugging Face folder; this module makes
sure that folder exists *before* any timed child starts, so neither the GGUF
dequantisation nor the tiny-model build is counted in a child's time or RSS.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

TINY = "tiny"


def cache_root() -> Path:
    """``$MAXENT_GRPO_BENCH_CACHE`` or ``~/.cache/maxent-grpo-bench`` (the tiny model's home)."""
    env = os.environ.get("MAXENT_GRPO_BENCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "maxent-grpo-bench"


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """A plain HF model folder for ``tiny``, ``smollm2-135m-instruct`` (converted once) or a folder."""
    if name_or_path == TINY:
        return _tiny((cache_dir if cache_dir is not None else cache_root()) / "tiny")
    from maxent_grpo.models import resolve_model_path

    return Path(resolve_model_path(name_or_path))


def _tiny(out: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    from maxent_grpo.tiny import build_tiny_model

    # Built beside and renamed, so a concurrent or interrupted build never leaves half a folder.
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    build_tiny_model(tmp)
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").is_file():  # not a concurrent build that finished first
            raise
        shutil.rmtree(tmp)
    return out
