"""Tasks and their answers: how a completion's final answer is read (``answers``), and the
ModeBench tasks with several valid answers per prompt (verifiers, mode keys, data).
Pure Python below the reward functions, which build on it."""
