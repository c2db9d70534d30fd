"""A reward model as a reward function (TRL's ``reward_funcs="org/model"``).

``rewards: [{name: reward_model, kwargs: {model: PATH_OR_ID}}]`` (or for short ``[{model: PATH_OR_ID}]``) loads an
``AutoModelForSequenceClassification`` and its own tokenizer, and scores each prompt +
completion as TRL's GRPOTrainer does: a conversational row through the reward model's
chat template (prompt messages + the completion as the assistant turn), a plain row as
the concatenated text; right padding, no special tokens added, the first logit is the
reward. Batched (``batch_size`` rows per forward), without gradients, on this process's
accelerator (``cuda:LOCAL_RANK``) or the CPU. The model is loaded when the reward is built,
before the policy, so a wrong path fails first.
"""

from __future__ import annotations

import os

import torch

from maxent_grpo.rewards.catalog import RewardFunction, register_reward

__all__ = ["make_reward_model"]


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


@register_reward("reward_model")
def make_reward_model(*, model: str, batch_size: int = 8, dtype: str = "float32") -> RewardFunction:
    """The reward function of the sequence classifier at ``model`` (a path or a hub id)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a path or a hub id, got {model!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    device = _device()
    classifier = AutoModelForSequenceClassification.from_pretrained(model, dtype=getattr(torch, dtype))
    return reward_model_function(classifier, AutoTokenizer.from_pretrained(model), batch_size=batch_size,
                                 device=device, name=model)


def reward_model_function(classifier, tokenizer, *, batch_size: int = 8, device: torch.device | None = None,
                          name: str | None = None) -> RewardFunction:
    """The reward function of a loaded sequence classifier and its tokenizer (a reward model given as an
    object from Python; :func:`make_reward_model` loads one by name)."""
    device = _device() if device is None else device
    name = name or getattr(classifier.config, "_name_or_path", "") or type(classifier).__name__
    classifier = classifier.to(device).eval()
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"reward model {name}: its tokenizer has no pad token")
        tokenizer.pad_token = tokenizer.eos_token  # as TRL pads a reward model's inputs
    classifier.config.pad_token_id = tokenizer.pad_token_id

    def texts(prompts, completions) -> list[str]:
        if isinstance(prompts[0], list):
            return [tokenizer.apply_chat_template(list(p) + list(c), tokenize=False) for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def reward_model(prompts, completions, **columns) -> list[float | None]:
        scored = texts(prompts, completions)
        out: list[float | None] = []
        for start in range(0, len(scored), batch_size):
            batch = tokenizer(scored[start : start + batch_size], return_tensors="pt", padding=True,
                              padding_side="right", add_special_tokens=False).to(device)
            out += classifier(**batch).logits[:, 0].float().tolist()
        return out

    return reward_model
