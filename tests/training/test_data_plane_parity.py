"""The seed's parity check (NeMo-RL ``grpo_sync``): the built-in default run through the local data
plane and through TransferQueue (its documented Ray mode) logs the same rewards, losses and
validation, step by step; only timings differ. Six steps of the real default (SmolLM2-135M on
chain_sum), with in-loop validation every three steps (its own ``val/<step>`` partition).

At learning rate 0: two runs of the default on this CPU, on the same plane and in the same
process, are not bitwise equal after their first optimizer step (the backward's last bits vary, then
the weights and the sampling diverge; measured at fp32 and bf16), so only frozen weights make the
comparison exact; the gradient norm itself is left out for that reason. What is known of the cause:
four 4-step local runs at learning rate 0 in one process log step 2's gradient norm as 2.89330101,
2.89330101, 2.8931706, 2.8931706 (bf16 autocast; loss and every other figure equal), with or without
TransferQueue in between and with ``MKL_CBWR=AUTO,STRICT``; one ``grpo_step`` repeated on a fixed
batch is bitwise repeatable. So some state that builds up over runs in a process picks between two
backward results; the op is not found.
Every step still samples, scores and trains on its own batch through the plane. The tiny model's
runs are bitwise reproducible and learn: tests/rollout/test_data_plane.py compares them."""

from __future__ import annotations

import importlib.util

import pytest

from maxent_grpo.cli import main
from maxent_grpo.training.metrics import read_metrics

pytestmark = pytest.mark.slow


def _varies(key: str) -> bool:
    """Timings, and the gradient norm: even at frozen weights two runs of this step's backward on the
    default model differ in the last bits (1.9404088 against 1.9404062 at step 3, a CI run)."""
    return key.startswith("time/") or key in ("step_time", "step_cpu_time", "grad_norm")


def test_the_default_run_is_the_same_through_transferqueue(tmp_path):
    if importlib.util.find_spec("transfer_queue") is None:
        pytest.skip("the transferqueue extra is not installed")
    runs = {}
    for plane in ("local", "transferqueue"):
        out = tmp_path / plane
        assert main(["train", "--output-dir", str(out), "--max-steps", "6",
                     "--set", "logging.progress_bar=false", "--set", f"rollout.data_plane={plane}",
                     "--set", "data.eval_size=8", "--set", "eval.every_steps=3", "--set", "eval.num_prompts=4",
                     "--set", "eval.k=2", "--set", "training.learning_rate=0"]) == 0
        runs[plane] = [{k: v for k, v in row.items() if not _varies(k)} for row in read_metrics(out / "metrics.jsonl")]
    local, tq = runs["local"], runs["transferqueue"]
    assert [r["step"] for r in local] == list(range(1, 7))
    assert "eval/pass@1" in local[2] and "eval/pass@1" in local[5]
    assert any(r["loss"] != 0 for r in local) and len({r["reward"] for r in local}) > 1
    assert [{k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)} for a, b in zip(local, tq)] == [{}] * 6
