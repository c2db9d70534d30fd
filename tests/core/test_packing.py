"""Padding-free packing (``training.packing``, core/packing.py): where rows go, the packed inputs the
model sees, and that the completion log-probs, the loss and every parameter's gradient equal the padded
path's in float64, on ragged batches, for every registered policy loss, loss type and method."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from maxent_grpo.core.logprobs import Scoring, get_per_token_logps_and_entropies
from maxent_grpo.core.packing import pack_plan, packed_inputs, unpack_completion
from maxent_grpo.core.step import grpo_step
from maxent_grpo.methods import METHODS
from tiny_runs import compiled

_spec = importlib.util.spec_from_file_location("ddp_step_worker", Path(__file__).resolve().parents[1] / "ddp_step_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _mask(spans, width):
    """Rows with real tokens at ``[start, stop)``."""
    mask = torch.zeros(len(spans), width, dtype=torch.long)
    for i, (a, b) in enumerate(spans):
        mask[i, a:b] = 1
    return mask


# ---------------------------------------------------------------- the plan


def test_first_fit_decreasing_fills_bins_up_to_the_padded_width():
    # Lengths 6, 2, 4, 3, 1 in rows of 8 (the default capacity), longest first: the 6 opens bin 0,
    # the 4 opens bin 1, the 3 joins bin 1 (7), the 2 joins bin 0 (8), the 1 joins bin 1 (8).
    plan = pack_plan(_mask([(2, 8), (3, 5), (1, 5), (0, 3), (4, 5)], 8))
    assert plan.width == 8 and plan.bins == 2
    assert plan.bin.tolist() == [0, 0, 1, 1, 1]
    assert plan.offset.tolist() == [0, 6, 0, 4, 7]
    assert plan.start.tolist() == [2, 3, 1, 0, 4] and plan.length.tolist() == [6, 2, 4, 3, 1]
    # Every row's tokens fit in its bin, and no two rows of a bin overlap.
    for b in range(plan.bins):
        spans = sorted((int(plan.offset[i]), int(plan.offset[i] + plan.length[i])) for i in range(5) if plan.bin[i] == b)
        assert spans[-1][1] <= plan.width and all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))
    assert plan.computed_tokens == 16 < 5 * 8
    # With the longest row as the capacity: 6 | 4 + 2 | 3 + 1 -> three bins of 6.
    tight = pack_plan(_mask([(2, 8), (3, 5), (1, 5), (0, 3), (4, 5)], 8), capacity=6)
    assert (tight.bins, tight.width, tight.bin.tolist()) == (3, 6, [0, 1, 1, 2, 2])


def test_a_larger_capacity_packs_into_fewer_rows_and_the_plan_is_deterministic():
    mask = _mask([(0, 3)] * 6, 5)
    assert pack_plan(mask).bins == 6
    wide = pack_plan(mask, capacity=9)
    assert wide.bins == 2 and wide.width == 9
    assert wide.bin.tolist() == [0, 0, 0, 1, 1, 1] and wide.offset.tolist() == [0, 3, 6, 0, 3, 6]
    one = pack_plan(mask, capacity=18)  # flash attention: the whole micro-batch in one row
    assert (one.bins, one.width) == (1, 18)


@pytest.mark.parametrize("spans, match", [
    ([(0, 2), (1, 1)], "at least one real token"),
    ([(0, 4)], "capacity 3 is shorter"),
])
def test_bad_plans_are_refused(spans, match):
    with pytest.raises(ValueError, match=match):
        pack_plan(_mask(spans, 5), capacity=3 if "capacity" in match else None)


def test_a_mask_with_holes_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        pack_plan(torch.tensor([[1, 0, 1, 1]]))


def test_packed_inputs_restart_positions_and_keep_segments_apart():
    ids = torch.tensor([[0, 7, 8, 9], [5, 6, 0, 0], [0, 0, 4, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 0]])
    plan = pack_plan(mask, capacity=3)  # lengths 3, 2, 1 -> bins [row 0], [row 1, row 2]
    inputs = packed_inputs(ids, plan, pad_id=0)
    assert inputs["input_ids"].tolist() == [[7, 8, 9], [5, 6, 4]]
    assert inputs["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    allowed = inputs["attention_mask"][:, 0]
    assert allowed[0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # Row 2's token (bin 1, column 2) sees only itself, not row 1 before it.
    assert allowed[1].tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    additive = packed_inputs(ids, plan, mask="additive", mask_dtype=torch.float32)["attention_mask"]
    assert torch.equal(additive == 0, inputs["attention_mask"])
    assert float(additive.min()) == torch.finfo(torch.float32).min
    # Flash attention's varlen kernel gets no mask at all, only the restarting positions.
    bare = packed_inputs(ids, plan, mask=None)
    assert bare["attention_mask"] is None and torch.equal(bare["position_ids"], inputs["position_ids"])


def test_unpack_takes_the_position_before_each_completion_token():
    # prompt_length 2: completion token t of a row is predicted at padded position 1 + t.
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    plan = pack_plan(mask, capacity=6)  # one bin: row 0 at 0-2, row 1 at 3-5
    outputs = torch.arange(6.0).view(1, 6)  # each packed position's own index
    got = unpack_completion(outputs, plan, prompt_length=2, seq_len=4)
    # Row 0: padded positions 1, 2 are its tokens 0, 1 -> packed 0, 1. Row 1: positions 1, 2 are its
    # tokens 1, 2 -> packed 4, 5; its second completion slot is padding, given its last real output.
    assert got.tolist() == [[0.0, 1.0], [4.0, 5.0]]


# ---------------------------------------------------------------- through the model, float64


def _model(tiny_model_dir, impl):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=impl).double().eval()


@pytest.mark.parametrize("fused_head", [True, False])
def test_packed_logps_entropies_and_gradients_equal_the_padded_forward(tiny_model_dir, fused_head):
    model = _model(tiny_model_dir, "sdpa")
    rows = worker.build_rows(model)
    ids, mask, cmask = rows["input_ids"], rows["attention_mask"], rows["completion_mask"]
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randn(cmask.shape, generator=g, dtype=torch.float64) for _ in range(2))

    def run(pack):
        model.zero_grad()
        lp, h = get_per_token_logps_and_entropies(model, ids, mask, worker.PROMPT_LEN, temperature=0.7,
                                                  share_prompts=False, pack=pack, fused_head=fused_head)
        (cmask * (a * lp + b * h)).sum().backward()
        return lp.detach() * cmask, h.detach() * cmask, [p.grad.clone() for p in model.parameters()]

    packed, padded = run(True), run(False)
    torch.testing.assert_close(packed[0], padded[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(packed[1], padded[1], atol=1e-12, rtol=0)
    assert all(float(t.abs().max()) > 0 for t in padded[2])
    for x, y in zip(packed[2], padded[2]):
        assert float((x - y).abs().max()) <= 1e-12 * float(y.abs().max())


@pytest.mark.parametrize("impl, fused_head", [("sdpa", True), ("sdpa", False), ("eager", True)])
def test_completions_packed_behind_shared_prompts_equal_the_shared_padded_forward(tiny_model_dir, impl, fused_head):
    """Each distinct prompt once, its completions packed behind its KV cache: the log-probs,
    entropies and gradients of the shared-prompt forward over padded completions (the same prompt
    work, the same sums over the rows that share it), and the plain padded forward's values."""
    model = _model(tiny_model_dir, impl)
    rows = worker.build_shared_rows(model)
    ids, mask, cmask = rows["input_ids"], rows["attention_mask"], rows["completion_mask"]
    assert len(set(map(tuple, ids[:, : worker.PROMPT_LEN].tolist()))) == ids.shape[0] // worker.G
    assert bool((cmask.sum(1) < cmask.shape[1]).any())  # ragged completions: padding to remove
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randn(cmask.shape, generator=g, dtype=torch.float64) for _ in range(2))

    def run(pack, share):
        model.zero_grad()
        lp, h = get_per_token_logps_and_entropies(model, ids, mask, worker.PROMPT_LEN, temperature=0.7,
                                                  share_prompts=share, pack=pack, fused_head=fused_head)
        (cmask * (a * lp + b * h)).sum().backward()
        return lp.detach() * cmask, h.detach() * cmask, [p.grad.clone() for p in model.parameters()]

    both, shared, plain = run(True, True), run(False, True), run(False, False)
    for x, y in zip(both[:2], shared[:2]):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)
    for x, y in zip(both[:2], plain[:2]):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0)  # HF's RMSNorm rounds through float32
    assert all(float(t.abs().max()) > 0 for t in shared[2])
    for x, y in zip(both[2], shared[2]):
        assert float((x - y).abs().max()) <= 1e-12 * float(y.abs().max())


def test_an_empty_completion_keeps_one_slot_and_the_others_their_values(tiny_model_dir):
    model = _model(tiny_model_dir, "sdpa")
    rows = worker.build_shared_rows(model)
    ids, mask = rows["input_ids"].clone(), rows["attention_mask"].clone()
    mask[1, worker.PROMPT_LEN :] = 0  # row 1: no completion token at all
    with torch.no_grad():
        both, _ = get_per_token_logps_and_entropies(model, ids, mask, worker.PROMPT_LEN, with_entropy=False,
                                                    pack=True, share_prompts=True)
        shared, _ = get_per_token_logps_and_entropies(model, ids, mask, worker.PROMPT_LEN, with_entropy=False,
                                                      pack=False, share_prompts=True)
    cmask = mask[:, worker.PROMPT_LEN :].double()
    torch.testing.assert_close(both * cmask, shared * cmask, atol=1e-12, rtol=0)


def test_eager_attention_gets_an_additive_mask_and_the_unpadded_answer(tiny_model_dir):
    """Eager attention adds its mask to the scores; the packed rows must give each row's own,
    unpadded forward (the reference: one row at a time, no padding at all). Float64 weights, but
    transformers computes RoPE's cos and sin in float32, and on a CPU without AVX-512 the vectorised
    float32 sin and cos give other last bits for a tensor of another length (a packed row against a
    single one): 3e-8 here, where a wrong mask moves a log-prob by orders of magnitude more."""
    model = _model(tiny_model_dir, "eager")
    rows = worker.build_rows(model)
    ids, mask, cmask = rows["input_ids"], rows["attention_mask"], rows["completion_mask"]
    with torch.no_grad():
        lp, _ = get_per_token_logps_and_entropies(model, ids, mask, worker.PROMPT_LEN, with_entropy=False, pack=True,
                                                  share_prompts=False)
        for i in range(ids.shape[0]):
            real = ids[i][mask[i].bool()]
            start = int(mask[i].argmax())
            n = int(cmask[i].sum())
            if n == 0:
                continue
            logits = model(input_ids=real[None]).logits[0].double()
            p = worker.PROMPT_LEN - start  # the row's own prompt tokens
            ref = torch.log_softmax(logits[p - 1 : p - 1 + n], -1).gather(1, real[p : p + n, None])[:, 0]
            torch.testing.assert_close(lp[i, :n], ref, atol=1e-6, rtol=0)


def _cases():
    """(method, loss spec) for every registered method, compiled as a run would compile it."""
    out = []
    for name in sorted(METHODS):
        plan = compiled(None, [f"method={name}", "loss.beta=0.04", "loss.rollout_correction=none",
                                "data.source=modebench:pair_sum"])
        out.append(pytest.param(plan.method.loss, id=name))
    return out


@pytest.mark.parametrize("share", [False, True], ids=["rows", "behind_shared_prompts"])
@pytest.mark.parametrize("spec", _cases())
def test_every_method_steps_to_the_same_update_packed_or_padded(tiny_model_dir, spec, share):
    base = worker.load_model(str(tiny_model_dir))
    rows = worker.build_shared_rows(base) if share else worker.build_rows(base)
    gen = torch.Generator().manual_seed(11)
    n, g = len(worker.LENGTHS), worker.G
    extra = {"listwise_weights": torch.softmax(torch.randn(n // g, g, generator=gen, dtype=torch.float64), -1).reshape(-1)}
    mbs = worker.micro_batches(rows, [(0, 4), (4, 8)], **extra)
    mbs = [dataclasses.replace(mb, listwise_active=torch.tensor([True])) for mb in mbs]

    def step(packing):
        model = copy.deepcopy(base)
        before = [p.detach().clone() for p in model.parameters()]
        result = grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), mbs, spec,
                           Scoring(share_prompts=share, packing=packing))
        return result, [b - p.detach() for b, p in zip(before, model.parameters())]

    (r_pack, g_pack), (r_pad, g_pad) = step(True), step(False)
    scale = max(float(t.abs().max()) for t in g_pad)
    assert scale > 0
    assert max(float((x - y).abs().max()) for x, y in zip(g_pack, g_pad)) <= 1e-11 * scale
    assert r_pack.loss == pytest.approx(r_pad.loss, rel=1e-11, abs=1e-14)


def test_the_setting_reaches_the_scoring_of_every_pass():
    assert compiled(None, ["training.packing=true", "training.share_prompts=false"]).scoring.packing
    assert not compiled(None, ["training.packing=false"]).scoring.packing


def test_a_run_trains_packed_from_the_command_line(tiny_model_dir, tmp_path):
    """The tiny run with training.packing on: its first step (same samples: generation is unchanged)
    gives the padded run's loss and gradient norm up to float32 rounding."""
    from maxent_grpo.cli import main
    from maxent_grpo.training.metrics import read_metrics
    from tiny_runs import tiny_overrides

    first = {}
    for packing in ("true", "false"):
        out = tmp_path / packing
        args = tiny_overrides(tiny_model_dir, out, rewards="[{name: length, kwargs: {max_length: 100}}]", steps=2,
                              extra=[f"training.packing={packing}", "loss.beta=0.04"])
        assert main(["train", *args]) == 0
        first[packing] = read_metrics(out / "metrics.jsonl")[0]
    assert first["true"]["reward"] == first["false"]["reward"]
    assert first["true"]["loss"] == pytest.approx(first["false"]["loss"], rel=1e-4, abs=1e-6)
    assert first["true"]["grad_norm"] == pytest.approx(first["false"]["grad_norm"], rel=1e-4)
    assert first["true"]["tokens/real"] == first["false"]["tokens/real"]
    # share_prompts is on (the CPU's auto): the packed pass runs each prompt once (fewer positions than the
    # rows' real tokens) and no more completion positions than the padded one.
    assert first["true"]["tokens/policy_forward"] < first["true"]["tokens/real"]
    assert first["true"]["tokens/policy_forward"] <= first["false"]["tokens/policy_forward"]


def test_forward_positions_count_padding_shared_prompts_and_bins(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    # Two rows share prompt [5, 6] (prompt_length 3, one left pad), one has its own; completions 2, 1, 0.
    ids = torch.tensor([[0, 5, 6, 7, 8], [0, 5, 6, 9, 0], [4, 5, 6, 0, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    assert Scoring(share_prompts=False).forward_positions(model, ids, mask, 3) == 15
    assert Scoring(share_prompts=True).forward_positions(model, ids, mask, 3) == 2 * 3 + 3 * 2
    # Real lengths 4, 3, 3, capacity 5 (the padded width): [4], [3], [3] -> 3 bins, the widest 4.
    assert Scoring(packing=True, share_prompts=False).forward_positions(model, ids, mask, 3) == 12
    # Shared prompts, completions packed behind them: 2 distinct prompts x 3 positions; prompt [5, 6]'s
    # completions (2 and 1 tokens) need two bins of the completion width 2, and the other prompt's empty
    # completion keeps one slot in a bin of its own: 3 bins x width 2.
    assert Scoring(packing=True, share_prompts=True).forward_positions(model, ids, mask, 3) == 2 * 3 + 3 * 2
    # Flash attention (CUDA only: a stand-in carries its name) packs whole rows into one bin of the real
    # tokens, shared prompts or not: 4 + 3 + 3 positions.
    flash = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))
    assert Scoring(packing=True, share_prompts=True).forward_positions(flash, ids, mask, 3) == 10
