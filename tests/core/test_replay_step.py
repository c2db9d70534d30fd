"""Verified replay inside ``grpo_step`` on the float64 tiny model (ALGORITHMS.md §17): the update
adds exactly ``scale * dL_replay/dtheta`` (a reference from full logits written here), the
control's update is the replay-off update bit for bit, and chunking does not change it."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maxent_grpo.core.logprobs import Scoring
from maxent_grpo.core.replay import ReplayBatch, replay_backward, replay_layout, replay_scale
from maxent_grpo.core.step import StepHooks, grpo_step

_spec = importlib.util.spec_from_file_location("ddp_step_worker", Path(__file__).resolve().parents[1] / "ddp_step_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

GROUPS = worker.REPLAY_GROUPS


@pytest.fixture(scope="module")
def base_model(tiny_model_dir):
    return worker.load_model(str(tiny_model_dir))


# How the step scores its rows, the replay's included: each row alone, each distinct prompt once
# (a replay group's exemplars behind one prompt), and that packed padding-free.
SCORINGS = {"rows": Scoring(share_prompts=False), "shared": Scoring(share_prompts=True),
            "shared_packed": Scoring(share_prompts=True, packing=True)}


def _update(model, replay=None, scoring=SCORINGS["rows"]):
    """Minus the SGD(lr=1) update of one step on the worker's rows (= the step's gradient)."""
    model = copy.deepcopy(model)
    rows = worker.build_rows(model)
    before = [p.detach().clone() for p in model.parameters()]
    result = grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), worker.micro_batches(rows, [(0, 4), (4, 8)]),
                       worker.spec(beta=0.0, loss_type="dr_grpo", max_completion_length=worker.COMPLETION_LEN), scoring,
                       replay=replay)
    return result, [b - p.detach() for b, p in zip(before, model.parameters())]


def _reference_scores(model) -> list[torch.Tensor]:
    """Each exemplar's mean log-prob, its row run alone and unpadded, in the groups' order."""
    scores = []
    for prompt, exemplars in GROUPS:
        for exemplar in exemplars:
            ids = torch.tensor([list(prompt) + list(exemplar)])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].to(torch.float64)
            scores.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(exemplar)[:, None])[:, 0].mean())
    return scores


def _by_group(scores: list) -> list[list]:
    out, start = [], 0
    for _, exemplars in GROUPS:
        out.append(scores[start : start + len(exemplars)])
        start += len(exemplars)
    return out


def _reference_replay_gradient(model, scale):
    """scale * d/dtheta of mean_g mean_m -(mean log-prob of exemplar m), each row run alone, unpadded."""
    model = copy.deepcopy(model)
    group_losses = [-torch.stack(group).mean() for group in _by_group(_reference_scores(model))]
    loss = scale * torch.stack(group_losses).mean()
    return torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)


def _batch(compute_only=False, rows_per_pass=8):
    return worker.replay_batch(compute_only, rows_per_pass)


@pytest.mark.parametrize("scoring", list(SCORINGS))
def test_the_update_adds_the_scaled_replay_gradient(base_model, scoring):
    _, fresh = _update(base_model, scoring=SCORINGS[scoring])
    result, with_replay = _update(base_model, _batch(), SCORINGS[scoring])
    reference = _reference_replay_gradient(base_model, replay_scale(0.1, 4))
    scale = max(float(g.abs().max()) for g in reference if g is not None)
    assert scale > 1e-6
    # transformers' Llama RMSNorm computes in float32 even in a float64 model. Row by row, the gradient
    # of each row crosses that cast alone, as in the reference; a shared prompt's gradient is the sum
    # over its rows before it crosses, so it agrees to float32 rounding of the norm's input, not to 1e-12.
    tolerance = 1e-12 if scoring == "rows" else 1e-6 * scale
    for f, w, r in zip(fresh, with_replay, reference):
        expected = f + (0 if r is None else r)
        assert torch.allclose(w, expected, rtol=0, atol=tolerance)
    assert result.metrics["replay/effective_coef"] == replay_scale(0.1, 4)
    assert result.metrics["replay/groups"] == 3 and result.metrics["replay/modes"] == 6
    assert result.metrics["replay/applied_loss"] == result.metrics["replay/raw_loss"] > 0
    with torch.no_grad():
        scores = [float(s) for s in _reference_scores(base_model)]
    loss = -sum(sum(group) / len(group) for group in _by_group(scores)) / len(GROUPS)
    assert result.metrics["replay/loss"] == pytest.approx(loss, rel=1e-12)
    assert result.metrics["replay/score_min"] == pytest.approx(min(scores), rel=1e-12)


@pytest.mark.parametrize("scoring", list(SCORINGS))
def test_chunks_give_the_same_update(base_model, scoring):
    """Chunks of 2 rows split the 3-mode group and trim their columns: the same update and value."""
    whole_result, whole = _update(base_model, _batch(rows_per_pass=8), SCORINGS[scoring])
    chunked_result, chunked = _update(base_model, _batch(rows_per_pass=2), SCORINGS[scoring])
    assert max(float((a - b).abs().max()) for a, b in zip(whole, chunked)) < 1e-14
    assert chunked_result.metrics["replay/loss"] == pytest.approx(whole_result.metrics["replay/loss"], rel=1e-13)


@pytest.mark.parametrize("scoring, positions", [("rows", 3 * (4 + 3)), ("shared", 4 + 3 * 3)])
def test_a_groups_exemplars_run_their_prompt_once(base_model, scoring, positions):
    """One group (a 4-token prompt, exemplars of 3, 1 and 2 tokens): with shared prompts the
    replay's forward runs the prompt once and each exemplar behind it, 4 + 3 x 3 positions
    against 3 x 7 row by row, in one differentiable pass (no scoring pass before it)."""
    model = copy.deepcopy(base_model)
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append(args[0].numel()))
    batch = ReplayBatch(replay_layout([GROUPS[2]], pad_token_id=0), replay_scale(0.1, 4))
    metrics = replay_backward(model, batch, SCORINGS[scoring])
    hook.remove()
    assert sum(seen) == positions and metrics["replay/modes"] == 3


def test_the_control_is_the_replay_off_update_bit_for_bit(base_model):
    _, fresh = _update(base_model)
    result, control = _update(base_model, _batch(compute_only=True))
    assert all(torch.equal(a, b) for a, b in zip(fresh, control))
    assert result.metrics["replay/applied_loss"] == 0.0 and result.metrics["replay/raw_loss"] > 0
    assert result.metrics["replay/compute_only"] == 1.0


def test_the_replay_pass_is_the_trainers_to_time(base_model):
    """The step enters its hooks' ``"replay"`` phase once, around the replay, and its ``"update"`` phase
    once, after every backward; the trainer's timer (``replay/time_s``, ``time/optimizer``) gives the
    update and metrics of the untimed step, with its seconds counted."""
    from maxent_grpo.training.loop import _timed_phase

    seen, timings = [], {"replay/time_s": 0.0, "time/optimizer": 0.0}

    @contextlib.contextmanager
    def timed(name):
        seen.append(name)
        with _timed_phase(torch.device("cpu"), 1, timings, name):
            yield

    model = copy.deepcopy(base_model)
    rows = worker.build_rows(model)
    batch = _batch()
    args = (worker.micro_batches(rows, [(0, 4), (4, 8)]),
            worker.spec(beta=0.0, loss_type="dr_grpo", max_completion_length=worker.COMPLETION_LEN),
            Scoring(share_prompts=False))
    result = grpo_step(model, torch.optim.SGD(model.parameters(), lr=1.0), *args, replay=batch,
                       hooks=StepHooks(phase=timed))
    assert seen == ["replay", "update"] and timings["replay/time_s"] > 0.0 and timings["time/optimizer"] > 0.0
    plain, with_plain = _update(base_model, batch)
    assert {k: v for k, v in result.metrics.items() if k.startswith("replay/")} == {
        k: v for k, v in plain.metrics.items() if k.startswith("replay/")}
    before = [p.detach() for p in base_model.parameters()]
    assert all(torch.equal(b - p.detach(), w) for b, p, w in zip(before, model.parameters(), with_plain))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_give_the_single_process_replay_gradient(base_model, tiny_model_dir, tmp_path):
    """ALGORITHMS.md §17 rule 6: with the fresh rows split over two gloo processes and both replaying
    the same groups, the update (fresh plus replay) is the one-process update; the replay term counts
    once, not once per process."""
    out = tmp_path / "rank0.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(Path(__file__).resolve().parents[1] / "ddp_step_worker.py"), str(tiny_model_dir), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = torch.load(out)["replay"]
    single, grads = _update(base_model, _batch())
    _, fresh = _update(base_model)
    scale = max(float(g.abs().max()) for g in grads)
    assert max(float((a - b).abs().max()) for a, b in zip(ddp["grads"], grads)) < 1e-10 * scale
    # The replay term is there, and once: twice it would move the update by a whole replay gradient.
    assert max(float((a - b).abs().max()) for a, b in zip(grads, fresh)) > 1e-4 * scale
    for name in ("replay/loss", "replay/applied_loss", "replay/groups", "replay/modes"):
        assert ddp["metrics"][name] == pytest.approx(single.metrics[name], rel=1e-12), name
    assert ddp["loss"] == pytest.approx(single.loss, rel=1e-10)
