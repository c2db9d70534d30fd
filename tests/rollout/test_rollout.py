"""Generation backend and rollout records: HF sampling, behaviour log-probs, stops, packing, retries."""

from __future__ import annotations

import pytest
import torch

from maxent_grpo.core.logprobs import get_per_token_logps
from maxent_grpo.models import load_model_and_tokenizer
from maxent_grpo.rollout.backend import (
    Completion,
    PromptGroup,
    RolloutBatch,
    SamplingParams,
    build_rollout_batch,
    generate_groups,
    pack_rollout,
)
from maxent_grpo.rollout.hf import HFGenerationBackend

QUESTIONS = ["What is 3 + 4?", "Hi", "What is 12 + 9? Answer with a number."]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    model.requires_grad_(False)
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts(tiny):
    _, tok = tiny
    return [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]


def _recomputed_logps(model, packed, temperature):
    with torch.no_grad():
        return get_per_token_logps(
            model, packed.input_ids, packed.attention_mask, packed.prompt_length, temperature=temperature
        )


def _rollout(tiny, prompts, g, params, *, seed=0, batch_size=None):
    model, tok = tiny
    backend = HFGenerationBackend(model, tok, seed=seed, batch_size=batch_size)
    batch, dropped = generate_groups(backend, prompts, g, params)
    assert dropped == []
    return batch


# ---------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=4, temperature=0.0), "temperature"),
        (dict(max_new_tokens=4, temperature=float("nan")), "temperature"),
        (dict(max_new_tokens=4, top_p=0.0), "top_p"),
        (dict(max_new_tokens=4, top_p=1.5), "top_p"),
        (dict(max_new_tokens=4, top_k=-1), "top_k"),
        (dict(max_new_tokens=4, stop="</answer>"), "stop"),
        (dict(max_new_tokens=4, stop=("",)), "stop"),
        (dict(max_new_tokens=4, do_sample=1), "do_sample"),
    ],
)
def test_sampling_params_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_stop_list_becomes_tuple():
    assert SamplingParams(max_new_tokens=3, stop=["a", "b"]).stop == ("a", "b")


# ---------------------------------------------------------------- HF backend


def test_shapes_order_and_behaviour_logps_match_trainer(tiny, prompts):
    """Prompt-major layout, and generator log-probs = trainer recomputation on the packed batch."""
    model, tok = tiny
    temperature = 0.7
    g = 4
    batch = _rollout(tiny, prompts, g, SamplingParams(max_new_tokens=10, temperature=temperature, top_k=50, top_p=0.9))
    assert batch.num_prompts == 3 and batch.num_completions == 12 and batch.num_generations == g
    assert batch.prompts == prompts
    expected_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    assert batch.prompt_ids == expected_ids
    # prompts differ in length, so left padding is exercised
    assert len({len(p) for p in batch.prompt_ids}) == 3
    for ids, text in zip(batch.completion_ids, batch.completion_texts):
        assert text == tok.decode(ids, skip_special_tokens=True)

    packed = pack_rollout(batch, tok.pad_token_id)
    ref = _recomputed_logps(model, packed, temperature)
    gen = packed.behaviour_logps
    mask = packed.completion_mask.bool()
    assert torch.allclose(gen[mask], ref[mask], atol=1e-5, rtol=0)
    # top-k / top-p were applied when sampling but NOT to the log-probs: they are a full-softmax
    # distribution, so they are strictly negative and not all ~0
    assert (gen[mask] < 0).all()
    # the temperature matters: at T=1 the recomputation differs
    assert not torch.allclose(gen[mask], _recomputed_logps(model, packed, 1.0)[mask], atol=1e-3)


def test_prompt_major_groups_come_from_their_prompt(tiny, prompts):
    """Row p*G+j continues prompt p: its recomputed log-probs under a different prompt differ."""
    model, tok = tiny
    batch = _rollout(tiny, prompts[:2], 3, SamplingParams(max_new_tokens=6))
    swapped = RolloutBatch(
        prompts=batch.prompts[::-1],
        prompt_ids=batch.prompt_ids[::-1],
        completion_ids=batch.completion_ids,
        completion_texts=batch.completion_texts,
        finish_reasons=batch.finish_reasons,
        behaviour_logps=batch.behaviour_logps,
        num_generations=3,
    )
    right, wrong = pack_rollout(batch, tok.pad_token_id), pack_rollout(swapped, tok.pad_token_id)
    assert torch.allclose(right.behaviour_logps, _recomputed_logps(model, right, 1.0) * right.completion_mask, atol=1e-5)
    assert not torch.allclose(wrong.behaviour_logps, _recomputed_logps(model, wrong, 1.0) * wrong.completion_mask, atol=1e-3)


def test_truncation_gives_length_finish(tiny, prompts):
    batch = _rollout(tiny, prompts, 2, SamplingParams(max_new_tokens=3))
    eos = tiny[1].eos_token_id
    for ids, reason in zip(batch.completion_ids, batch.finish_reasons):
        if reason == "length":
            assert len(ids) == 3 and eos not in ids
        else:
            assert ids[-1] == eos and eos not in ids[:-1]
    assert "length" in batch.finish_reasons
    packed = pack_rollout(batch, tiny[1].pad_token_id)
    assert packed.truncated.tolist() == [r == "length" for r in batch.finish_reasons]


def test_eos_stop_keeps_eos_and_drops_the_rest(tiny, prompts):
    """A second eos id (as Qwen-style checkpoints have) ends completions at its first occurrence."""
    model, tok = tiny
    params = SamplingParams(max_new_tokens=12)
    free = _rollout(tiny, prompts, 3, params, seed=5)
    marker = free.completion_ids[0][4]  # a token we know row 0 samples
    original = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [tok.eos_token_id, marker]
    try:
        stopped = _rollout(tiny, prompts, 3, params, seed=5)
    finally:
        model.generation_config.eos_token_id = original
    saw_stop = False
    for full, free_reason, cut, reason, lps in zip(
        free.completion_ids, free.finish_reasons, stopped.completion_ids, stopped.finish_reasons, stopped.behaviour_logps
    ):
        if marker in full:
            k = full.index(marker) + 1
            assert cut == full[:k] and reason == "stop"
            saw_stop = True
        else:
            assert cut == full and reason == free_reason
        assert len(lps) == len(cut)
    assert saw_stop and len(stopped.completion_ids[0]) <= 5


def test_stop_strings_cut_after_the_completing_token(tiny, prompts):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=12, temperature=1.3)
    free = _rollout(tiny, prompts, 3, params, seed=11)
    row0 = free.completion_ids[0]
    # a stop string taken from the middle of row 0's text (whole characters, no special tokens)
    start = next(
        i
        for i in range(2, len(row0) - 2)
        if (t := tok.decode(row0[i : i + 2])).strip()
        and "\ufffd" not in t
        and t in tok.decode(row0, skip_special_tokens=True)
        and not set(row0[i : i + 2]) & set(tok.all_special_ids)
    )
    stop_text = tok.decode(row0[start : start + 2])
    stopped = _rollout(tiny, prompts, 3, SamplingParams(max_new_tokens=12, temperature=1.3, stop=(stop_text,)), seed=11)

    for full, free_reason, cut, reason, text in zip(
        free.completion_ids, free.finish_reasons, stopped.completion_ids, stopped.finish_reasons, stopped.completion_texts
    ):
        # the shortest prefix whose text contains the stop string, computed independently
        k = next((k for k in range(1, len(full) + 1) if stop_text in tok.decode(full[:k])), None)
        if k is None:
            assert cut == full and reason == free_reason
        else:
            assert cut == full[:k] and reason == "stop"
            assert stop_text in text  # kept in the text
    assert stopped.finish_reasons[0] == "stop" and len(stopped.completion_ids[0]) <= start + 2
    packed = pack_rollout(stopped, tok.pad_token_id)
    ref = _recomputed_logps(model, packed, 1.3)
    assert torch.allclose(packed.behaviour_logps, ref * packed.completion_mask, atol=1e-5)


def test_same_seed_same_samples_and_global_rng_untouched(tiny, prompts):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=8)
    state = torch.get_rng_state()
    a = _rollout(tiny, prompts, 2, params, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    b = _rollout(tiny, prompts, 2, params, seed=3)
    c = _rollout(tiny, prompts, 2, params, seed=4)
    assert a.completion_ids == b.completion_ids and a.behaviour_logps == b.behaviour_logps
    assert a.completion_ids != c.completion_ids
    # successive calls of one backend draw fresh samples
    backend = HFGenerationBackend(model, tok, seed=3)
    first = backend.generate(prompts, 2, params)
    second = backend.generate(prompts, 2, params)
    assert [c.token_ids for g in first for c in g.completions] != [c.token_ids for g in second for c in g.completions]
    # without a seed: the global torch RNG decides
    unseeded = HFGenerationBackend(model, tok)
    torch.manual_seed(123)
    d = unseeded.generate(prompts, 2, params)
    torch.manual_seed(123)
    e = unseeded.generate(prompts, 2, params)
    assert [c.token_ids for g in d for c in g.completions] == [c.token_ids for g in e for c in g.completions]


def _warped_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """float64 sampling probabilities from raw logits ``[V]``, written from the definitions in
    generate's (and vLLM's) order: divide by the temperature; keep the ``top_k`` most probable
    tokens and renormalise; of those, keep the smallest set of the most probable whose mass
    reaches ``top_p`` (at least one); renormalise."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True).tolist()
    if top_k:
        p[order[top_k:]] = 0.0
        p = p / p.sum()
    keep, mass = [], 0.0
    for i in order:
        if keep and mass >= top_p:
            break
        keep.append(i)
        mass += float(p[i])
    q = torch.zeros_like(p)
    q[keep] = p[keep]
    return q / q.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 5, 0.8), (1.3, 0, 1.0), (1.0, 3, 1.0), (0.9, 0, 0.6)])
def test_draws_follow_the_warped_distribution_and_logps_the_raw_one(tiny, prompts, temperature, top_k, top_p):
    """The first token of 4000 samples of one prompt against float64 probabilities computed from
    the definitions of temperature, top-k and top-p: no token outside their support, each of the
    most likely tokens (and the rest together) within 5 standard errors of its probability; the
    behaviour log-probs are log_softmax(raw logits / T), the unfiltered distribution."""
    model, tok = tiny
    n = 4000
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=11)
    drawn = HFGenerationBackend(model, tok).generate(prompts[:1], n, params)[0].completions
    ids = tok(prompts[:1], add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1].double()
    expected = _warped_reference(logits, temperature, top_k, top_p)
    tokens = torch.tensor([c.token_ids[0] for c in drawn])
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    assert counts[expected == 0].sum() == 0
    top = torch.argsort(expected, descending=True)[:8]
    rest = torch.ones_like(expected, dtype=torch.bool)
    rest[top] = False
    for observed, p in [*zip(counts[top].tolist(), expected[top].tolist()), (counts[rest].sum(), expected[rest].sum())]:
        assert abs(observed / n - p) <= 5 * (p * (1 - p) / n) ** 0.5 + 1e-12
    raw = torch.log_softmax(logits / temperature, -1)
    assert [c.logps[0] for c in drawn] == pytest.approx(raw[tokens].tolist(), abs=1e-5)


def test_draw_is_the_inverse_of_the_cumulative_sum():
    from maxent_grpo.rollout.hf import draw

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.25, 0.25, 0.0]])
    cases = {0.0: 1, 0.25: 1, 0.4999: 1, 0.5: 3, 0.7: 3, 0.75: 4, 0.9999: 4, 1.0: 4}  # 1.0: rounding's edge
    for u, token in cases.items():
        assert draw(probs, torch.tensor([u])).tolist() == [token], u
    # rows need not sum to 1, and each row has its own u
    two = torch.tensor([[2.0, 0.0, 2.0], [0.0, 0.0, 3.0]])
    assert draw(two, torch.tensor([0.6, 0.0])).tolist() == [2, 2]


def test_greedy_is_batch_size_invariant_and_groups_identical(tiny, prompts):
    params = SamplingParams(max_new_tokens=8, do_sample=False)
    whole = _rollout(tiny, prompts, 2, params)
    chunked = _rollout(tiny, prompts, 2, params, batch_size=4)
    assert whole.completion_ids == chunked.completion_ids
    for p in range(3):
        assert whole.completion_ids[2 * p] == whole.completion_ids[2 * p + 1]
    for a, b in zip(whole.behaviour_logps, chunked.behaviour_logps):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("batch_size", [None, 3])
def test_shared_prefill_samples_what_per_row_prefill_samples(tiny_model_dir, prompts, batch_size):
    """Prefilling each distinct prompt once (KV cache copied to its rows) draws the same tokens
    as generate's own per-row prefill, with the same behaviour log-probs (float64: to 1e-10).
    batch_size=3 with G=2 splits groups across generate calls."""
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    model = model.to(torch.float64).requires_grad_(False)
    params = SamplingParams(max_new_tokens=9, temperature=0.8)
    shared = HFGenerationBackend(model, tok, seed=5, batch_size=batch_size, share_prompts=True)
    plain = HFGenerationBackend(model, tok, seed=5, batch_size=batch_size, share_prompts=False)
    a = build_rollout_batch(shared.generate(prompts, 2, params), 2)
    b = build_rollout_batch(plain.generate(prompts, 2, params), 2)
    assert a.completion_ids == b.completion_ids
    for x, y in zip(a.behaviour_logps, b.behaviour_logps):
        assert x == pytest.approx(y, abs=1e-10)


def test_prefill_runs_each_distinct_prompt_once(tiny, prompts):
    from maxent_grpo.rollout.hf import distinct_rows

    model, tok = tiny
    ids = tok(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    assert distinct_rows(ids["input_ids"]) is None
    doubled = ids["input_ids"].repeat_interleave(2, 0), ids["attention_mask"].repeat_interleave(2, 0)
    assert distinct_rows(doubled[0]).tolist() == [0, 0, 1, 1, 2, 2]
    rows_run = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: rows_run.append(kwargs["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        for share in (True, False):
            cache = HFGenerationBackend(model, tok, share_prompts=share)._prefill(*doubled)
            assert cache.get_seq_length() == ids["input_ids"].shape[1] - 1
            assert cache.layers[0].keys.shape[0] == 6
    finally:
        hook.remove()
    assert rows_run == [3, 6]  # shared: each distinct prompt once; not shared: every row


def test_chunked_sampling_logps_match_trainer(tiny, prompts):
    model, tok = tiny
    batch = _rollout(tiny, prompts, 3, SamplingParams(max_new_tokens=7, temperature=0.9), batch_size=2)
    packed = pack_rollout(batch, tok.pad_token_id)
    assert torch.allclose(packed.behaviour_logps, _recomputed_logps(model, packed, 0.9) * packed.completion_mask, atol=1e-5)


def test_train_mode_restored_and_no_grad(tiny, prompts):
    model, tok = tiny
    backend = HFGenerationBackend(model, tok, seed=0)
    model.train()
    try:
        groups = backend.generate(prompts[:1], 2, SamplingParams(max_new_tokens=3))
        assert model.training
    finally:
        model.eval()
    backend.generate(prompts[:1], 1, SamplingParams(max_new_tokens=2))
    assert not model.training
    assert all(isinstance(x, float) for x in groups[0].completions[0].logps)
    backend.sync_weights(model)  # no-op for the HF backend


def test_bf16_generation_runs_in_model_dtype(tiny_model_dir, prompts):
    model, tok = load_model_and_tokenizer(tiny_model_dir, dtype="bfloat16")
    backend = HFGenerationBackend(model, tok, seed=0)
    groups = backend.generate(prompts[:2], 2, SamplingParams(max_new_tokens=5))
    assert model.dtype == torch.bfloat16
    batch = build_rollout_batch(groups, 2)
    packed = pack_rollout(batch, tok.pad_token_id)
    ref = _recomputed_logps(model, packed, 1.0)
    mask = packed.completion_mask.bool()
    # bf16 incremental decoding vs. one full forward: same distribution up to bf16 noise
    assert torch.isfinite(packed.behaviour_logps).all()
    assert (packed.behaviour_logps[mask] - ref[mask]).abs().max() < 0.1


def test_lora_policy_generates_and_matches_trainer(tiny_model_dir, prompts):
    from maxent_grpo.models import apply_lora

    model, tok = load_model_and_tokenizer(tiny_model_dir)
    peft_model = apply_lora(model, r=4, alpha=8, dropout=0.1)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.3)
    peft_model.train()
    backend = HFGenerationBackend(peft_model, tok, seed=2)
    batch = build_rollout_batch(backend.generate(prompts, 2, SamplingParams(max_new_tokens=6)), 2)
    assert peft_model.training  # restored
    peft_model.eval()  # dropout off for the comparison, as generation had it
    packed = pack_rollout(batch, tok.pad_token_id)
    ref = _recomputed_logps(peft_model, packed, 1.0)
    assert torch.allclose(packed.behaviour_logps, ref * packed.completion_mask, atol=1e-5)


def test_backend_argument_validation(tiny, prompts):
    model, tok = tiny
    with pytest.raises(ValueError, match="batch_size"):
        HFGenerationBackend(model, tok, batch_size=0)
    with pytest.raises(ValueError, match="seed"):
        HFGenerationBackend(model, tok, seed=-1)
    backend = HFGenerationBackend(model, tok)
    with pytest.raises(ValueError, match="num_generations"):
        backend.generate(prompts, 0, SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="prompts"):
        backend.generate([], 2, SamplingParams(max_new_tokens=2))


def test_checkpoint_generation_config_changes_no_draw(tiny, prompts):
    """Sampling is SamplingParams alone: settings a checkpoint's generation_config carries (which
    transformers' generate would apply) change nothing."""
    model, tok = tiny
    params = SamplingParams(max_new_tokens=6)
    plain = _rollout(tiny, prompts, 2, params, seed=7)
    config = model.generation_config
    saved = {k: getattr(config, k) for k in ("min_p", "top_k", "repetition_penalty", "temperature")}
    config.min_p, config.top_k, config.repetition_penalty, config.temperature = 0.3, 2, 5.0, 0.1
    try:
        changed = _rollout(tiny, prompts, 2, params, seed=7)
    finally:
        for k, v in saved.items():
            setattr(config, k, v)
    assert changed.completion_ids == plain.completion_ids and changed.behaviour_logps == plain.behaviour_logps


# ---------------------------------------------------------------- packing (pure)


def _handmade_batch():
    return RolloutBatch(
        prompts=["a", "b"],
        prompt_ids=[[5, 6, 7], [8]],
        completion_ids=[[1, 2], [3], [4, 9, 9, 2], []],
        completion_texts=["x", "y", "z", ""],
        finish_reasons=["stop", "length", "stop", "length"],
        behaviour_logps=[[-0.1, -0.2], [-0.3], [-0.4, -0.5, -0.6, -0.7], []],
        num_generations=2,
    )


def test_pack_rollout_layout_and_masks():
    pad = 0
    packed = pack_rollout(_handmade_batch(), pad)
    assert packed.prompt_length == 3
    assert packed.input_ids.tolist() == [
        [5, 6, 7, 1, 2, 0, 0],
        [5, 6, 7, 3, 0, 0, 0],
        [0, 0, 8, 4, 9, 9, 2],
        [0, 0, 8, 0, 0, 0, 0],
    ]
    assert packed.attention_mask.tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 1],
        [0, 0, 1, 0, 0, 0, 0],
    ]
    assert packed.completion_mask.dtype == torch.float32
    assert packed.completion_mask.tolist() == [[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert packed.completion_lengths.tolist() == [2, 1, 4, 0]
    assert packed.truncated.tolist() == [False, True, False, True]
    expected = [[-0.1, -0.2, 0, 0], [-0.3, 0, 0, 0], [-0.4, -0.5, -0.6, -0.7], [0, 0, 0, 0]]
    assert torch.allclose(packed.behaviour_logps, torch.tensor(expected))
    # the masks agree with each other: completion part of attention == completion mask
    assert torch.equal(packed.attention_mask[:, 3:].float(), packed.completion_mask)


def test_pack_rollout_without_logps_and_bad_pad():
    b = _handmade_batch()
    no_lp = RolloutBatch(**{**b.__dict__, "behaviour_logps": None})
    assert pack_rollout(no_lp, 0).behaviour_logps is None
    with pytest.raises(ValueError, match="pad_token_id"):
        pack_rollout(b, -1)


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(num_generations=3), "completion_ids"),
        (dict(prompt_ids=[[1]]), "prompt_ids"),
        (dict(finish_reasons=["stop", "eos", "stop", "stop"]), "finish_reasons"),
        (dict(behaviour_logps=[[-0.1], [-0.3], [-0.4, -0.5, -0.6, -0.7], []]), "behaviour_logps"),
        (dict(num_generations=0), "num_generations"),
    ],
)
def test_rollout_batch_validation(change, field):
    with pytest.raises(ValueError, match=field):
        RolloutBatch(**{**_handmade_batch().__dict__, **change})


def test_build_rollout_batch_rejects_mixed_logps():
    with_lp = Completion(token_ids=[1], text="a", finish_reason="stop", logps=[-1.0])
    without = Completion(token_ids=[1], text="a", finish_reason="stop")
    with pytest.raises(ValueError, match="log-probs"):
        build_rollout_batch([PromptGroup("p", [3], [with_lp, without])], 2)
    with pytest.raises(ValueError, match="finish_reason"):
        Completion(token_ids=[1], text="a", finish_reason="eos")


# ---------------------------------------------------------------- retries (§9)


class DroppingBackend:
    """Wraps the real HF backend and discards completions by a fixed plan: {(call, prompt): n_dropped}."""

    def __init__(self, inner, plan):
        self.inner = inner
        self.plan = plan
        self.calls: list[tuple[list[str], int]] = []

    def generate(self, prompts, num_generations, params):
        call = len(self.calls)
        self.calls.append((list(prompts), num_generations))
        groups = self.inner.generate(prompts, num_generations, params)
        out = []
        for grp in groups:
            n = self.plan.get((call, grp.prompt), 0)
            out.append(PromptGroup(grp.prompt, grp.prompt_ids, grp.completions[: max(0, len(grp.completions) - n)]))
        return out

    def sync_weights(self, policy):
        self.inner.sync_weights(policy)


def test_generate_groups_retries_and_drops(tiny, prompts):
    model, tok = tiny
    p0, p1, p2 = prompts
    g = 3
    # p0 loses one completion on every call (never completes); p1 loses two on the first call only
    plan = {(0, p0): 1, (1, p0): 1, (2, p0): 1, (3, p0): 1, (0, p1): 2}
    backend = DroppingBackend(HFGenerationBackend(model, tok, seed=7), plan)
    params = SamplingParams(max_new_tokens=5, temperature=0.8)
    batch, dropped = generate_groups(backend, prompts, g, params, max_retry_rounds=2)

    assert dropped == [0]
    assert batch.prompts == [p1, p2] and batch.num_completions == 2 * g
    # round 1 asks p0 for 1 and p1 for 2; round 2 asks p0 again; then it gives up
    assert backend.calls == [(prompts, g), ([p0], 1), ([p1], 2), ([p0], 1)]
    # retried completions are real samples of their prompt: log-probs still match the trainer
    packed = pack_rollout(batch, tok.pad_token_id)
    assert torch.allclose(packed.behaviour_logps, _recomputed_logps(model, packed, 0.8) * packed.completion_mask, atol=1e-5)

    backend = DroppingBackend(HFGenerationBackend(model, tok, seed=7), plan)
    batch, dropped = generate_groups(backend, prompts, g, params, max_retry_rounds=0)
    assert dropped == [0, 1] and batch.prompts == [p2] and len(backend.calls) == 1


def test_generate_groups_all_dropped_gives_empty_batch(tiny, prompts):
    model, tok = tiny
    plan = {(c, prompts[0]): 5 for c in range(3)}
    backend = DroppingBackend(HFGenerationBackend(model, tok, seed=0), plan)
    batch, dropped = generate_groups(backend, prompts[:1], 2, SamplingParams(max_new_tokens=2), max_retry_rounds=2)
    assert dropped == [0] and batch.num_prompts == 0 and batch.num_completions == 0
    with pytest.raises(ValueError, match="no completions"):
        pack_rollout(batch, 0)


def test_generate_groups_validation(tiny, prompts):
    backend = HFGenerationBackend(*tiny)
    with pytest.raises(ValueError, match="max_retry_rounds"):
        generate_groups(backend, prompts, 2, SamplingParams(max_new_tokens=2), max_retry_rounds=-1)
    with pytest.raises(ValueError, match="num_generations"):
        generate_groups(backend, prompts, 0, SamplingParams(max_new_tokens=2))
