"""Reward functions written the way TRL's GRPOTrainer takes them.

Each gets the prompts, the completions and every dataset column as keyword
arguments (here ``solution``, under its own name), and returns one float per
completion, or None where it does not apply.
"""

import re


def exact_solution(prompts, completions, solution, **kwargs):
    """1.0 when the last number in the completion equals the row's ``solution``."""
    scores = []
    for completion, answer in zip(completions, solution):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        scores.append(1.0 if numbers and numbers[-1] == str(answer) else 0.0)
    return scores


def brevity(prompts, completions, completion_ids, **kwargs):
    """A little credit for short answers: 1 at one token, 0 at 32 or more."""
    return [max(0.0, 1.0 - len(ids) / 32.0) for ids in completion_ids]
