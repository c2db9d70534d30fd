"""Method identity: which registry entries each training method picks.

This is the one place where the method name is looked at. Everything
downstream reads the :class:`MethodSpec` fields, never the name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from maxent_grpo.training.config import TrainConfig


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: str  # "grpo" (advantage surrogate) or "maxent" (maximum-entropy variants)
    policy_loss: str  # key of maxent_grpo.core.losses.POLICY_LOSSES
    weighting: str  # "none" | "listwise" (MaxEnt target weights) | "xdr" (row multipliers)
    seed_scaling: bool  # SEED-GRPO semantic-entropy advantage scaling
    needs_reference: bool  # a frozen reference policy must be scored

    def identity(self) -> dict:
        return asdict(self)


def method_spec(cfg: TrainConfig) -> MethodSpec:
    name = cfg.method
    beta = cfg.loss.beta
    if name == "maxent_listwise":
        loss = "listwise_cross_entropy" if cfg.maxent.listwise_loss == "cross_entropy" else "listwise_weighted_mle"
        return MethodSpec(name, "maxent", loss, "listwise", False, beta > 0)
    family = "maxent" if name in ("maxent_entropy", "xdr") else "grpo"
    weighting = "xdr" if name == "xdr" else "none"
    needs_ref = beta > 0 or (weighting == "xdr" and cfg.xdr.lam > 0)
    return MethodSpec(name, family, "clipped_surrogate", weighting, name == "seed_grpo", needs_ref)
