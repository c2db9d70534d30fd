"""The vLLM generation backends, on vLLM's CPU build (``.venv-vllm``; ``scripts/test.sh`` runs them).

Real engines on a tiny model whose head size vLLM's CPU attention supports:
log-prob parity with the trainer, weight pushes (tied head, prefix cache),
seeds, stop strings, the bf16 mismatch, the server with disk sync, two
colocated processes, a short training run that learns, LoRA pushed merged
(and LoRA runs, one with the default dropout, flat steps and a reference
pass), ``maxent-grpo eval`` through the engine, and the CPU build's refusal
of sleep mode (whose sequencing tests/rollout/test_vllm_sleep.py checks).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test.sh runs these tests in .venv-vllm")

from maxent_grpo.cli import main  # noqa: E402
from maxent_grpo.core.logprobs import get_per_token_logps  # noqa: E402
from maxent_grpo.core.rollout_correction import mismatch_metrics, rollout_mismatch_sums  # noqa: E402
from maxent_grpo.rollout.backend import SamplingParams, build_rollout_batch, pack_rollout  # noqa: E402
from maxent_grpo.rollout.vllm_weights import full_state_items  # noqa: E402
from maxent_grpo.rollout.settings import VllmConfig  # noqa: E402
from maxent_grpo.rollout.vllm_colocate import VLLMColocateBackend  # noqa: E402
from maxent_grpo.rollout.vllm_server import VLLMServerBackend  # noqa: E402
from maxent_grpo.training.metrics import read_metrics  # noqa: E402
from tiny_runs import tiny_overrides  # noqa: E402
from vllm_servers import free_port, start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.7
EAGER = VllmConfig(enforce_eager=True)  # an engine that starts in seconds on the CPU


@pytest.fixture(scope="module")
def tokenizer(vllm_model_dir):
    return tokenizer_of(vllm_model_dir)


def tokenizer_of(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _policy(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _perturbed_policy(model_dir, seed):
    """The policy with every weight (the tied embedding / head included) moved a little."""
    model = _policy(model_dir)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def engine(vllm_model_dir, tokenizer):
    return VLLMColocateBackend(vllm_model_dir, tokenizer, model_dtype=torch.float32, options=EAGER)


def _prompt(tokenizer, text="What is 3 + 4?"):
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def _trainer_vs_sampler(model, groups, g, pad_id):
    """(trainer log-probs, sampler log-probs, mask) of the sampled completions."""
    packed = pack_rollout(build_rollout_batch(groups, g), pad_id)
    with torch.no_grad():
        lp = get_per_token_logps(model, packed.input_ids, packed.attention_mask, packed.prompt_length,
                                 temperature=TEMPERATURE)
    return lp, packed.behaviour_logps, packed.completion_mask


def _max_diff(model, groups, g, pad_id) -> float:
    lp, behaviour, mask = _trainer_vs_sampler(model, groups, g, pad_id)
    assert mask.sum() > 0
    return float(((lp - behaviour).abs() * mask).max())


SAMPLING = SamplingParams(max_new_tokens=12, temperature=TEMPERATURE)


def test_fp32_logprobs_match_the_trainer(engine, vllm_model_dir, tokenizer):
    """processed_logprobs: the sampler's log-probs are the trainer's at temperature != 1."""
    model = _policy(vllm_model_dir)
    groups = engine.generate([_prompt(tokenizer), _prompt(tokenizer, "What is 10 + 2?")], 4, SAMPLING)
    assert [len(g.completions) for g in groups] == [4, 4]
    assert _max_diff(model, groups, 4, tokenizer.pad_token_id) < 1e-5


def test_weight_push_then_generation_follows_the_new_weights(engine, vllm_model_dir, tokenizer):
    """Perturb every weight (the tied embedding / head included), push, and sample from the new model."""
    model = _perturbed_policy(vllm_model_dir, 0)
    assert "lm_head.weight" in dict(full_state_items(model))  # the tied head is pushed explicitly
    try:
        engine.sync_weights(model)
        groups = engine.generate([_prompt(tokenizer)], 4, SAMPLING)
        assert _max_diff(model, groups, 4, tokenizer.pad_token_id) < 1e-5
        # and not the old weights
        assert _max_diff(_policy(vllm_model_dir), groups, 4, tokenizer.pad_token_id) > 1e-2
    finally:
        engine.sync_weights(_policy(vllm_model_dir))


def test_head_only_change_reaches_the_engine(engine, vllm_model_dir, tokenizer):
    """A change to the tied embedding alone must reach the output head (a named_parameters() push misses it)."""
    model = _policy(vllm_model_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)
    try:
        engine.sync_weights(model)
        groups = engine.generate([_prompt(tokenizer)], 4, SAMPLING)
        assert _max_diff(model, groups, 4, tokenizer.pad_token_id) < 1e-5
    finally:
        engine.sync_weights(_policy(vllm_model_dir))


def test_long_prompt_is_not_served_from_a_stale_prefix_cache(engine, vllm_model_dir, tokenizer):
    """Prompts over two KV blocks (256+ tokens on CPU) are cached; a push must drop them."""
    long_prompt = _prompt(tokenizer, " ".join(f"{i} + {i % 7} = {i + i % 7}." for i in range(60)))
    assert len(tokenizer(long_prompt, add_special_tokens=False)["input_ids"]) > 300
    engine.generate([long_prompt], 2, SAMPLING)  # fills the prefix cache under the old weights
    model = _perturbed_policy(vllm_model_dir, 1)
    try:
        engine.sync_weights(model)
        groups = engine.generate([long_prompt], 2, SAMPLING)
        assert _max_diff(model, groups, 2, tokenizer.pad_token_id) < 1e-5
    finally:
        engine.sync_weights(_policy(vllm_model_dir))


def test_seeds_come_from_torch_rng(engine, tokenizer):
    """Same torch seed, same samples (a resumed step repeats itself); another seed, other samples."""
    prompts = [_prompt(tokenizer)]

    def sample(seed):
        torch.manual_seed(seed)
        return [c.token_ids for c in engine.generate(prompts, 4, SAMPLING)[0].completions]

    first, again, other = sample(3), sample(3), sample(4)
    assert first == again
    assert first != other
    assert len({tuple(t) for t in first}) > 1  # the n samples of a request differ


def test_stop_string_is_kept_and_ends_the_completion(engine, tokenizer):
    params = SamplingParams(max_new_tokens=24, temperature=TEMPERATURE, stop=("1",))
    torch.manual_seed(0)
    comps = [c for g in engine.generate([_prompt(tokenizer)] * 4, 4, params) for c in g.completions]
    stopped = [c for c in comps if c.finish_reason == "stop"]
    assert stopped, "no sample produced the stop string"
    for c in stopped:
        assert "1" in c.text
        # the last token completed the stop string: without it the text has none
        prefix = tokenizer.decode(c.token_ids[:-1], skip_special_tokens=True)
        assert "1" not in prefix or c.token_ids[-1] == tokenizer.eos_token_id


def test_a_three_turn_episode_scores_as_the_engine_sampled_it(engine, vllm_model_dir, tokenizer):
    """Multi-turn episodes through vLLM (issue 22): each turn continues from the episode's token ids, so the
    fp32 trainer's log-probs of every model token equal the engine's; environment tokens are masked."""
    from maxent_grpo.envs.episodes import EpisodeLimits, run_episodes
    from scripted_envs import STOPS, Scripted, model_turns

    model = _policy(vllm_model_dir)
    engine.sync_weights(model)  # earlier tests pushed other weights
    rows = [{"prompt": "count with me"}, {"prompt": "say something else"}]
    params = SamplingParams(max_new_tokens=10, temperature=TEMPERATURE, stop=STOPS)
    for seed in range(6):
        torch.manual_seed(seed)
        batch = run_episodes(engine, tokenizer, rows, [lambda: Scripted(3)] * 2, 2, params,
                             EpisodeLimits(max_turns=3, max_model_tokens=100, max_episode_tokens=400,
                                           step_timeout_s=None))
        if any(model_turns(m) == 3 for m in batch.rollout.loss_masks):
            break
    else:
        raise AssertionError("no seed gave a three-turn episode")
    packed = pack_rollout(batch.rollout, tokenizer.pad_token_id)
    with torch.no_grad():
        lp = get_per_token_logps(model, packed.input_ids, packed.attention_mask, packed.prompt_length,
                                 temperature=TEMPERATURE)
    mask = packed.completion_mask
    assert int((packed.attention_mask[:, packed.prompt_length:].float() - mask).sum()) > 0  # environment tokens
    assert float(((lp - packed.behaviour_logps).abs() * mask).max()) < 1e-5


def _adapted_policy(model_dir, seed):
    """The fp32 policy with LoRA adapters (q/k/v/o and the MLP) moved away from zero, as training would."""
    from maxent_grpo.models import apply_lora

    model = apply_lora(_policy(model_dir), r=4, alpha=8.0, dropout=0.0,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def test_lora_push_sends_the_merged_weights_and_leaves_the_adapters_apart(engine, vllm_model_dir, tokenizer):
    """After the push the engine samples the adapted policy (its log-probs within fp32 tolerance of the
    peft model's), not the base; the trained peft model is left as it was (adapters unmerged).

    The tolerance is 1e-4, not the 1e-5 of an unadapted push: the trainer computes
    ``x W + s (x A) B`` and the engine ``x (W + s B A)``, equal in exact arithmetic, rounded
    differently in fp32 (1.4e-5 seen here). That the merge is exact is checked in float64."""
    model = _adapted_policy(vllm_model_dir, 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sent = dict(full_state_items(copy.deepcopy(model).double(), torch.float64))
    plain = _policy(vllm_model_dir).double()
    assert set(sent) == set(plain.state_dict())  # the base model's names, no lora_* tensors
    plain.load_state_dict(sent)
    try:
        engine.sync_weights(model)
        groups = engine.generate([_prompt(tokenizer), _prompt(tokenizer, "What is 10 + 2?")], 4, SAMPLING)
        assert _max_diff(model, groups, 4, tokenizer.pad_token_id) < 1e-4
        assert _max_diff(_policy(vllm_model_dir), groups, 4, tokenizer.pad_token_id) > 1e-2
        # The merged weights are the adapted policy: in float64 the two forwards agree to rounding.
        lp_merged, _, mask = _trainer_vs_sampler(plain, groups, 4, tokenizer.pad_token_id)
        lp_peft, _, _ = _trainer_vs_sampler(copy.deepcopy(model).double(), groups, 4, tokenizer.pad_token_id)
        assert float(((lp_merged - lp_peft).abs() * mask).max()) < 1e-10
    finally:
        engine.sync_weights(_policy(vllm_model_dir))
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert not any(m.merged for m in model.modules() if hasattr(m, "merged"))


# The last test on the module's `engine`: deleting its second engine tears down the
# process's vLLM distributed state, which the first one shares.
def test_bf16_sampler_shows_a_mismatch_and_fp32_none(engine, vllm_model_dir, tokenizer):
    model = _policy(vllm_model_dir)
    prompts = [_prompt(tokenizer), _prompt(tokenizer, "What is 10 + 2?")]
    fp32 = mismatch_metrics(rollout_mismatch_sums(*_trainer_vs_sampler(
        model, engine.generate(prompts, 4, SAMPLING), 4, tokenizer.pad_token_id)))
    bf16_engine = VLLMColocateBackend(vllm_model_dir, tokenizer, model_dtype=torch.float32,
                                      sample_dtype=torch.bfloat16, options=EAGER)
    bf16 = mismatch_metrics(rollout_mismatch_sums(*_trainer_vs_sampler(
        model, bf16_engine.generate(prompts, 4, SAMPLING), 4, tokenizer.pad_token_id)))
    del bf16_engine
    assert fp32["sampling/sampling_logp_difference/max"] < 1e-5
    assert abs(fp32["token_mult_prob_error"] - 1) < 1e-5
    assert bf16["sampling/sampling_logp_difference/max"] > 1e-3
    assert bf16["token_mult_prob_error"] > 1 + 1e-4
    assert bf16["gen_kl_error"] > 0


def test_a_float32_head_reaches_a_bf16_engine(vllm_model_dir, tokenizer):
    """model.lm_head_fp32 with a vLLM sampler: the engine's logits processor runs the head in float32
    (vLLM's head_dtype), while the rest of the engine stays bf16."""
    engine = VLLMColocateBackend(vllm_model_dir, tokenizer, model_dtype=torch.float32, sample_dtype=torch.bfloat16,
                                 options=EAGER, head_fp32=True)
    try:
        assert engine.llm.llm_engine.model_config.head_dtype == torch.float32
        dtypes = engine.llm.collective_rpc(
            lambda worker: (worker.model_runner.model.logits_processor.head_dtype,
                            next(worker.model_runner.model.parameters()).dtype))
        assert dtypes == [(torch.float32, torch.bfloat16)]
        groups = engine.generate([_prompt(tokenizer)], 2, SAMPLING)
        assert all(c.logps and all(math.isfinite(x) for x in c.logps) for c in groups[0].completions)
    finally:
        del engine


# ------------------------------------------------------------------ LoRA


def test_training_with_lora_and_vllm(vllm_model_dir, tmp_path):
    """LoRA with generation.backend: vllm: the adapters train, every step's push reaches the engine
    (the fp32 sampler stays the policy after the adapters have moved)."""
    out = tmp_path / "run"
    args = tiny_overrides(vllm_model_dir, out, rewards="[{name: 'learnable_rewards:shortness'}]", steps=2, extra=[
        "method=grpo", "generation.backend=vllm", "generation.vllm.enforce_eager=true",
        "model.lora.enabled=true", "model.lora.dropout=0.0", "training.learning_rate=0.05",
    ])
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows)


def test_lora_with_default_dropout_stays_the_sampled_policy_through_flat_steps_and_the_reference(
        vllm_model_dir, tmp_path):
    """Issue 32: LoRA with its default dropout (0.05), a reference pass every step (loss.beta > 0: the
    base model, adapters disabled) and zero-advantage steps after the first. After each step's push the
    fp32 engine samples the trainer's policy at fp32 rounding, the full fine-tune's bound (1e-4), while the
    adapters have moved (KL to the reference > 0). With peft's dropout on in the trainer's forward the
    difference grew with every step (max 0.02-0.07 per token)."""
    out = tmp_path / "run"
    reward = "[{name: 'learnable_rewards:shortness_then_flat', kwargs: {calls: 1}}]"
    args = tiny_overrides(vllm_model_dir, out, rewards=reward, steps=5, extra=[
        "method=grpo", "generation.backend=vllm", "generation.vllm.enforce_eager=true",
        "model.lora.enabled=true", "training.learning_rate=0.01", "loss.beta=0.04",
    ])
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[-1]["skipped/no_signal"] == 4  # steps 2-5: every advantage 0
    assert all(r["kl"] > 0 for r in rows[1:])  # the adapters moved away from the base
    diffs = [r["sampling/sampling_logp_difference/max"] for r in rows]
    assert max(diffs) < 1e-4, diffs


# ------------------------------------------------------------------ sleep mode, eval


def test_sleep_mode_is_refused_on_the_cpu_build(vllm_model_dir, tokenizer):
    """Why tests/rollout/test_vllm_sleep.py drives the sequence against a stand-in: vLLM refuses here;
    and a run asking for it on this device gets one line naming the key."""
    with pytest.raises(Exception, match="Sleep mode is not supported on current platform"):
        VLLMColocateBackend(vllm_model_dir, tokenizer, model_dtype=torch.float32,
                            options=VllmConfig(enforce_eager=True, enable_sleep_mode=True))
    from maxent_grpo.errors import ConfigError
    from maxent_grpo.rollout.backends import BACKENDS

    with pytest.raises(ConfigError, match="generation.vllm.enable_sleep_mode"):
        BACKENDS["vllm"].check(VllmConfig(enable_sleep_mode=True), str(vllm_model_dir))


def test_eval_command_through_the_vllm_backend(vllm_model_dir, tmp_path):
    """`maxent-grpo eval` with generation.backend=vllm completes, writes its metrics, and its greedy
    completions are HF's (fp32 engine and model: the same argmax at every position)."""
    summaries, records = {}, {}
    for backend in ("vllm", "hf"):
        out = tmp_path / backend
        args = ["eval", str(vllm_model_dir), "--output", str(out), "-k", "2", "--num-prompts", "3"]
        for kv in ("model.dtype=float32", "generation.dtype=null", "data.source=reasoning_gym:chain_sum",
                   "data.size=16", "data.task_kwargs={}", "generation.max_new_tokens=8",
                   "generation.vllm.enforce_eager=true", f"generation.backend={backend}",
                   "rewards=[{name: 'learnable_rewards:shortness'}]"):
            args += ["--set", kv]
        assert main(args) == 0
        summaries[backend] = json.loads((out / "summary.json").read_text())
        records[backend] = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert {"pass@1", "pass@2", "mean@1", "mean@2"} <= summaries["vllm"].keys()
    assert len(records["vllm"]) == len(records["hf"]) == 3 * 2 + 3
    greedy = {b: [r for r in rs if r["mode"] == "greedy"] for b, rs in records.items()}
    assert len(greedy["vllm"]) == 3
    assert [r["completion"] for r in greedy["vllm"]] == [r["completion"] for r in greedy["hf"]]


# ------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def server(vllm_model_dir, tmp_path_factory):
    """Started by the documented command (``maxent-grpo serve``), with its own CPU KV-cache default."""
    proc, url = start_server(vllm_model_dir, tmp_path_factory.mktemp("server") / "server.log")
    yield url
    stop_server(proc)


def test_server_generates_and_takes_weights_from_disk(server, vllm_model_dir, tokenizer, tmp_path):
    backend = VLLMServerBackend(server, tokenizer, sync_dir=tmp_path / "sync")
    model = _policy(vllm_model_dir)
    groups = backend.generate([_prompt(tokenizer), _prompt(tokenizer, "What is 10 + 2?")], 4, SAMPLING)
    assert [len(g.completions) for g in groups] == [4, 4]
    assert _max_diff(model, groups, 4, tokenizer.pad_token_id) < 1e-5
    model = _perturbed_policy(vllm_model_dir, 2)
    backend.sync_weights(model)
    assert [p.name for p in (tmp_path / "sync").iterdir()] == ["weights-000001"]  # written whole, one kept
    groups = backend.generate([_prompt(tokenizer)], 4, SAMPLING)
    assert _max_diff(model, groups, 4, tokenizer.pad_token_id) < 1e-5
    backend.sync_weights(_policy(vllm_model_dir))
    assert [p.name for p in (tmp_path / "sync").iterdir()] == ["weights-000002"]


def test_server_takes_lora_merged_and_the_disk_sync_writes_the_engine_dtype(server, vllm_model_dir, tokenizer,
                                                                           tmp_path):
    from safetensors import safe_open

    lora = _adapted_policy(vllm_model_dir, 1)
    backend = VLLMServerBackend(server, tokenizer, sync_dir=tmp_path / "fp32", dtype=torch.float32)
    try:
        backend.sync_weights(lora)
        groups = backend.generate([_prompt(tokenizer)], 4, SAMPLING)
        assert _max_diff(lora, groups, 4, tokenizer.pad_token_id) < 1e-4  # the adapted policy (see the LoRA test)
        assert _max_diff(_policy(vllm_model_dir), groups, 4, tokenizer.pad_token_id) > 1e-2
        bf16 = VLLMServerBackend(server, tokenizer, sync_dir=tmp_path / "bf16", dtype=torch.bfloat16)
        bf16.sync_weights(_policy(vllm_model_dir))
        with safe_open(str(next((tmp_path / "bf16").glob("weights-*/model.safetensors"))), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
            assert "lm_head.weight" in f.keys()
    finally:
        backend.sync_weights(_policy(vllm_model_dir))


def test_unreachable_server_is_one_line(vllm_model_dir, tmp_path, capsys):
    args = tiny_overrides(vllm_model_dir, tmp_path / "run", rewards="[{name: boxed_accuracy}]", extra=[
        "generation.backend=vllm_server", f"generation.vllm.server_url=http://127.0.0.1:{free_port()}",
        "generation.vllm.request_timeout_s=5",
    ])
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("maxent-grpo:")]
    assert len(ours) == 1 and "127.0.0.1" in ours[0] and "Traceback" not in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


# ------------------------------------------------------------------ training


def test_training_with_vllm_learns(vllm_model_dir, tmp_path):
    """The learnable task of test_train, sampled by an in-process engine: the reward rises."""
    out = tmp_path / "run"
    args = tiny_overrides(vllm_model_dir, out, rewards="[{name: 'learnable_rewards:shortness'}]", steps=16, extra=[
        "method=grpo",
        "generation.backend=vllm",
        "generation.vllm.enforce_eager=true",
        "generation.max_new_tokens=16",
        "generation.num_generations=8",
        "training.prompts_per_step=4",
        "training.micro_batch_size=8",
        "training.learning_rate=0.01",
        "loss.rollout_correction=token_truncate",
    ])
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    rewards = [r["reward"] for r in rows]
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.3, rewards
    # fp32 engine and trainer: the sampler is the policy, step after step (weights pushed every step)
    assert max(r["sampling/sampling_logp_difference/max"] for r in rows) < 1e-4
    # The trained model ends early: completions that stopped end with the EOS token, scored like the rest.
    final = out / "checkpoints" / "step-16"
    engine = VLLMColocateBackend(final, tokenizer_of(final), model_dtype=torch.float32, options=EAGER)
    tok = tokenizer_of(final)
    groups = engine.generate([_prompt(tok)] * 2, 8, SamplingParams(max_new_tokens=16, temperature=TEMPERATURE))
    stopped = [c for g in groups for c in g.completions if c.finish_reason == "stop"]
    assert stopped
    assert all(c.token_ids[-1] == tok.eos_token_id for c in stopped)
    assert _max_diff(_policy(final), groups, 8, tok.pad_token_id) < 1e-5


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_colocated_processes(vllm_model_dir, tmp_path, strategy):
    """torchrun, two ranks, one engine each (external_launcher): both engines sample and take weight pushes,
    from a whole model (DDP) or gathered from shards (FSDP2, DTensor.full_tensor per weight)."""
    out = tmp_path / "run"
    args = tiny_overrides(vllm_model_dir, out, rewards="[{name: 'learnable_rewards:shortness'}]", steps=2, extra=[
        "generation.backend=vllm", "generation.vllm.enforce_eager=true", f"training.strategy={strategy}",
    ])
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "maxent_grpo.cli", "train", *args],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-4 for r in rows)
    assert json.loads((out / "run_info.json").read_text())["world_size"] == 2
