"""TRL's quick start (its documentation's reward_len example), on an in-memory dataset: the tests run it
once with ``from trl import GRPOTrainer`` and once with the import line below."""
import sys

from datasets import Dataset

from maxent_grpo import GRPOTrainer

dataset = Dataset.from_list([{"prompt": "What is 2 + 3?"}, {"prompt": "Name a colour."}])


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


trainer = GRPOTrainer(model=sys.argv[1], reward_funcs=reward_len, train_dataset=dataset)
trainer.train()
