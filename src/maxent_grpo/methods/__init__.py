"""Training methods, one file per family; ``get_method(name)`` returns one.

* ``advantage.py``: group-advantage methods on the clipped surrogate (GRPO, Dr.GRPO,
  DAPO, GSPO, LUSPO, token-entropy MaxEnt) and CISPO's truncated IS weight.
* ``listwise.py``: MaxEnt listwise targets (``maxent_listwise``).
* ``seed_grpo.py``: SEED-GRPO's semantic-entropy advantage scaling.
* ``xdr.py``: xDr tempered group aggregation.
* ``sapo.py``, ``gmpo.py``, ``dppo.py``, ``opsm.py``, ``vespo.py``: a peer's policy loss each, one
  ``register_policy_loss_method`` call (the loss itself is in ``core/peer_losses.py``).
* ``maxrl.py``, ``replay.py``: MaxRL's advantage; verified mode replay's settings.

Adding a method is one ``register(Method(...))`` in its family's file or in a new file
here (imported by the loop below); nothing in ``training/`` names methods.
"""

import importlib
import pkgutil

from maxent_grpo.methods.registry import (
    METHODS, Method, MethodPlan, MethodTargets, PlanInputs, RewardScalingInputs, TargetInputs, get_method,
    method_sections, register,
)

# Every module of this package registers its methods on import: a new method is a new file.
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "METHODS", "Method", "MethodPlan", "MethodTargets", "PlanInputs", "RewardScalingInputs", "TargetInputs",
    "get_method", "method_sections", "register",
]
