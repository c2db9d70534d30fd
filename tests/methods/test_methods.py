"""The method registry (``methods/``): every method plans from plain values, and the registry
refuses what would make two methods collide. The methods' training effect is tested end to end
in tests/training/test_train.py (one recipe per method) and their formulas in tests/core."""

from __future__ import annotations

import dataclasses
import json

import pytest

from maxent_grpo.core.listwise import ListwiseParams
from maxent_grpo.core.losses import POLICY_LOSSES
from maxent_grpo.core.step import LossSpec
from maxent_grpo.methods import METHODS, PlanInputs, get_method, method_sections
from maxent_grpo.methods.registry import Method, register
from maxent_grpo.rewards.maxent import MaxEntConfig


def _inputs(method: Method, beta: float = 0.0, **settings) -> PlanInputs:
    section = method.settings() if method.settings is not None else None
    if settings:
        section = dataclasses.replace(section, **settings)
    # The loss: section as the method's preset leaves it (GMPO's geometric mean is per sequence: grpo).
    loss = LossSpec(beta=beta, loss_type=method.preset.get("loss.loss_type", "dapo"), max_completion_length=16)
    return PlanInputs(loss=loss, settings=section, maxent=MaxEntConfig(), num_generations=4,
                      micro_batch_size=8, max_new_tokens=16)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_plans_from_its_default_settings(name):
    method = METHODS[name]
    inputs = _inputs(method, beta=0.05)
    assert method.check(inputs) == []
    plan = method.plan(inputs)
    assert isinstance(plan.loss, LossSpec) and plan.loss.policy_loss in POLICY_LOSSES
    # beta is the token loss's only when the method puts the KL there (listwise: in the targets).
    assert plan.loss.beta == (0.05 if plan.kl_in_token_loss else 0.0)
    assert plan.needs_reference  # beta > 0 needs the reference log-probs, wherever the KL acts
    assert json.loads(json.dumps(plan.identity()))["name"] == name
    assert callable(plan.targets)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_no_reference_model_without_a_kl_term(name):
    method = METHODS[name]
    if method.section == "xdr":  # xDr's length term reads the reference log-probs when lam > 0
        assert method.plan(_inputs(method, lam=0.1)).needs_reference
    assert not method.plan(_inputs(method)).needs_reference


@pytest.mark.parametrize("score", ["token_mean", "sum"])
@pytest.mark.parametrize("loss", ["cross_entropy", "weighted_mle", "centered_mle"])
def test_listwise_settings_choose_the_loss_and_its_score(loss, score):
    method = get_method("maxent_listwise")
    maxent = MaxEntConfig(listwise_loss=loss, listwise_score=score, listwise_clip_coef=0.3)
    spec = method.plan(dataclasses.replace(_inputs(method), maxent=maxent)).loss
    assert spec.policy_loss == f"listwise_{loss}"
    assert spec.policy_params == ListwiseParams(score=score, clip_coef=0.3)


def test_a_method_check_names_its_own_section_key():
    problems = get_method("xdr").check(_inputs(get_method("xdr"), tau=-1.0))
    assert [key for key, _ in problems] == ["xdr.tau"]
    seed = get_method("seed_grpo")
    assert [key for key, _ in seed.check(_inputs(seed, alpha=-0.5))] == ["seed_grpo.alpha"]


def test_sections_are_declared_once_each():
    sections = method_sections()
    for method in METHODS.values():
        if method.section is not None:
            assert sections[method.section] is method.settings


def test_the_registry_refuses_a_second_name_and_a_clashing_section():
    with pytest.raises(ValueError, match="registered twice"):
        register(Method(name="grpo", family="grpo", summary="again"))

    @dataclasses.dataclass
    class Other:
        tau: float = 1.0

    with pytest.raises(ValueError, match="section 'xdr'"):
        register(Method(name="not-xdr", family="grpo", summary="x", section="xdr", settings=Other))
    assert "not-xdr" not in METHODS
    with pytest.raises(ValueError, match="section and settings go together"):
        Method(name="half", family="grpo", summary="x", section="half")


def test_an_unknown_method_names_the_closest():
    with pytest.raises(KeyError, match="did you mean 'grpo'"):
        get_method("grp")
