import copy
import dataclasses
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maxent_grpo.core.bounds import SpecError
from maxent_grpo.core.listwise import ListwiseParams
from maxent_grpo.core.losses import ClipSettings
from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.core.step import Comm, LossSpec, grpo_step

_spec = importlib.util.spec_from_file_location("ddp_step_worker", (Path(__file__).resolve().parents[1] / "ddp_step_worker.py"))
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

G = 4
N = len(worker.LENGTHS)
L_MAX = worker.COMPLETION_LEN
ONE = [(0, N)]
TWO = [(0, 4), (4, 8)]
FOUR = [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return worker.load_model(str(tiny_model_dir))


@pytest.fixture()
def model(base_model):
    return copy.deepcopy(base_model)


@pytest.fixture(scope="module")
def rows(base_model):
    return worker.build_rows(base_model)


def _step(model, mbs, share_prompts=False, **kwargs):
    """One grpo_step with SGD(lr=1): returns the result and the gradient (= minus the update).

    Prompts are not shared by default here: HF's RMSNorm runs in float32 even in
    a float64 model, and the shared path sums per-prompt gradients in another
    order, which these 1e-10 comparisons would see (its own tests use 1e-6).
    """
    before = [p.detach().clone() for p in model.parameters()]
    result = worker.step(model, torch.optim.SGD(model.parameters(), lr=1.0), mbs, share_prompts=share_prompts,
                         **kwargs)
    grads = [b - p.detach() for b, p in zip(before, model.parameters())]
    return result, grads


def _max_abs_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _grad_scale(a):
    return max(float(x.abs().max()) for x in a)


# ----------------------------------------------------------- float64 reference


def _reference_terms(model, rows, temperature=1.0):
    """Completion log-probs and entropies from full logits and a plain log_softmax."""
    p = worker.PROMPT_LEN
    attn = rows["attention_mask"]
    # Left padding: positions count the real tokens before each one (as in generation).
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=rows["input_ids"], attention_mask=attn, position_ids=positions, use_cache=False).logits
    logsm = torch.log_softmax(logits[:, p - 1 : -1] / temperature, dim=-1)
    logp = logsm.gather(-1, rows["input_ids"][:, p:, None]).squeeze(-1)
    ent = -(logsm.exp() * logsm).sum(-1)
    return logp, ent


def _reference_loss(model, rows, *, loss_type, beta, eps_low=0.2, eps_high=0.2, alpha=0.0,
                    temperature=1.0, bounds=ONE):
    """Loss of the whole step written token by token (no shared code with the library)."""
    logp, ent = _reference_terms(model, rows, temperature)
    old, ref, adv = rows["old_logps"], rows["ref_logps"], rows["advantages"]
    vocab = model.config.vocab_size
    stats = {"kl": 0.0, "entropy": 0.0, "low": 0, "high": 0}
    row_loss, row_ent, row_len = [], [], []
    for i, t_i in enumerate(worker.LENGTHS):
        s, h = logp.new_zeros(()), logp.new_zeros(())
        for t in range(t_i):
            c = torch.exp(logp[i, t] - old[i, t])
            a = adv[i]
            surrogate = -torch.minimum(c * a, c.clamp(1 - eps_low, 1 + eps_high) * a)
            d = ref[i, t] - logp[i, t]
            kl = torch.exp(d) - d - 1
            s = s + surrogate + beta * kl
            h = h + ent[i, t] / math.log(vocab)
            stats["kl"] += kl.item()
            stats["entropy"] += ent[i, t].item()
            stats["low"] += int(a < 0 and c.item() < 1 - eps_low)
            stats["high"] += int(a > 0 and c.item() > 1 + eps_high)
        row_loss.append(s)
        row_ent.append(h)
        row_len.append(t_i)
    n_tok = sum(row_len)
    if loss_type == "dapo":
        loss, bonus = sum(row_loss) / n_tok, sum(row_ent) / n_tok
    elif loss_type == "dr_grpo":
        loss, bonus = sum(row_loss) / (N * L_MAX), sum(r / max(t, 1) for r, t in zip(row_ent, row_len)) / N
    elif loss_type == "grpo":
        loss = sum(r / max(t, 1) for r, t in zip(row_loss, row_len)) / N
        bonus = sum(r / max(t, 1) for r, t in zip(row_ent, row_len)) / N
    else:  # bnpo: mean over micro-batches of their token means
        loss = sum(sum(row_loss[a:b]) / max(sum(row_len[a:b]), 1) for a, b in bounds) / len(bounds)
        bonus = sum(sum(row_ent[a:b]) / max(sum(row_len[a:b]), 1) for a, b in bounds) / len(bounds)
    stats = {k: v / n_tok for k, v in stats.items()}
    return loss - alpha * bonus, bonus, stats


def _reference_grads(model, loss):
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, model.parameters())]


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo", "bnpo"])
def test_loss_and_gradient_match_float64_reference(model, rows, loss_type):
    ref_model = copy.deepcopy(model)
    cfg = dict(max_completion_length=L_MAX, entropy_coef=0.05, temperature=0.8)
    result, grads = _step(model, worker.micro_batches(rows, FOUR), loss_type=loss_type, beta=0.04,
                          epsilon_high=0.28, **cfg)
    loss, bonus, stats = _reference_loss(ref_model, rows, loss_type=loss_type, beta=0.04, eps_high=0.28,
                                         alpha=0.05, temperature=0.8, bounds=FOUR)
    assert result.loss == pytest.approx(loss.item(), rel=1e-10)
    assert result.metrics["entropy_bonus"] == pytest.approx(bonus.item(), rel=1e-10)
    assert result.metrics["kl"] == pytest.approx(stats["kl"], rel=1e-10)
    assert result.metrics["entropy"] == pytest.approx(stats["entropy"], rel=1e-10)
    assert result.metrics["clip_ratio/low_mean"] == pytest.approx(stats["low"])
    assert result.metrics["clip_ratio/high_mean"] == pytest.approx(stats["high"])
    assert result.metrics["clip_ratio/region_mean"] == pytest.approx(stats["low"] + stats["high"])
    assert stats["low"] > 0 and stats["high"] > 0  # the data exercises both clip sides
    ref_grads = _reference_grads(ref_model, loss)
    assert _max_abs_diff(grads, ref_grads) < 1e-12 * _grad_scale(ref_grads)
    assert result.grad_norm == pytest.approx(math.sqrt(sum(float((g * g).sum()) for g in ref_grads)), rel=1e-9)


@pytest.mark.parametrize("loss_type", ["dapo", "dr_grpo", "grpo"])
def test_gradient_invariant_to_micro_batching(base_model, rows, loss_type):
    cfg = dict(max_completion_length=L_MAX)
    kwargs = dict(loss_type=loss_type, beta=0.04, **cfg)
    r1, g1 = _step(copy.deepcopy(base_model), worker.micro_batches(rows, ONE), **kwargs)
    r4, g4 = _step(copy.deepcopy(base_model), worker.micro_batches(rows, FOUR), 
                   **kwargs)
    assert _max_abs_diff(g1, g4) < 1e-10 * _grad_scale(g1)
    assert r1.loss == pytest.approx(r4.loss, rel=1e-10)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_shared_prompt_step_matches_plain_step_and_micro_batching(base_model, rows, loss_type):
    kwargs = dict(loss_type=loss_type, beta=0.04, max_completion_length=L_MAX)
    r_plain, g_plain = _step(copy.deepcopy(base_model), worker.micro_batches(rows, ONE), **kwargs)
    r1, g1 = _step(copy.deepcopy(base_model), worker.micro_batches(rows, ONE), share_prompts=True, **kwargs)
    r4, g4 = _step(copy.deepcopy(base_model), worker.micro_batches(rows, FOUR), share_prompts=True,
                   **kwargs)
    for g, r in ((g1, r1), (g4, r4)):
        assert _max_abs_diff(g, g_plain) < 1e-6 * _grad_scale(g_plain)
        assert r.loss == pytest.approx(r_plain.loss, rel=1e-6)


def test_bnpo_depends_on_micro_batching(base_model, rows):
    _, g1 = _step(copy.deepcopy(base_model), worker.micro_batches(rows, ONE), loss_type="bnpo")
    _, g4 = _step(copy.deepcopy(base_model), worker.micro_batches(rows, FOUR), loss_type="bnpo")
    assert _max_abs_diff(g1, g4) > 1e-3 * _grad_scale(g1)


def _listwise_extra():
    gen = torch.Generator().manual_seed(7)
    w = torch.softmax(torch.randn(N // G, G, generator=gen, dtype=torch.float64), -1).reshape(-1)
    return {"listwise_weights": w}


@pytest.mark.parametrize("score", ["token_mean", "sum"])
@pytest.mark.parametrize("policy_loss", ["listwise_cross_entropy", "listwise_weighted_mle", "listwise_centered_mle"])
def test_listwise_matches_reference_and_is_micro_batch_invariant(base_model, rows, policy_loss, score):
    extra = _listwise_extra()
    active = torch.tensor([True, True])
    cfg = dict(policy_loss=policy_loss, policy_params=ListwiseParams(score=score))
    one = worker.micro_batches(rows, ONE, **extra)
    one = [dataclasses.replace(one[0], listwise_active=active)]
    two = [dataclasses.replace(mb, listwise_active=active[k : k + 1])
           for k, mb in enumerate(worker.micro_batches(rows, [(0, 4), (4, 8)], **extra))]
    ref_model = copy.deepcopy(base_model)
    r1, g1 = _step(copy.deepcopy(base_model), one, **cfg)
    r2, g2 = _step(copy.deepcopy(base_model), two, **cfg)
    assert _max_abs_diff(g1, g2) < 1e-10 * _grad_scale(g1)

    # ALGORITHMS.md §4, written out per group: s_i the mean (or sum) of the completion's token
    # log-probs, then -sum w log softmax(s), -sum w s, or -sum (w - 1/G) s.
    logp, _ = _reference_terms(ref_model, rows)
    w = extra["listwise_weights"].view(2, G)
    loss = 0.0
    for grp in range(2):
        s = torch.stack([logp[i, : t].sum() / (max(t, 1) if score == "token_mean" else 1)
                         for i, t in enumerate(worker.LENGTHS[grp * G : (grp + 1) * G], start=grp * G)])
        if policy_loss == "listwise_cross_entropy":
            loss = loss - (w[grp] * (s - torch.logsumexp(s, 0))).sum()
        elif policy_loss == "listwise_weighted_mle":
            loss = loss - (w[grp] * s).sum()
        else:
            loss = loss - ((w[grp] - 1.0 / G) * s).sum()
    loss = loss / 2
    assert r1.loss == pytest.approx(loss.item(), rel=1e-10)
    assert r2.loss == pytest.approx(loss.item(), rel=1e-10)
    ref_grads = _reference_grads(ref_model, loss)
    assert _max_abs_diff(g1, ref_grads) < 1e-12 * _grad_scale(ref_grads)


def test_inactive_listwise_group_contributes_nothing(base_model, rows):
    extra = _listwise_extra()
    cfg = dict(policy_loss="listwise_cross_entropy", policy_params=ListwiseParams())
    both = [dataclasses.replace(mb, listwise_active=torch.tensor([k == 0]))
            for k, mb in enumerate(worker.micro_batches(rows, [(0, 4), (4, 8)], **extra))]
    only = [dataclasses.replace(worker.micro_batches(rows, [(0, 4)], **extra)[0],
                                listwise_active=torch.tensor([True]))]
    r_both, g_both = _step(copy.deepcopy(base_model), both, **cfg)
    r_only, g_only = _step(copy.deepcopy(base_model), only, **cfg)
    assert _max_abs_diff(g_both, g_only) < 1e-12 * _grad_scale(g_only)
    assert r_both.loss == pytest.approx(r_only.loss, rel=1e-12)


def test_row_weights_one_is_identity_and_zero_removes_rows(base_model, rows):
    _, g = _step(copy.deepcopy(base_model), worker.micro_batches(rows, ONE))
    _, g_one = _step(copy.deepcopy(base_model),
                     worker.micro_batches(rows, ONE, row_weights=torch.ones(N, dtype=torch.float64)))
    assert _max_abs_diff(g, g_one) == 0
    zero_half = torch.tensor([1.0] * 4 + [0.0] * 4, dtype=torch.float64)
    _, g_half = _step(copy.deepcopy(base_model), worker.micro_batches(rows, ONE, row_weights=zero_half))
    no_adv = {**rows, "advantages": rows["advantages"] * zero_half}
    _, g_ref = _step(copy.deepcopy(base_model), worker.micro_batches(no_adv, ONE))
    # With old != current the surrogate is not linear in A, but A=0 and weight 0 both zero the row.
    assert _max_abs_diff(g_half, g_ref) < 1e-12 * _grad_scale(g_ref)


def test_scheduler_and_grad_clipping(model, rows):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    before = [p.detach().clone() for p in model.parameters()]
    result = worker.step(model, opt, worker.micro_batches(rows, ONE), max_grad_norm=1e-3, lr_scheduler=sched)
    update = math.sqrt(sum(float(((b - p.detach()) ** 2).sum()) for b, p in zip(before, model.parameters())))
    assert result.grad_norm > 1e-3
    assert update == pytest.approx(1e-3, rel=1e-6)
    assert opt.param_groups[0]["lr"] == 0.5
    assert all(p.grad is None for p in model.parameters())


def test_argument_errors(model, rows):
    mbs = worker.micro_batches(rows, FOUR)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    no_ref = [dataclasses.replace(mb, ref_logps=None) for mb in mbs]
    scoring = Scoring(share_prompts=False)
    cases = [
        (no_ref, LossSpec(beta=0.1), "ref_logps"),
        (mbs, LossSpec(max_completion_length=3), "max_completion_length"),
        ([], LossSpec(), "micro_batches"),
        (mbs[:1] + [dataclasses.replace(mbs[1], num_generations=2)], LossSpec(), "num_generations"),
        (mbs, LossSpec(policy_loss="listwise_cross_entropy", policy_params=ListwiseParams()), "listwise_weights"),
    ]
    for micro_batches, spec, name in cases:
        with pytest.raises(ValueError, match=name):
            grpo_step(model, opt, micro_batches, spec, scoring)
    with pytest.raises(ValueError, match="all_reduce_sum"):
        Comm(world_size=2)
    # Every bound of the loss is its record's, raised as a SpecError naming the setting.
    for setting, make in [
        ("policy_loss", lambda: LossSpec(policy_loss="ppo")),
        ("kl_estimator", lambda: LossSpec(kl_estimator="k9")),
        ("loss_type", lambda: LossSpec(loss_type="sum")),
        ("max_completion_length", lambda: LossSpec(loss_type="dr_grpo")),
        ("top_entropy_quantile", lambda: LossSpec(top_entropy_quantile=0.0)),
        ("entropy_coef", lambda: LossSpec(entropy_coef=-1.0)),
        ("clip_coef", lambda: ListwiseParams(clip_coef=-1.0)),
        ("score", lambda: ListwiseParams(score="max")),
        ("policy_params", lambda: LossSpec(policy_params=1.0)),
        ("dual_clip", lambda: ClipSettings(dual_clip=0.5)),
        ("importance_sampling_level", lambda: ClipSettings(importance_sampling_level="seq")),
        ("delta", lambda: ClipSettings(delta=1.1)),
    ]:
        with pytest.raises(SpecError) as err:
            make()
        assert err.value.setting == setting
    with pytest.raises(ValueError, match="temperature"):
        Scoring(temperature=0.0)
    with pytest.raises(ValueError, match="completion_mask"):
        dataclasses.replace(mbs[0], completion_mask=torch.ones(2, 3))


def test_gspo_and_top_entropy_step_runs_and_reports(model, rows):
    result = worker.step(model, torch.optim.SGD(model.parameters(), lr=0.1), worker.micro_batches(rows, FOUR),
                         importance_sampling_level="sequence", top_entropy_quantile=0.5, beta=0.04)
    for key in ("loss", "policy_loss", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean"):
        assert math.isfinite(result.metrics[key]), key
    assert 0 <= result.metrics["clip_ratio/region_mean"] <= 1
    assert result.loss == pytest.approx(result.metrics["policy_loss"] + 0.04 * result.metrics["kl"], rel=1e-9)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_give_the_single_process_gradient(base_model, rows, tiny_model_dir, tmp_path):
    out = tmp_path / "rank0.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str((Path(__file__).resolve().parents[1] / "ddp_step_worker.py")), str(tiny_model_dir), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = torch.load(out)
    single, grads = _step(copy.deepcopy(base_model), worker.micro_batches(rows, ONE), beta=0.05, loss_type="dapo")
    for ddp in (runs["once"], runs["every"]):  # runs["replay"]: test_replay_step's
        assert _max_abs_diff(ddp["grads"], grads) < 1e-10 * _grad_scale(grads)
        assert ddp["loss"] == pytest.approx(single.loss, rel=1e-10)
        assert ddp["metrics"]["kl"] == pytest.approx(single.metrics["kl"], rel=1e-10)
    # Two micro-batches per rank: the trainer's gradient_sync all-reduces each bucket once, not twice.
    once, every = runs["once"], runs["every"]
    assert once["buckets"] == every["buckets"] >= 1
    assert (once["all_reduces"], every["all_reduces"]) == (once["buckets"], 2 * once["buckets"])


@pytest.mark.parametrize("quantile", [0.5, 0.2])
def test_top_entropy_gradient_invariant_to_micro_batching(base_model, rows, quantile):
    """ALGORITHMS.md §3: the top fraction of the whole step's tokens, however the step is split."""
    kwargs = dict(loss_type="dapo", top_entropy_quantile=quantile, max_completion_length=L_MAX)
    _, g1 = _step(copy.deepcopy(base_model), worker.micro_batches(rows, ONE), **kwargs)
    _, g4 = _step(copy.deepcopy(base_model), worker.micro_batches(rows, FOUR), **kwargs)
    assert _max_abs_diff(g1, g4) < 1e-10 * _grad_scale(g1)
    _, g_all = _step(copy.deepcopy(base_model), worker.micro_batches(rows, ONE), loss_type="dapo",
                     max_completion_length=L_MAX)
    assert _max_abs_diff(g1, g_all) > 1e-3 * _grad_scale(g_all)  # the mask does drop tokens


def test_activation_checkpointing_recomputes_the_layers_and_leaves_the_gradient_unchanged(tiny_model_dir):
    """training.gradient_checkpointing: each decoder layer runs again in the backward (its MLP is
    called again in each micro-batch's backward), and the float32 gradient is the one without (1e-6 relative)."""
    from transformers import AutoModelForCausalLM

    from maxent_grpo.models import enable_activation_checkpointing

    def step(checkpointing: bool):
        # As the trainer loads it: in eval mode (from_pretrained's), where transformers would not recompute.
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attention_dropout=0.1)
        assert not model.training
        if checkpointing:
            enable_activation_checkpointing(model)
        calls = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        _, grads = _step(model, worker.micro_batches(worker.build_rows(model), TWO), beta=0.05, loss_type="dapo")
        return grads, len(calls)

    plain, plain_calls = step(False)
    checkpointed, checkpointed_calls = step(True)
    assert checkpointed_calls == plain_calls + len(TWO)  # one recompute per micro-batch's backward
    assert _max_abs_diff(checkpointed, plain) <= 1e-6 * _grad_scale(plain)


def test_activation_checkpointing_with_shared_prompts_needs_the_one_pass_layout_named_in_one_line():
    from maxent_grpo.config.load import ConfigError
    from tiny_runs import compiled

    with pytest.raises(ConfigError, match="^training.gradient_checkpointing: needs training.share_prompts: false, "
                       "or training.inline_prompts"):
        compiled(None, ["training.gradient_checkpointing=true", "training.share_prompts=true",
                        "training.inline_prompts=false"])
    plan = compiled(None, ["training.gradient_checkpointing=true", "training.share_prompts=false"])
    assert plan.model.gradient_checkpointing
    # The CPU's auto: shared prompts in the one-pass layout, which checkpointing recomputes like any forward;
    # on CUDA share_prompts auto is off (training/precision.py).
    on_cpu = compiled(None, ["training.gradient_checkpointing=true"]).scoring
    assert on_cpu.share_prompts and on_cpu.packing and on_cpu.inline_prompts
    assert not compiled(None, ["training.gradient_checkpointing=true"], cuda=True).scoring.share_prompts
