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
    from benchmarks.tiny_model import build_tiny_model

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


MODEL_CONFIGS = Path(__file__).resolve().parent / "model_configs"


def random_model_names() -> list[str]:
    """The kept ``config.json`` files (``qwen2.5-0.5b`` ...): models the GPU tier builds with random weights."""
    return sorted(p.stem for p in MODEL_CONFIGS.glob("*.json"))


def random_model(name: str, out: Path, *, device: str = "cpu", seed: int = 0) -> Path:
    """A model folder at ``out`` with random weights (bfloat16 on disk, as Qwen2.5 ships) from the kept
    ``model_configs/NAME.json``: real shapes, speed and memory with nothing downloaded.

    Its tokenizer is the tiny byte-level BPE padded with plain added tokens up to the config's
    ``vocab_size``, so that every id the random model samples decodes (to a token of its own; the
    text is noise, the token counts are real). Built beside ``out`` and renamed, like :func:`_tiny`.
    """
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from benchmarks.tiny_model import build_tiny_tokenizer

    if (out / "config.json").is_file():
        return out
    path = MODEL_CONFIGS / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"no kept config {name!r}: one of {', '.join(random_model_names())}")
    tok = build_tiny_tokenizer()
    config = AutoConfig.for_model(**json.loads(path.read_text()))
    tok.add_tokens([f"<|r{i}|>" for i in range(config.vocab_size - len(tok))])
    config.eos_token_id = config.pad_token_id = tok.eos_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(tmp)
    return out
