"""``generation.vllm.lora_sync: adapter`` on vLLM's CPU build: a LoRA policy's adapter alone goes to
the engine each step (``vllm_weights.write_adapter``), for the colocated engine and the server.

After every push the engine samples the adapted policy at fp32 rounding (the bound of the merged push,
1e-4: vLLM's LoRA kernels compute ``x W + s (x A) B`` as the trainer does, in another order), not the base
and not the previous version, also for a prompt long enough to sit in vLLM's prefix cache; a server
holding another run's adapter under the same name is cleared first; a run trains through flat steps and a
reference pass with the sampler at that bound.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test.sh runs these tests in .venv-vllm")

from maxent_grpo.cli import main  # noqa: E402
from maxent_grpo.rollout.settings import VllmConfig  # noqa: E402
from maxent_grpo.rollout.vllm_colocate import AdapterPush, VLLMColocateBackend  # noqa: E402
from maxent_grpo.rollout.vllm_server import VLLMServerBackend, loaded_adapters  # noqa: E402
from maxent_grpo.training.metrics import read_metrics  # noqa: E402
from test_vllm import SAMPLING, _adapted_policy, _max_diff, _policy, _prompt, tokenizer_of  # noqa: E402
from tiny_runs import tiny_overrides  # noqa: E402
from vllm_servers import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.vllm

RANK = 4  # _adapted_policy's


@pytest.fixture(scope="module")
def tokenizer(vllm_model_dir):
    return tokenizer_of(vllm_model_dir)


def _prompts(tokenizer) -> list[str]:
    """A short prompt and one over two KV blocks (256+ tokens on CPU), which vLLM caches by prefix."""
    long_prompt = _prompt(tokenizer, " ".join(f"{i} + {i % 7} = {i + i % 7}." for i in range(60)))
    assert len(tokenizer(long_prompt, add_special_tokens=False)["input_ids"]) > 300
    return [_prompt(tokenizer), long_prompt]


def _follows_each_version(backend, model_dir, tokenizer) -> None:
    """Two versions of the adapter pushed in turn, the same prompts sampled after each."""
    prompts, pad = _prompts(tokenizer), tokenizer.pad_token_id
    first, second = _adapted_policy(model_dir, 0), _adapted_policy(model_dir, 1)
    backend.sync_weights(first)
    groups = backend.generate(prompts, 4, SAMPLING)
    assert _max_diff(first, groups, 4, pad) < 1e-4
    assert _max_diff(_policy(model_dir), groups, 4, pad) > 1e-2  # not the base
    backend.sync_weights(second)
    groups = backend.generate(prompts, 4, SAMPLING)
    assert _max_diff(second, groups, 4, pad) < 1e-4
    assert _max_diff(first, groups, 4, pad) > 1e-2  # not the last version, the long prompt included


def test_colocated_engine_samples_each_pushed_adapter(vllm_model_dir, tokenizer, tmp_path):
    engine = VLLMColocateBackend(vllm_model_dir, tokenizer, model_dtype=torch.float32,
                                 options=VllmConfig(enforce_eager=True), adapter=AdapterPush(RANK, tmp_path / "adapters"))
    try:
        _follows_each_version(engine, vllm_model_dir, tokenizer)
        # Each push is a new folder; the older one is gone.
        assert [p.name for p in (tmp_path / "adapters").iterdir()] == ["adapter-000002"]
    finally:
        del engine


def test_server_takes_each_adapter_and_clears_another_run_s(vllm_model_dir, tokenizer, tmp_path):
    proc, url = start_server(vllm_model_dir, tmp_path / "server.log", lora_rank=RANK)
    try:
        backend = VLLMServerBackend(url, tokenizer, sync_dir=tmp_path / "sync", dtype=torch.float32, lora_adapter=True)
        _follows_each_version(backend, vllm_model_dir, tokenizer)
        assert loaded_adapters(url) == ["policy-2"] and backend.model_name == "policy-2"
        # Another run on the same server: its first version bears a name the server holds no more, and its
        # base weights are pushed first (the server's were left as they were, by adapters alone).
        again = VLLMServerBackend(url, tokenizer, sync_dir=tmp_path / "sync2", dtype=torch.float32, lora_adapter=True)
        model = _adapted_policy(vllm_model_dir, 2)
        again.sync_weights(model)
        assert loaded_adapters(url) == ["policy-1"]
        groups = again.generate(_prompts(tokenizer), 4, SAMPLING)
        assert _max_diff(model, groups, 4, tokenizer.pad_token_id) < 1e-4
    finally:
        stop_server(proc)


def test_a_lora_run_with_adapter_sync_stays_the_sampled_policy(vllm_model_dir, tmp_path):
    """As the merged push's run test (issue 32): LoRA with its default dropout, a reference pass every step
    and zero-advantage steps after the first; after each step's adapter push the fp32 engine samples the
    trainer's policy within 1e-4 while the adapters move (KL to the reference > 0)."""
    out = tmp_path / "run"
    reward = "[{name: 'learnable_rewards:shortness_then_flat', kwargs: {calls: 1}}]"
    args = tiny_overrides(vllm_model_dir, out, rewards=reward, steps=4, extra=[
        "method=grpo", "generation.backend=vllm", "generation.vllm.enforce_eager=true",
        "generation.vllm.lora_sync=adapter", "model.lora.enabled=true", "training.learning_rate=0.01",
        "loss.beta=0.04",
    ])
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["kl"] > 0 for r in rows[1:])
    diffs = [r["sampling/sampling_logp_difference/max"] for r in rows]
    assert max(diffs) < 1e-4, diffs
