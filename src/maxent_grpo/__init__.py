"""maxent-grpo: GRPO and maximum-entropy GRPO fine-tuning of language models."""

__version__ = "0.1.0"
