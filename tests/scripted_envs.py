"""A scripted environment for the multi-turn tests (HF and vLLM), and what they count."""

from __future__ import annotations

import itertools

from maxent_grpo.envs.protocol import StepResult

# The tiny random models rarely sample eos: common letters end their turns, so episodes reach the
# environment (a turn that runs out of tokens ends its episode).
STOPS = ("a", "e", "i", "o", "t")


def model_turns(mask: list[int]) -> int:
    """Runs of model tokens in an episode's loss mask."""
    return sum(1 for k, _ in itertools.groupby(mask) if k == 1)


class Scripted:
    """Answers every assistant turn with a fixed user message until ``turns`` model turns were taken."""

    tools = ()

    def __init__(self, turns: int = 3):
        self.turns, self.seen = turns, 0

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, assistant):
        self.seen += 1
        if self.seen >= self.turns:
            return StepResult(None, {"answered": 1.0})
        return StepResult([{"role": "user", "content": f"observation {self.seen}: go on"}])

    def get_reward(self):
        return float(self.seen)  # turns the environment answered: the episode's own score


