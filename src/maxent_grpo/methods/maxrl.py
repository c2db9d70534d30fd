"""MaxRL (arXiv 2602.02710; ALGORITHMS.md §16): Dr.GRPO with the MaxRL advantage.

The whole difference is the advantage, ``A_i = G_v*r_i/K - 1`` on binary rewards (``K``
successes among a group's ``G_v`` valid rows, 0 when ``K = 0``): the Dr.GRPO advantage divided
by the group's success rate, so a hard prompt weighs about ``1/p``
(``core/advantages.py`` ``maxrl_advantages``). The preset is remax's (Re:Max without the
replay): the fresh loss is §3's ``dr_grpo``, no std scaling and no KL. The rewards must be
exactly 0 or 1 (a batch with any other value is skipped, naming the value and its row), so a
MaxRL recipe uses one 0/1 reward function, e.g. ``boxed_accuracy`` alone.
"""

from __future__ import annotations

from maxent_grpo.methods.registry import Method, register

register(Method(
    "maxrl", "grpo", "MaxRL: binary rewards, A_i = G_v*r_i/K - 1 (Dr.GRPO / success rate), dr_grpo aggregation",
    preset={
        # The MaxRL advantage (ALGORITHMS.md §16): needs 0/1 rewards; NaN rows get 0 and are not counted.
        "loss.advantage_estimator": "maxrl",
        # remax's fresh loss: per-row token sums over the constant B * L_max (Dr.GRPO's normaliser).
        "loss.loss_type": "dr_grpo",
        # Dividing by the success rate K/G_v is MaxRL's scaling; another std scaling is a config error.
        "loss.scale_rewards": "none",
        # remax trains with beta = 0: no KL term and no reference model.
        "loss.beta": 0.0,
    },
))
