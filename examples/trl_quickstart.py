"""TRL's quick start with its import line changed, offline, on this library's default model and task.

TRL's version (https://huggingface.co/docs/trl/quickstart) reads a hub dataset and TRL's
accuracy reward; here the data is the default task (reasoning-gym chain_sum: one-digit sums)
generated offline, and the reward is the default run's boxed-answer accuracy. The trainer lines
are TRL's, unchanged: TRL's GRPOConfig defaults decide the run (3 epochs over the prompts, 8
completions each of up to 512 tokens, learning rate 1e-6, output folder SmolLM2-135M-Instruct-GRPO).
That is 24 steps of 8 completions over these 8 prompts, a few minutes on 2 CPU cores.

    python examples/trl_quickstart.py
"""

import reasoning_gym
from datasets import Dataset

from maxent_grpo import GRPOTrainer  # TRL: from trl import GRPOTrainer
from maxent_grpo.rewards.builtin import make_boxed_accuracy

problems = reasoning_gym.create_dataset("chain_sum", size=4, seed=0, min_terms=2, max_terms=2, max_digits=1)
dataset = Dataset.from_list([
    {"prompt": [{"role": "user", "content": f"{p['question']}\n\nPut your final answer within \\boxed{{}}."}],
     "answer": p["answer"]}
    for p in problems
])
accuracy_reward = make_boxed_accuracy()

trainer = GRPOTrainer(
    model="HuggingFaceTB/SmolLM2-135M-Instruct",
    reward_funcs=accuracy_reward,
    train_dataset=dataset,
)
trainer.train()
