"""Multi-turn episodes, token in and token out (issue 22): the rollout keeps the sampled ids, the trainer
scores exactly them, and environment tokens never reach the gradient."""

from __future__ import annotations

import threading

import torch

import ddp_step_worker as worker
from scripted_envs import STOPS, Scripted, model_turns
from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.core.step import MicroBatch
from maxent_grpo.envs.episodes import EpisodeLimits, run_episodes
from maxent_grpo.models import load_model_and_tokenizer
from maxent_grpo.rollout.backend import SamplingParams, pack_rollout
from maxent_grpo.rollout.hf import HFGenerationBackend


ROWS = [{"prompt": "count with me"}, {"prompt": "say something else"}]


def _episodes(model_dir, *, turns=3, max_new_tokens=6, factory=None, seed=0, dtype=torch.float32, **limits):
    model, tokenizer = load_model_and_tokenizer(str(model_dir), dtype=dtype)
    backend = HFGenerationBackend(model, tokenizer, seed=seed, share_prompts=False)
    lim = dict(max_turns=turns, max_model_tokens=100, max_episode_tokens=400, step_timeout_s=None) | limits
    batch = run_episodes(backend, tokenizer, ROWS, [factory or (lambda: Scripted(turns))] * len(ROWS), 2,
                         SamplingParams(max_new_tokens=max_new_tokens, stop=STOPS), EpisodeLimits(**lim))
    return model, tokenizer, batch


def test_a_three_turn_episode_is_the_sampled_ids_with_the_environment_masked(tiny_model_dir):
    _, tokenizer, batch = _three_turn_batch(tiny_model_dir)
    r = batch.rollout
    assert batch.kept_rows == [0, 1] and r.num_prompts == 2 and r.loss_masks is not None
    env_texts = []
    for ids, mask, logps in zip(r.completion_ids, r.loss_masks, r.behaviour_logps):
        env_texts.append(tokenizer.decode([t for t, m in zip(ids, mask) if m == 0], skip_special_tokens=False))
        assert all(lp == 0.0 for lp, m in zip(logps, mask) if m == 0)
        assert all(lp < 0.0 for lp, m in zip(logps, mask) if m == 1)
    # A turn ended by a stop string is closed as the template closes it, then the observation
    # and the next generation prompt follow, rendered by the chat template.
    assert any(t.startswith("<|im_end|>\n<|im_start|>user\nobservation 1: go on<|im_end|>\n<|im_start|>assistant\n")
               for t in env_texts)
    assert batch.stats["env/turns"] > 1 and batch.stats["env/env_tokens"] > 0
    # get_reward is asked once per episode, however it ended: an episode the environment ended
    # answered every model turn but the last.
    for mask, reason, reward in zip(r.loss_masks, r.finish_reasons, r.env_rewards):
        if reason == "stop":
            assert reward == model_turns(mask)


def test_limits_end_episodes_and_count_tokens_separately(tiny_model_dir):
    _, _, batch = _episodes(tiny_model_dir, turns=3, max_new_tokens=10, max_model_tokens=12, max_episode_tokens=30)
    r = batch.rollout
    assert all(sum(m) <= 12 and len(m) <= 30 for m in r.loss_masks)
    over = [fr for m, fr in zip(r.loss_masks, r.finish_reasons) if sum(m) == 12]
    assert all(fr == "length" for fr in over)


def test_a_failing_or_hanging_environment_drops_its_group(tiny_model_dir):
    calls = {"n": 0}

    class Flaky(Scripted):  # the second row's episodes break when they open
        def reset(self, row):
            calls["n"] += 1
            if calls["n"] > 2:
                raise RuntimeError("the environment broke")
            return super().reset(row)

    _, _, batch = _episodes(tiny_model_dir, max_new_tokens=10, factory=Flaky)
    assert batch.kept_rows == [0] and batch.rollout.num_prompts == 1
    assert len(batch.failures) == 2 and all("reset raised RuntimeError: the environment broke" in f
                                            for f in batch.failures)

    class Hangs(Scripted):
        def step(self, messages, assistant):
            threading.Event().wait(60)

    _, _, batch = _episodes(tiny_model_dir, max_new_tokens=10, factory=Hangs, step_timeout_s=2.0)
    # Every episode whose first turn reached the environment failed, and took its group with it.
    assert batch.failures and all(f.endswith("step: no answer within 2 s") for f in batch.failures)
    failed_rows = {int(f.split()[1].rstrip(":")) for f in batch.failures}
    assert not failed_rows & set(batch.kept_rows)


def _scored_against_sampler(model, batch):
    packed = pack_rollout(batch.rollout, 0)
    with torch.no_grad():
        logps, _ = Scoring(temperature=1.0, share_prompts=False).logps(
            model, packed.input_ids, packed.attention_mask, packed.prompt_length)
    m = packed.completion_mask
    return packed, ((logps - packed.behaviour_logps).abs() * m).max()


def _three_turn_batch(model_dir, dtype=torch.float32):
    """The first seed whose rollout holds an episode of three model turns (most seeds do)."""
    for seed in range(6):
        model, tokenizer, batch = _episodes(model_dir, turns=3, max_new_tokens=10, seed=seed, dtype=dtype)
        if any(model_turns(m) == 3 for m in batch.rollout.loss_masks):
            return model, tokenizer, batch
    raise AssertionError("no seed gave a three-turn episode")


def test_the_trainer_scores_a_multi_turn_episode_as_the_sampler_did(tiny_model_dir):
    """fp32: the trainer's log-probs of a 3-turn episode's model tokens equal the sampler's (no re-tokenising)."""
    model, _, batch = _three_turn_batch(tiny_model_dir)
    packed, err = _scored_against_sampler(model, batch)
    env_tokens = int((packed.attention_mask[:, packed.prompt_length:].float() - packed.completion_mask).sum())
    assert env_tokens > 0  # the episodes do hold environment tokens between model turns
    assert float(err) < 1e-4


def test_environment_tokens_get_no_gradient_float64(tiny_model_dir):
    """The step's gradient on episodes equals a float64 reference that sums the DAPO loss over the model's
    tokens only, row by row without padding; summing over the environment's tokens too gives another one."""
    model, _, batch = _three_turn_batch(tiny_model_dir, dtype=torch.float64)
    r, g = batch.rollout, batch.rollout.num_generations
    packed = pack_rollout(r, 0)
    adv = torch.linspace(-1.0, 1.0, r.num_completions, dtype=torch.float64)
    with torch.no_grad():
        old, _ = Scoring(temperature=1.0, share_prompts=False).logps(
            model, packed.input_ids, packed.attention_mask, packed.prompt_length)
    mb = MicroBatch(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                    prompt_length=packed.prompt_length, num_generations=g,
                    completion_mask=packed.completion_mask.double(), advantages=adv, old_logps=old)
    before = [p.detach().clone() for p in model.parameters()]
    worker.step(model, torch.optim.SGD(model.parameters(), lr=1.0), [mb], share_prompts=False, loss_type="dapo")
    step_grad = [b - p.detach() for b, p in zip(before, model.parameters())]
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)

    def reference(include_env: bool) -> list[torch.Tensor]:
        model.zero_grad()
        terms, count = [], 0
        for i, (ids, mask) in enumerate(zip(r.completion_ids, r.loss_masks)):
            prompt = r.prompt_ids[i // g]
            seq = torch.tensor([prompt + ids])
            logp = torch.log_softmax(model(input_ids=seq).logits[0].double(), -1)
            picked = [t for t, m in enumerate(mask) if m == 1 or include_env]
            count += len(picked)
            # ratio exp(logp - old) is 1 in value; its gradient is that of logp
            terms += [adv[i] * logp[len(prompt) + t - 1, ids[t]] for t in picked]
        (-torch.stack(terms).sum() / count).backward()
        return [p.grad.detach().clone() for p in model.parameters()]

    ref = reference(include_env=False)
    scale = max(float(x.abs().max()) for x in ref)
    assert max(float((a - b).abs().max()) for a, b in zip(step_grad, ref)) <= 1e-10 * scale
    with_env = reference(include_env=True)
    assert max(float((a - b).abs().max()) for a, b in zip(step_grad, with_env)) > 1e-3 * scale
