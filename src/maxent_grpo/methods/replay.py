"""Re:Dr and Re:Max (ALGORITHMS.md §17): verified mode replay over Dr.GRPO and over MaxRL.

The replay itself is a run section (``replay:``, ``training/replay.py``) any method can turn
on; these two methods are the anchor's pairings, with remax's presets. Their controls are the
same methods with ``replay.compute_only: true`` (every replay pass runs, the bank fills, the
replay gradient is exactly zero). Replay needs a task whose verifier gives mode keys
(``data.source: modebench_pkg:<domain>`` or ``modebench:<task>``).
"""

from __future__ import annotations

from maxent_grpo.methods.registry import Method, register

register(Method(
    "redr", "grpo", "Re:Dr: Dr.GRPO plus verified mode replay (replay: section; needs a task with mode keys)",
    preset={"loss.loss_type": "dr_grpo", "loss.scale_rewards": "none", "loss.beta": 0.0, "replay.enabled": True},
))

register(Method(
    "remax", "grpo", "Re:Max: MaxRL advantages (binary rewards) plus verified mode replay (replay: section)",
    preset={"loss.advantage_estimator": "maxrl", "loss.loss_type": "dr_grpo", "loss.scale_rewards": "none",
            "loss.beta": 0.0, "replay.enabled": True},
))
