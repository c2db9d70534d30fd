"""What a vLLM push sends (``rollout/vllm_weights.py``), without vLLM: names, dtype, a tied head once,
LoRA merged, or the adapter alone in peft's own format. The engine taking them is tested in
tests/rollout/test_vllm.py and tests/rollout/test_vllm_lora_adapter.py."""

from __future__ import annotations

import copy

import pytest
import torch

from maxent_grpo.core.logprobs import get_per_token_logps
from maxent_grpo.models import apply_lora, load_model_and_tokenizer
from maxent_grpo.rollout.vllm_weights import (
    ENGINE_LORA_RANKS, adapter_rank, engine_lora_rank, full_state_items, write_adapter,
)


def _model(tiny_model_dir):
    return load_model_and_tokenizer(str(tiny_model_dir), dtype="float32")


def test_every_weight_in_the_engine_dtype_and_a_tied_head_gathered_once(tiny_model_dir):
    model, _ = _model(tiny_model_dir)
    assert model.config.tie_word_embeddings
    sent = dict(full_state_items(model, torch.bfloat16))
    state = model.state_dict()
    assert list(sent) == list(state)  # state_dict order: vLLM reloads layer by layer
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, state[k].to(torch.bfloat16)) for k, t in sent.items())
    # The tied head is the embedding's tensor itself: cast (and, sharded, gathered) once.
    assert sent["lm_head.weight"] is sent["model.embed_tokens.weight"]
    # No dtype: the stored tensors, no copy.
    assert dict(full_state_items(model))["model.norm.weight"].data_ptr() == state["model.norm.weight"].data_ptr()


@pytest.mark.parametrize("use_rslora", [False, True])
def test_lora_is_sent_merged_under_the_base_names_and_the_adapters_stay_apart(tiny_model_dir, use_rslora):
    """float64: the merged model computes the peft model's log-probs to rounding; fp32: to fp32 rounding.
    Rank-stabilised LoRA scales by alpha / sqrt(r) (8 / 2), the plain one by alpha / r (8 / 4)."""
    model, tok = _model(tiny_model_dir)
    peft = apply_lora(copy.deepcopy(model), r=4, alpha=8.0, dropout=0.0, target_modules="all-linear",
                      use_rslora=use_rslora)
    from peft.tuners.lora import LoraLayer

    scales = {m.scaling["default"] for m in peft.modules() if isinstance(m, LoraLayer)}
    assert scales == {4.0 if use_rslora else 2.0}
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    peft.eval()
    before = {k: v.clone() for k, v in peft.state_dict().items()}
    ids = tok(["What is 2 + 2? The answer is 4 because 2 + 2 = 4."], return_tensors="pt")["input_ids"]
    mask = torch.ones_like(ids)

    peft64 = copy.deepcopy(peft).double()
    merged = copy.deepcopy(model).double()
    sent = dict(full_state_items(peft64, torch.float64))
    assert list(sent) == list(merged.state_dict())
    merged.load_state_dict(sent)
    with torch.no_grad():
        lp_peft = get_per_token_logps(peft64, ids, mask, 4)
        lp_merged = get_per_token_logps(merged, ids, mask, 4)
        lp_base = get_per_token_logps(model.double(), ids, mask, 4)
    assert float((lp_peft - lp_merged).abs().max()) < 1e-10
    assert float((lp_peft - lp_base).abs().max()) > 1e-2  # the adapters do change the policy
    after = peft.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)  # read, not merged into
    assert not any(m.merged for m in peft.modules() if hasattr(m, "merged"))


@pytest.mark.parametrize("use_rslora", [False, True])
def test_the_adapter_alone_is_peft_s_own_adapter_and_the_base_goes_unmerged(tiny_model_dir, tmp_path, use_rslora):
    """lora_sync: adapter. What write_adapter leaves is an adapter peft itself loads back onto the base
    (the format vLLM's LoRA loader reads, use_rslora included) that computes the trained policy's log-probs
    to float64 rounding; each version replaces the last; the base push sends the base weights untouched."""
    from peft import PeftModel

    model, tok = _model(tiny_model_dir)
    peft = apply_lora(copy.deepcopy(model), r=4, alpha=8.0, dropout=0.0, target_modules="all-linear",
                      use_rslora=use_rslora)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    peft = peft.eval().double()
    assert adapter_rank(peft) == 4 and engine_lora_rank(4) == 8 and engine_lora_rank(8) == 8
    write_adapter(peft, tmp_path, 1, torch.float64)
    folder, nbytes = write_adapter(peft, tmp_path, 2, torch.float64)
    assert [p.name for p in tmp_path.iterdir()] == ["adapter-000002"] == [folder.name]
    lora_params = {n: p for n, p in peft.named_parameters() if "lora_" in n}
    assert nbytes == sum(p.numel() * 8 for p in lora_params.values())
    loaded = PeftModel.from_pretrained(copy.deepcopy(model).double(), str(folder)).eval()
    ids = tok(["What is 2 + 2? The answer is 4 because 2 + 2 = 4."], return_tensors="pt")["input_ids"]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        lp_trained = get_per_token_logps(peft, ids, mask, 4)
        lp_loaded = get_per_token_logps(loaded, ids, mask, 4)
    assert float((lp_trained - lp_loaded).abs().max()) < 1e-10
    base = dict(full_state_items(peft, torch.float64, merge_lora=False))
    assert list(base) == list(model.state_dict())
    assert all(torch.equal(t, model.state_dict()[k].double()) for k, t in base.items())


def test_what_vllm_cannot_take_as_an_adapter_is_one_line(tiny_model_dir):
    model, _ = _model(tiny_model_dir)
    with pytest.raises(ValueError, match="needs a LoRA policy"):
        adapter_rank(model)
    with pytest.raises(ValueError, match="ranks up to 512"):
        engine_lora_rank(ENGINE_LORA_RANKS[-1] + 1)
