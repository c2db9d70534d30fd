"""TRL's quick start with its import line changed, offline, on this library's default model and task.

TRL's version (https://huggingface.co/docs/trl/quickstart) reads a hub dataset and TRL's accuracy
reward; here the data is the default task (reasoning-gym chain_sum: one-digit sums, each prompt
opening with the default run's solved example as an earlier turn) generated offline, and the reward
is the default run's boxed-answer accuracy. The trainer lines are TRL's, unchanged: TRL's GRPOConfig
defaults decide the run (3 epochs over the prompts, 8 completions of up to 512 tokens per prompt,
learning rate 1e-6, the output folder SmolLM2-135M-Instruct-GRPO). With these 4 prompts that is 12
steps, about 4 minutes on 2 CPU cores.

    python examples/trl_quickstart.py
"""

import reasoning_gym
from datasets import Dataset

from maxent_grpo import GRPOTrainer  # TRL: from trl import GRPOTrainer
from maxent_grpo.config.schema import DEFAULT_FEW_SHOT
from maxent_grpo.rewards.builtin import make_boxed_accuracy

example_question, example_answer = DEFAULT_FEW_SHOT
problems = reasoning_gym.create_dataset("chain_sum", size=4, seed=0, min_terms=2, max_terms=2, max_digits=1)
dataset = Dataset.from_list([
    {"prompt": [{"role": "user", "content": example_question},
                {"role": "assistant", "content": example_answer},
                {"role": "user", "content": f"{p['question']}\n\nPut your final answer within \\boxed{{}}."}],
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
