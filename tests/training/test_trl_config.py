"""``--from-trl FILE``: a TRL GRPO YAML becomes our config, field by field (issue 36 item 4)."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from pathlib import Path

import pytest
import yaml

from maxent_grpo.cli import main
from maxent_grpo.errors import ConfigError
from maxent_grpo.training.metrics import read_metrics
from maxent_grpo.config.compile import compile_run
from maxent_grpo.training.precision import Machine
from maxent_grpo.config.trl import (
    GRPO_FIELDS, SCRIPT_FIELDS, TRAINING_ARGUMENTS_FIELDS, TRL_FIELDS, Mapped, convert, load_trl_config,
)
from maxent_grpo.config.trl_doc import markdown_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "TRL.md"

# A recipe as TRL users write them (trl grpo --config grpo.yaml).
REALISTIC = textwrap.dedent("""\
    model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct
    dataset_name: trl-lib/DeepMath-103K
    output_dir: out/qwen-grpo
    learning_rate: 1.0e-6
    per_device_train_batch_size: 16
    gradient_accumulation_steps: 2
    num_generations: 8
    max_completion_length: 256
    beta: 0.04
    epsilon: 0.2
    epsilon_high: 0.28
    loss_type: dr_grpo
    scale_rewards: false
    num_iterations: 2
    max_steps: 200
    warmup_ratio: 0.1
    logging_steps: 5
    save_steps: 50
    seed: 7
    bf16: true
    use_vllm: true
    vllm_mode: server
    vllm_server_base_url: http://10.0.0.2:8000
    report_to: [wandb]
    reward_funcs: [accuracy_reward, my_rewards.length_penalty]
    reward_weights: [1.0, 0.1]
    mask_truncated_completions: true
    multi_objective_aggregation: normalize_then_sum
    use_adaptive_entropy: true
    entropy_target: 0.3
    use_bias_correction_kl: false
""")


def _own_fields(cls, base) -> list[dataclasses.Field]:
    inherited = {f.name for f in dataclasses.fields(base)} if base is not None else set()
    return [f for f in dataclasses.fields(cls) if f.name not in inherited]


def _default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def test_every_grpo_config_field_of_the_installed_trl_is_in_the_table_with_trls_default():
    trl = pytest.importorskip("trl")
    from transformers import TrainingArguments
    from trl.scripts.grpo import GRPOScriptArguments

    own = _own_fields(trl.GRPOConfig, TrainingArguments)
    assert {f.name for f in own} == set(GRPO_FIELDS)
    everything = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    for cls in (GRPOScriptArguments, trl.ModelConfig, trl.DatasetMixtureConfig):
        everything.update({f.name: f for f in dataclasses.fields(cls)})
    script = {f.name for cls in (GRPOScriptArguments, trl.ModelConfig, trl.DatasetMixtureConfig)
              for f in dataclasses.fields(cls)}
    assert script <= set(TRL_FIELDS), sorted(script - set(TRL_FIELDS))
    # An absent field means TRL's default, mapped or judged: every entry's default is the installed TRL's.
    for name, entry in TRL_FIELDS.items():
        if name in everything:
            assert entry.default == _default(everything[name]), name
    # The TrainingArguments part names real fields (three of transformers 4, still in older YAMLs).
    ta = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(TRAINING_ARGUMENTS_FIELDS) - ta <= {"warmup_ratio", "logging_dir", "overwrite_output_dir"}


def test_a_realistic_trl_yaml_becomes_a_config_the_validator_and_compiler_accept(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(REALISTIC)
    cfg, notes = load_trl_config(path)
    plan = compile_run(cfg, Machine(fast_bf16=True, cuda=True))
    t, lo, g = cfg.training, cfg.loss, cfg.generation
    # TRL's batch is in completions per process: 16 per forward/backward x 2 accumulated = 32 per step,
    # 8 per prompt -> 4 prompts per process and step here, in micro-batches of 16 completions.
    assert (t.prompts_per_step, t.micro_batch_size, g.num_generations) == (4, 16, 8)
    # TRL's max_steps and save_steps count optimizer updates; a step here is num_iterations updates.
    assert (t.max_steps, t.num_iterations, cfg.checkpoint.save_steps, cfg.checkpoint.save_minutes) == (100, 2, 25, 0.0)
    assert (t.warmup_ratio, plan.optimizer.warmup_steps) == (0.1, 20)  # ceil(0.1 x 200 updates), as TRL counts
    # normalize_then_sum: TRL whitens the normalised sum over the batch whatever scale_rewards says.
    assert (cfg.method, lo.loss_type, lo.scale_rewards) == ("grpo", "dr_grpo", "batch")
    keys, _ = convert({**yaml.safe_load(REALISTIC), "multi_objective_aggregation": "sum_then_normalize"})
    assert keys["loss.scale_rewards"] == "none"  # scale_rewards: false
    assert (lo.beta, lo.epsilon, lo.epsilon_high, lo.mask_truncated_completions) == (0.04, 0.2, 0.28, True)
    assert (lo.multi_objective_aggregation, lo.adaptive_entropy, lo.entropy_target) == ("normalize_then_sum", True, 0.3)
    assert (g.max_new_tokens, g.backend, g.vllm.server_url) == (256, "vllm_server", "http://10.0.0.2:8000")
    assert (lo.rollout_correction, lo.rollout_correction_cap) == ("sequence_mask", 3.0)  # TRL's defaults with vLLM
    assert [(r.name, r.weight) for r in cfg.rewards] == [("trl.rewards:accuracy_reward", 1.0), ("my_rewards:length_penalty", 0.1)]
    assert (t.learning_rate, t.seed, t.autocast_bf16, cfg.logging.report_to) == (1e-6, 7, True, ["wandb"])
    assert (cfg.model.name_or_path, cfg.data.source, cfg.data.size, cfg.data.instruction, cfg.data.few_shot) == (
        "Qwen/Qwen2.5-0.5B-Instruct", "trl-lib/DeepMath-103K", None, None, [])
    # Fields the file leaves out take TRL's defaults, not ours.
    assert (t.adam_beta2, t.lr_scheduler, t.gradient_checkpointing, t.share_prompts) == (0.999, "linear", True, False)
    assert (t.dist_timeout_minutes, cfg.checkpoint.keep_last, cfg.data.shuffle) == (30.0, None, True)
    assert notes == ["logging_steps: ignored: console and tracker display; every step's metrics and completions "
                     "are written here (metrics.jsonl, completions/)"]


@pytest.mark.parametrize("loss_type, method, aggregation", [
    ("grpo", "grpo", "grpo"), ("bnpo", "grpo", "bnpo"), ("dapo", "grpo", "dapo"), ("cispo", "cispo", "dapo"),
    ("sapo", "sapo", "grpo"),
])
def test_trl_loss_types_become_our_method_and_aggregation(loss_type, method, aggregation):
    keys, _ = convert({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["think_format_reward"],
                       "max_steps": 4, "loss_type": loss_type, "sapo_temperature_neg": 2.0})
    assert (keys["method"], keys["loss.loss_type"]) == (method, aggregation)
    assert keys.get("sapo.tau_neg") == (2.0 if loss_type == "sapo" else None)
    assert keys["loss.epsilon_high"] is None  # TRL: epsilon, whatever the loss type (not cispo's preset 5.0)


def test_trls_reference_sync_off_policy_mask_and_rslora_compile_to_ours(tmp_path):
    """sync_ref_model is TR-DPO (loss.sync_ref_model), off_policy_mask_threshold on a clipped-surrogate
    loss type is OPSM with that threshold, use_rslora is peft's rank-stabilised LoRA."""
    path = tmp_path / "grpo.yaml"
    path.write_text(textwrap.dedent("""\
        model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct
        dataset_name: trl-lib/DeepMath-103K
        reward_funcs: [accuracy_reward]
        max_steps: 8
        beta: 0.04
        sync_ref_model: true
        ref_model_mixup_alpha: 0.9
        ref_model_sync_steps: 4
        loss_type: dr_grpo
        off_policy_mask_threshold: 0.5
    """))
    cfg, _ = load_trl_config(path)
    plan = compile_run(cfg, Machine(fast_bf16=True, cuda=True))
    assert (cfg.method, cfg.opsm.delta, cfg.loss.loss_type) == ("opsm", 0.5, "dr_grpo")
    assert (plan.method.loss.policy_loss, plan.method.loss.policy_params.delta) == ("opsm", 0.5)
    assert (plan.ref_sync.alpha, plan.ref_sync.sync_steps) == (0.9, 4)
    keys, _ = convert({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["think_format_reward"],
                       "max_steps": 4, "use_peft": True, "use_rslora": True})
    assert (keys["model.lora.enabled"], keys["model.lora.use_rslora"]) == (True, True)


@pytest.mark.parametrize("fields, problem", [
    ({"use_dora": True}, "use_dora: True is refused: DoRA has no counterpart here"),
    ({"loss_type": "cispo", "off_policy_mask_threshold": 0.5},
     "off_policy_mask_threshold: the off-policy sequence mask goes with the clipped-surrogate loss types"),
    ({"loss_type": "gfpo"}, "loss_type: 'gfpo' has no counterpart here"),
    ({"per_device_train_batch_size": 6}, "per_device_train_batch_size: 6 x gradient_accumulation_steps 1 = 6"),
    ({"max_steps": -1, "num_train_epochs": 2.5}, "num_train_epochs: 2.5: here a run is whole passes over the data"),
    ({"num_iterations": 3}, "max_steps: 4 updates is not a multiple of num_iterations 3"),
    ({"deepspeed": "ds.json"}, "deepspeed: 'ds.json' is refused: no DeepSpeed here"),
    ({"optim": "adafactor"}, "optim: 'adafactor' is refused: here training.optimizer is adamw, adamw_fused or adamw_8bit"),
    ({"per_device_train_batchsize": 8}, "per_device_train_batchsize: not a field of TRL's GRPOConfig"),
])
def test_a_refused_field_is_named_in_one_line(fields, problem):
    base = {"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["think_format_reward"], "max_steps": 4,
            "num_generations": 4}
    with pytest.raises(ConfigError) as err:
        convert({**base, **fields})
    assert str(err.value).startswith(problem)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("optim, ours", [("adamw_torch", "adamw"), ("adamw_torch_fused", "adamw"),
                                         ("adamw_8bit", "adamw_8bit"), ("adamw_bnb_8bit", "adamw_8bit")])
def test_trls_optim_becomes_the_optimizer(optim, ours):
    keys, _ = convert({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["think_format_reward"],
                       "max_steps": 4, "optim": optim})
    assert keys["training.optimizer"] == ours


@pytest.mark.parametrize("auto, micro", [(True, "auto"), (False, 16)])
def test_trls_auto_find_batch_size_becomes_an_auto_micro_batch(auto, micro):
    keys, _ = convert({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["think_format_reward"],
                       "max_steps": 4, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 2,
                       "num_generations": 8, "auto_find_batch_size": auto})
    assert (keys["training.prompts_per_step"], keys["training.micro_batch_size"]) == (4, micro)


def test_trls_defaults_are_accepted_where_a_refused_field_asks_for_nothing():
    keys, notes = convert({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["think_format_reward"],
                           "max_steps": 4, "sync_ref_model": False,
                           "vllm_tensor_parallel_size": 2, "use_vllm": False, "steps_per_generation": 1,
                           "ds3_gather_for_generation": True, "adam_epsilon": yaml.safe_load("1e-8")})
    assert keys["generation.backend"] == "hf"
    assert notes == ["ds3_gather_for_generation: ignored: DeepSpeed ZeRO-3 only; no DeepSpeed here "
                     "(training.strategy: fsdp2 shards instead)"]


def test_the_cli_refuses_before_any_model_loads(tmp_path, capsys):
    path = tmp_path / "grpo.yaml"
    path.write_text("model_name_or_path: /no/such/model\ndataset_name: /no/such.jsonl\nmax_steps: 2\n"
                    "reward_funcs: [think_format_reward]\nmin_p: 0.1\n")
    assert main(["train", "--from-trl", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["maxent-grpo: config error: min_p: 0.1 is refused: the samplers here have no min-p cut (top_p and top_k only)"]


def test_the_doc_table_is_the_generated_one():
    assert markdown_table() in DOC.read_text(), "regenerate: python -m maxent_grpo.config.trl_doc --write docs/TRL.md"
    counts = [sum(isinstance(e, Mapped) for e in table.values()) for table in (GRPO_FIELDS, TRAINING_ARGUMENTS_FIELDS, SCRIPT_FIELDS)]
    assert f"{counts[0]} mapped" in DOC.read_text()


REWARDS_FILE = textwrap.dedent('''
    def short(completions, trainer_state=None, **kwargs):
        # TRL's signature: completions, the row's columns, and the trainer state.
        assert trainer_state.max_steps == 2
        return [1.0 / (1 + len(c)) for c in completions]
''')


def test_a_trl_yaml_trains_here_from_another_folder(tmp_path, tiny_model_dir, monkeypatch):
    """The file's reward module and data sit beside it; the run is started from another folder."""
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    (recipe / "my_rewards.py").write_text(REWARDS_FILE)
    (recipe / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n"
                                               for i in range(8)))
    out = tmp_path / "out"
    (recipe / "grpo.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny_model_dir), "dataset_name": "rows.jsonl", "output_dir": str(out),
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4,
        "max_completion_length": 8, "max_steps": 2, "learning_rate": 1e-4, "bf16": False, "disable_tqdm": True,
        "reward_funcs": ["my_rewards.short"], "save_strategy": "no", "logging_steps": 1,
    }))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["train", "--from-trl", str(recipe / "grpo.yaml"), "--set", "generation.dtype=null"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["training"]["prompts_per_step"] == 2 and saved["training"]["micro_batch_size"] == 4
    assert saved["rewards"][0]["name"] == f"{(recipe / 'my_rewards.py').resolve()}:short"


def test_a_trl_yaml_without_max_steps_trains_num_train_epochs_passes(tmp_path, tiny_model_dir, caplog):
    """TRL's default length: max_steps -1, num_train_epochs passes over the prompts. 10 rows, 2 prompts a
    step (4 completions x 2 accumulated / 2 per prompt) -> 5 steps an epoch, 2 epochs -> 10 steps; the
    step count reaches reward functions and the LR schedule, and warmup_ratio becomes warm-up updates."""
    import logging

    recipe = tmp_path / "recipe"
    recipe.mkdir()
    (recipe / "epoch_rewards.py").write_text(textwrap.dedent('''
        def short(completions, trainer_state=None, **kwargs):
            assert trainer_state.max_steps == 10
            return [1.0 / (1 + len(c)) for c in completions]
    '''))
    (recipe / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 2 =", "answer": str(i + 2)}) + "\n"
                                               for i in range(10)))
    out = tmp_path / "out"
    (recipe / "grpo.yaml").write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny_model_dir), "dataset_name": "rows.jsonl", "output_dir": str(out),
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "num_generations": 2,
        "max_completion_length": 4, "num_train_epochs": 2, "learning_rate": 1e-4, "warmup_ratio": 0.25,
        "bf16": False, "disable_tqdm": True, "reward_funcs": ["epoch_rewards.short"], "save_strategy": "no",
    }))
    with caplog.at_level(logging.INFO, logger="maxent_grpo"):
        assert main(["train", "--from-trl", str(recipe / "grpo.yaml"), "--set", "generation.dtype=null"]) == 0
    assert "run length: 10 steps (data.num_epochs=2 passes over 10 training rows, 2 per step)" in caplog.text
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11))
    # transformers' linear schedule over 10 updates with ceil(0.25 x 10) = 3 warm-up updates, logged after
    # each update k: 1e-4 * k / 3 while warming up, then 1e-4 * (10 - k) / 7.
    want = [1e-4 * k / 3 if k < 3 else 1e-4 * (10 - k) / 7 for k in range(1, 11)]
    assert [r["learning_rate"] for r in rows] == pytest.approx(want, rel=1e-9, abs=1e-15)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert (saved["training"]["max_steps"], saved["data"]["num_epochs"]) == (None, 2)


@pytest.mark.parametrize("line, problem", [
    ("num_generations: 1", "num_generations: 1 (as generation.num_generations: must be >= 2 "),
    ("temperature: hot", "temperature: 'hot' (as generation.temperature: expected a number, got 'hot')"),
    ("per_device_train_batch_size: eight", "per_device_train_batch_size: 'eight' cannot be read: "),
])
def test_a_value_our_validator_refuses_is_named_by_its_trl_field(tmp_path, line, problem):
    path = tmp_path / "grpo.yaml"
    text = (f"model_name_or_path: m\ndataset_name: d\nmax_steps: 2\nnum_generations: 2\n"
            f"per_device_train_batch_size: 2\nreward_funcs: [think_format_reward]\n")
    # The line replaces the field it sets (YAML would keep the last of two).
    kept = [row for row in text.splitlines() if row.split(":")[0] != line.split(":")[0]]
    path.write_text("\n".join([*kept, line]) + "\n")
    with pytest.raises(ConfigError) as err:
        load_trl_config(path)
    assert str(err.value).startswith(problem) and "\n" not in str(err.value)


@pytest.mark.parametrize("written, weighted", [({}, True), ({"use_bias_correction_kl": True}, True),
                                               ({"use_bias_correction_kl": False}, False)])
def test_trls_kl_term_is_its_default_importance_weighted_one(written, weighted):
    # TRL 1.16 multiplies the KL term by the importance ratio unless told otherwise (ALGORITHMS.md §19).
    keys, _ = convert({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["think_format_reward"],
                       "max_steps": 4, "beta": 0.04, **written})
    assert (keys["loss.beta"], keys["loss.kl_importance_weighted"]) == (0.04, weighted)


def test_an_absent_field_is_judged_at_trls_default(monkeypatch):
    # Were TRL's default of a refused field one refused here, a file that leaves it out is refused too.
    from dataclasses import replace

    from maxent_grpo.config import trl_fields

    monkeypatch.setitem(trl_fields.TRL_FIELDS, "min_p", replace(trl_fields.TRL_FIELDS["min_p"], trl_default=0.05))
    with pytest.raises(ConfigError, match=r"^min_p: 0.05 \(TRL's default\) is refused"):
        convert({"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["think_format_reward"]})


@pytest.mark.parametrize("fields, method, printed_keys", [
    ({"beta": 0.04}, "grpo", {"loss.beta": 0.04, "loss.kl_importance_weighted": True}),
    ({"loss_type": "luspo", "importance_sampling_level": "sequence"}, "luspo", {"loss.loss_type": "luspo"}),
    ({"loss_type": "vespo", "vespo_k_pos": 1.5}, "vespo", {"loss.loss_type": "dapo", "vespo.k_pos": 1.5}),
    ({"cast_lm_head_to_fp32": True, "bf16": True}, "grpo",
     {"model.lm_head_fp32": True, "training.autocast_bf16": True}),
], ids=["beta-no-flag", "luspo", "vespo", "fp32-head"])
def test_trl_1_16_files_print_and_train(tmp_path, tiny_model_dir, capsys, fields, method, printed_keys):
    """TRL 1.16's default KL term (beta 0.04 with use_bias_correction_kl left out: the importance-weighted
    one), its two newest loss types and its float32 LM head, from a TRL file: --print-config shows them,
    and 2 steps train."""
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n"
                                                 for i in range(8)))
    (tmp_path / "my_rewards.py").write_text(REWARDS_FILE)
    out = tmp_path / "out"
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny_model_dir), "dataset_name": str(tmp_path / "rows.jsonl"), "output_dir": str(out),
        "per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 8, "max_steps": 2,
        "learning_rate": 1e-3, "bf16": False, "disable_tqdm": True, "save_strategy": "no",
        "reward_funcs": ["my_rewards.short"], **fields,
    }))
    assert main(["train", "--from-trl", str(path), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["method"] == method
    assert {k: printed[k.split(".")[0]][k.split(".")[1]] for k in printed_keys} == printed_keys
    assert main(["train", "--from-trl", str(path), "--set", "generation.dtype=null"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    if "beta" in fields:
        assert rows[1]["kl"] > 0
    if method == "vespo":
        assert "vespo/phi_seq_mean" in rows[1]
