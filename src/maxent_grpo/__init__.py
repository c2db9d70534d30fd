"""maxent-grpo: GRPO and maximum-entropy GRPO fine-tuning of language models.

From Python: ``maxent_grpo.train(config, model=..., reward_funcs=..., train_dataset=...)``, or TRL's
``GRPOConfig`` and ``GRPOTrainer`` with the same signatures (front/). Imported on first use, so that
``import maxent_grpo`` stays light.
"""

__version__ = "0.1.0"

__all__ = ["GRPOConfig", "GRPOTrainer", "train", "__version__"]

_EXPORTS = {"GRPOConfig": "maxent_grpo.front.grpo_config", "GRPOTrainer": "maxent_grpo.front.grpo_trainer",
            "train": "maxent_grpo.front.train"}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'maxent_grpo' has no attribute {name!r}")
