"""One forward per group (``core/packing.inline_prompt_inputs``, ``Scoring.inline_prompts``): each distinct
prompt once, its completions packed behind it in the same row, a completion seeing the prompt and itself
only. In float64 its completion log-probs, entropies and every parameter's gradient equal the padded
forward's (one row per completion), and the check fails for a completion that sees a sibling or a position
id one off."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from maxent_grpo.core.completion_logits import distinct_prompt_rows
from maxent_grpo.core.logprobs import Scoring, get_per_token_logps_and_entropies
from maxent_grpo.core.packing import inline_prompt_inputs, unpack_behind_prompt

_spec = importlib.util.spec_from_file_location("ddp_step_worker", Path(__file__).resolve().parents[1] / "ddp_step_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _model(tiny_model_dir, impl):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=impl).double().eval()


def _rows(model):
    """The worker's shared-prompt rows: 2 distinct prompts of different real lengths, ragged completions."""
    rows = worker.build_shared_rows(model)
    return rows["input_ids"], rows["attention_mask"], rows["completion_mask"]


def _weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2))


@pytest.mark.parametrize("impl, fused_head", [("sdpa", True), ("sdpa", False), ("eager", True)])
def test_one_forward_per_group_gives_the_padded_values_and_gradients(tiny_model_dir, impl, fused_head):
    model = _model(tiny_model_dir, impl)
    ids, mask, cmask = _rows(model)
    assert len(set(map(tuple, ids[:, : worker.PROMPT_LEN].tolist()))) == ids.shape[0] // worker.G
    a, b = _weights(cmask.shape, 7)

    def run(**layout):
        model.zero_grad()
        lp, h = get_per_token_logps_and_entropies(model, ids, mask, worker.PROMPT_LEN, temperature=0.7,
                                                  fused_head=fused_head, **layout)
        (cmask * (a * lp + b * h)).sum().backward()
        return lp.detach() * cmask, h.detach() * cmask, [p.grad.clone() for p in model.parameters()]

    inline = run(share_prompts=True, pack=True, inline_prompts=True)
    cached = run(share_prompts=True, pack=True)  # the same prompt work through a KV cache
    plain = run(share_prompts=False, pack=False)  # one padded row per completion
    # HF's RMSNorm rounds through float32, so rows computed in batches of other shapes agree to ~1e-8, not
    # to float64's last digits; a wrong mask or position is off by more than 1e-3 (the test below).
    for reference in (cached, plain):
        for x, y in zip(inline[:2], reference[:2]):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
        assert all(float(t.abs().max()) > 0 for t in reference[2])
        for x, y in zip(inline[2], reference[2]):
            assert float((x - y).abs().max()) <= 1e-5 * float(y.abs().max())


def _inline_logps(model, ids, mask, mutate=None):
    """Completion log-probs ``[B, T]`` from :func:`inline_prompt_inputs`'s inputs, after ``mutate(inputs, plan)``."""
    p = worker.PROMPT_LEN
    first, inverse = distinct_prompt_rows(ids[:, :p], mask[:, :p])
    inputs, plan, prompt_last = inline_prompt_inputs(ids, mask, p, first, inverse)
    if mutate is not None:
        mutate(inputs, plan)
    logits = model(**inputs, use_cache=False).logits
    last = logits[torch.arange(logits.shape[0]), prompt_last]
    out = unpack_behind_prompt(last, logits, plan, inverse, ids.shape[1] - p)
    return torch.log_softmax(out, -1).gather(-1, ids[:, p:, None])[..., 0]


def _sees_a_sibling(inputs, plan):
    """Row 1's completion tokens may also attend to row 0's (an earlier sibling in the same packed row)."""
    allowed = inputs["attention_mask"]
    for t in range(int(plan.length[1])):
        q = int(plan.offset[1]) + t
        allowed[plan.bin[0], 0, q, plan.offset[0]: plan.offset[0] + plan.length[0]] = True


def _position_one_off(inputs, plan):
    """Every completion token's position id one too large."""
    for row in range(len(plan.length)):
        s = int(plan.offset[row])
        inputs["position_ids"][plan.bin[row], s: s + int(plan.length[row])] += 1


@pytest.mark.parametrize("mutate", [_sees_a_sibling, _position_one_off])
def test_the_equality_fails_for_a_sibling_seen_or_a_position_one_off(tiny_model_dir, mutate):
    model = _model(tiny_model_dir, "sdpa")
    ids, mask, cmask = _rows(model)
    with torch.no_grad():
        plain, _ = get_per_token_logps_and_entropies(model, ids, mask, worker.PROMPT_LEN, with_entropy=False,
                                                     share_prompts=False)
        right = _inline_logps(model, ids, mask)
        wrong = _inline_logps(model, ids, mask, mutate)
    torch.testing.assert_close(right * cmask, plain * cmask, atol=1e-6, rtol=0)
    assert float(((wrong - plain) * cmask).abs().max()) > 1e-3


def test_the_packed_rows_hold_each_prompt_once_and_count_their_positions(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # Two rows share prompt [5, 6] (prompt_length 3, one left pad), one has its own; completions 2, 1, 0.
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [4, 5, 6, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    first, inverse = distinct_prompt_rows(ids[:, :3], mask[:, :3])
    inputs, plan, last = inline_prompt_inputs(ids, mask, 3, first, inverse)
    rows = {tuple(r) for r in inputs["input_ids"].tolist()}
    # [5, 6] then its completions [7, 8] and [9]; [4, 5, 6] then its empty completion's one slot (token 0).
    assert rows == {(5, 6, 7, 8, 9), (4, 5, 6, 0, 0)}
    by_prompt = {tuple(r[:2]): p for r, p in zip(inputs["input_ids"].tolist(), inputs["position_ids"].tolist())}
    assert by_prompt[(5, 6)] == [0, 1, 2, 3, 2] and by_prompt[(4, 5)][:4] == [0, 1, 2, 3]
    assert sorted(last.tolist()) == [1, 2]
    # The bins: 2 prompts x width 5 positions.
    scoring = Scoring(share_prompts=True, packing=True, inline_prompts=True)
    assert scoring.forward_positions(model, ids, mask, 3) == 2 * 5


def test_one_forward_per_group_runs_under_activation_checkpointing(tiny_model_dir):
    """A shared prompt's KV cache cannot be recomputed in the backward; the one-pass layout has no cache,
    so activation checkpointing recomputes it like any forward and gives the same gradients."""
    model = _model(tiny_model_dir, "sdpa")
    ids, mask, cmask = _rows(model)
    a, _ = _weights(cmask.shape, 11)

    def grads(checkpointing: bool, **layout):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
        else:
            model.gradient_checkpointing_disable()
            model.eval()
        model.zero_grad()
        lp, _ = get_per_token_logps_and_entropies(model, ids, mask, worker.PROMPT_LEN, with_entropy=False, **layout)
        (cmask * a * lp).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    inline = dict(share_prompts=True, pack=True, inline_prompts=True)
    recomputed, stored = grads(True, **inline), grads(False, **inline)
    for x, y in zip(recomputed, stored):
        assert float((x - y).abs().max()) <= 1e-12 * max(float(y.abs().max()), 1e-30)


def test_a_checkpointed_run_shares_its_prompts_and_trains_as_the_stored_one(tiny_model_dir, tmp_path):
    """``training.gradient_checkpointing`` on the CPU: ``auto`` shares prompts through the one-pass layout,
    and every step's loss, KL, entropy and gradient norm are those of the same run without checkpointing."""
    from maxent_grpo.cli import main
    from maxent_grpo.training.metrics import read_metrics
    from tiny_runs import tiny_overrides

    runs = {}
    for name, extra in (("stored", []), ("checkpointed", ["training.gradient_checkpointing=true"])):
        out = tmp_path / name
        args = tiny_overrides(tiny_model_dir, out, rewards="[{name: 'learnable_rewards:even_first_token'}]",
                              steps=3, extra=["loss.beta=0.04", *extra])
        assert main(["train", *args]) == 0
        runs[name] = read_metrics(out / "metrics.jsonl")
    for stored, checkpointed in zip(runs["stored"], runs["checkpointed"], strict=True):
        assert stored["tokens/policy_forward"] == checkpointed["tokens/policy_forward"] < stored["tokens/real"]
        for key in ("loss", "kl", "entropy", "grad_norm", "reward"):
            assert checkpointed[key] == pytest.approx(stored[key], rel=1e-5, abs=1e-7), key


def test_one_forward_per_group_gives_the_padded_values_and_gradients_under_lora(tiny_model_dir):
    """A LoRA-wrapped policy (peft): the adapters' gradients from the one-pass layout are the padded forward's."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(tiny_model_dir, "sdpa"), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)).double()
    ids, mask, cmask = _rows(model)
    a, _ = _weights(cmask.shape, 11)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and len(trained) < len(list(model.parameters()))

    def run(**layout):
        model.zero_grad()
        lp, _ = get_per_token_logps_and_entropies(model, ids, mask, worker.PROMPT_LEN, with_entropy=False, **layout)
        (cmask * a * lp).sum().backward()
        return lp.detach() * cmask, [p.grad.clone() for p in trained]

    inline, plain = run(share_prompts=True, pack=True, inline_prompts=True), run(share_prompts=False, pack=False)
    torch.testing.assert_close(inline[0], plain[0], atol=1e-6, rtol=0)
    assert all(float(g.abs().max()) > 0 for g in plain[1])
    for x, y in zip(inline[1], plain[1]):
        assert float((x - y).abs().max()) <= 1e-5 * float(y.abs().max())
