"""The float32 LM head (``model.lm_head_fp32``, core/fp32_head.py): under bf16 autocast the head's
logits are float32 arithmetic's, on the trainer's fused head, in the model's own forward and in a bf16
sampling copy; against a float64 reference built from the same hidden states and weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maxent_grpo.core.fp32_head import Float32Head, is_fp32_head, keep_head_float32, use_fp32_head
from maxent_grpo.core.fused_lm_head import lm_head_logps


def _case(seed=0, rows=12, hidden_size=64, vocab=257):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, hidden_size, generator=g) * 2).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=g).requires_grad_()
    bias = torch.randn(vocab, generator=g).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    return hidden, weight, bias, targets


def _reference(hidden, weight, bias, targets, temperature):
    logits = F.linear(hidden.double(), weight.double(), bias.double()) / temperature
    logsm = torch.log_softmax(logits, -1)
    return logsm.gather(-1, targets[:, None])[:, 0], -(logsm.exp() * logsm).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_head_in_float32_under_bf16_autocast_is_float32_arithmetic(temperature):
    hidden, weight, bias, targets = _case()
    ref_lp, ref_ent = _reference(hidden, weight, bias, targets, temperature)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = lm_head_logps(hidden, weight, bias, targets, temperature=temperature, with_entropy=True,
                                chunk_rows=5, fp32=True)
        lp_bf16, _ = lm_head_logps(hidden, weight, bias, targets, temperature=temperature, chunk_rows=5)
    err = float((lp.detach().double() - ref_lp).abs().max())
    assert err < 1e-4 and float((ent.detach().double() - ref_ent).abs().max()) < 1e-4
    # Without it the logits are bf16-rounded: the error the option removes is orders of magnitude larger.
    assert float((lp_bf16.detach().double() - ref_lp).abs().max()) > 100 * err

    coefs = [torch.randn(targets.shape, generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    ours = torch.autograd.grad((coefs[0] * lp).sum() + (coefs[1] * ent).sum(), (hidden, weight, bias))
    theirs = torch.autograd.grad((coefs[0].double() * ref_lp).sum() + (coefs[1].double() * ref_ent).sum(),
                                 (hidden, weight, bias))
    for o, t in zip(ours, theirs):
        assert o.dtype == torch.float32
        torch.testing.assert_close(o.double(), t.double(), atol=1e-4, rtol=1e-4)


def test_a_bf16_weight_is_upcast_exactly():
    # A frozen reference stored in bf16: its head logits are the float64 product of its bf16 values.
    hidden, weight, bias, targets = _case(seed=1)
    w16, b16 = weight.detach().bfloat16(), bias.detach().bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = lm_head_logps(hidden.detach().bfloat16(), w16, b16, targets, fp32=True)
    ref, _ = _reference(hidden.detach().bfloat16(), w16, b16, targets, 1.0)
    assert float((lp.double() - ref).abs().max()) < 1e-4


def _tiny(tiny_model_dir, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).eval()


def _final_hidden(model, ids):
    return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


def test_the_models_own_forward_gets_float32_logits_and_keeps_its_head(tiny_model_dir):
    model = _tiny(tiny_model_dir)
    head, keys = model.get_output_embeddings(), list(model.state_dict())
    assert model.config.tie_word_embeddings and head.weight is model.get_input_embeddings().weight
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model(input_ids=ids).logits
        use_fp32_head(model)
        logits = model(input_ids=ids).logits
        hidden = _final_hidden(model, ids)
    # The same module, parameters and state dict: wrappers, tied embeddings and checkpoints see no change.
    assert model.get_output_embeddings() is head and is_fp32_head(head) and isinstance(head, torch.nn.Linear)
    assert head.weight is model.get_input_embeddings().weight and list(model.state_dict()) == keys
    ref = F.linear(hidden.double(), head.weight.double())
    assert logits.dtype == torch.float32 and plain.dtype == torch.bfloat16
    err = float((logits.double() - ref).abs().max())
    assert err < 1e-5 < float((plain.double() - ref).abs().max())


def test_a_bf16_sampling_copy_keeps_the_trainers_head_weights_unrounded(tiny_model_dir):
    from maxent_grpo.models import load_tokenizer
    from maxent_grpo.rollout.backend import SamplingParams
    from maxent_grpo.rollout.hf import HFGenerationBackend

    policy = use_fp32_head(_tiny(tiny_model_dir))
    backend = HFGenerationBackend(policy, load_tokenizer(tiny_model_dir), dtype=torch.bfloat16, seed=0)
    copy = backend.model
    assert copy is not policy and copy.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    head = copy.get_output_embeddings()
    assert is_fp32_head(head) and head.weight.dtype == torch.float32
    assert head.weight is copy.get_input_embeddings().weight  # still tied
    with torch.no_grad():
        policy.get_output_embeddings().weight.add_(1e-3)  # an update smaller than bf16's step at these values
    backend.sync_weights(policy)
    assert torch.equal(head.weight, policy.get_output_embeddings().weight)
    ids = torch.randint(3, copy.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = copy(input_ids=ids).logits
        hidden = _final_hidden(copy, ids)
    # The embeddings' output is cast back to the copy's dtype, so the decoder runs in bf16 as before.
    assert hidden.dtype == torch.bfloat16 and logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), F.linear(hidden.double(), head.weight.double()), atol=1e-5, rtol=0)
    groups = backend.generate(["a"], 2, SamplingParams(max_new_tokens=3))
    assert len(groups[0].completions) == 2


def test_keep_head_float32_refuses_a_head_that_is_not_a_linear(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny(tiny_model_dir), LoraConfig(r=2, target_modules=["lm_head"], task_type="CAUSAL_LM"))
    with pytest.raises(ValueError, match="plain nn.Linear"):
        use_fp32_head(model)
    with pytest.raises(ValueError, match="plain nn.Linear"):
        keep_head_float32(model)
    assert not isinstance(model.get_output_embeddings(), Float32Head)
