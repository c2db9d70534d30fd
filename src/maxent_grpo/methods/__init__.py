"""Training methods, one file per family; ``get_method(name)`` returns one.

* ``advantage.py``: group-advantage methods on the clipped surrogate (GRPO, Dr.GRPO,
  DAPO, GSPO, SEED-GRPO, token-entropy MaxEnt) and CISPO's truncated IS weight.
* ``listwise.py``: MaxEnt listwise targets (``maxent_listwise``).
* ``xdr.py``: xDr tempered group aggregation.

Adding a method is one ``register(Method(...))`` in its family's file (or a new file
imported here); nothing in ``training/`` names methods.
"""

from maxent_grpo.methods.registry import METHODS, Method, MethodTargets, TargetInputs, get_method, register
from maxent_grpo.methods import advantage, listwise, xdr  # noqa: E402,F401  (each registers its methods)

__all__ = ["METHODS", "Method", "MethodTargets", "TargetInputs", "get_method", "register"]
