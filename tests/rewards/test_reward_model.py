"""A reward model as a reward function (rewards/reward_model.py): a tiny sequence classifier built
offline scores prompt + completion exactly as TRL's GRPOTrainer builds its inputs."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaForSequenceClassification

from maxent_grpo.rewards.registry import build_reward_spec, evaluate_rewards

apply_chat_template = pytest.importorskip("trl.data_utils", reason="trl is not installed (the GPU machine's image)").apply_chat_template


@pytest.fixture(scope="module")
def classifier_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.num_labels = 1
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model.config.pad_token_id = tokenizer.pad_token_id
    out = tmp_path_factory.mktemp("reward-model")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _trl_scores(path, prompts, completions):
    """TRL 1.16's _calculate_rewards for a PreTrainedModel reward function."""
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if isinstance(prompts[0], list):
        texts = [apply_chat_template({"messages": p + c}, tokenizer)["text"] for p, c in zip(prompts, completions)]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    inputs = tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        return model(**inputs).logits[:, 0].tolist()


@pytest.mark.parametrize("conversational", [True, False])
def test_scores_equal_trls_inputs_batched_or_not(classifier_dir, conversational):
    if conversational:
        prompts = [[{"role": "user", "content": "What is 2 + 3?"}]] * 3
        completions = [[{"role": "assistant", "content": t}] for t in ("5", "It is five, 5.", "6")]
    else:
        prompts = ["What is 2 + 3? "] * 3
        completions = ["5", "It is five, 5.", "6"]
    theirs = _trl_scores(classifier_dir, prompts, completions)
    for batch_size in (1, 2, 8):
        spec = build_reward_spec([{"name": "reward_model", "kwargs": {"model": str(classifier_dir), "batch_size": batch_size}}])
        ours = evaluate_rewards(spec, prompts, completions, {})[:, 0].tolist()
        assert ours == pytest.approx(theirs, abs=1e-5)
    assert len(set(round(v, 6) for v in theirs)) == 3


def test_a_missing_model_fails_when_the_reward_is_built(tmp_path):
    with pytest.raises(OSError):
        build_reward_spec([{"name": "reward_model", "kwargs": {"model": str(tmp_path / "nothing")}}])


def test_the_model_shorthand_in_a_config_and_from_trl(classifier_dir, tmp_path, monkeypatch):
    """``rewards: [{model: PATH, weight: W}]`` is the reward_model entry; a relative folder is found beside
    the config file; TRL's reward_model_name_or_path becomes it, first, as TRL orders it."""
    import shutil

    from maxent_grpo.errors import ConfigError
    from maxent_grpo.config.load import load_config
    from maxent_grpo.config.trl import load_trl_config

    recipe = tmp_path / "recipe"
    shutil.copytree(classifier_dir, recipe / "rm")
    (recipe / "run.yaml").write_text("rewards: [{model: rm, weight: 0.5, kwargs: {batch_size: 2}}, format]\n")
    (recipe / "grpo.yaml").write_text("model_name_or_path: m\ndataset_name: d\nmax_steps: 2\nreward_model_name_or_path: rm\n"
                                      "reward_funcs: [think_format_reward]\nreward_weights: [0.5, 1.0]\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = load_config(recipe / "run.yaml")
    trl_cfg, _ = load_trl_config(recipe / "grpo.yaml")
    model = str((recipe / "rm").resolve())
    assert (cfg.rewards[0].name, cfg.rewards[0].weight, cfg.rewards[0].kwargs) == ("reward_model", 0.5, {"model": model, "batch_size": 2})
    assert [(r.name, r.weight, r.kwargs) for r in trl_cfg.rewards] == [
        ("reward_model", 0.5, {"model": model}), ("trl.rewards:think_format_reward", 1.0, {})]
    prompts, completions = ["What is 2 + 3? "] * 2, ["5", "six"]
    ours = evaluate_rewards(build_reward_spec(cfg.rewards[:1]), prompts, completions, {})[:, 0].tolist()
    assert ours == pytest.approx(_trl_scores(classifier_dir, prompts, completions), abs=1e-5)
    with pytest.raises(ConfigError, match=r"rewards\[0\]: give name or model, not both"):
        load_config(None, {"rewards": [{"name": "format", "model": "rm"}]})


def test_a_reward_model_given_to_grpo_trainer_by_id_or_as_an_object(classifier_dir):
    """TRL's reward_funcs: a str is a reward model's id; a PreTrainedModel is one already loaded, with its
    tokenizer from reward_processing_classes (front/objects.py). Both score as TRL does."""
    from maxent_grpo.front.objects import Given, gather

    prompts = [[{"role": "user", "content": "What is 2 + 3?"}]] * 2
    completions = [[{"role": "assistant", "content": t}] for t in ("5", "six")]
    theirs = _trl_scores(classifier_dir, prompts, completions)
    loaded = AutoModelForSequenceClassification.from_pretrained(classifier_dir)
    keys, objects = gather(Given(reward_funcs=[str(classifier_dir), loaded],
                                 reward_processing_classes=[None, AutoTokenizer.from_pretrained(classifier_dir)]),
                           trl_conventions=True)
    name = classifier_dir.name
    assert [e["name"] for e in keys["rewards"]] == [f"python:{name}", f"python:{name}_2"]
    for entry in keys["rewards"]:
        ours = objects.rewards[entry["name"]](prompts=prompts, completions=completions)
        assert ours == pytest.approx(theirs, abs=1e-5)
