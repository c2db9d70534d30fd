"""The GPU check's ``update-ragged`` and ``gap-10`` stages without a GPU: the ragged batch both sides
of ``benchmarks/update_ragged.py`` get, and both stages' CPU replicas through ``scripts/gpu_check.py
run --cpu`` on a replica of the GPU machine's image once its wheels are in (tests/gpu_image.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gpu_image import MISSING_WITH_WHEELS, REPO, replica_env  # tests/ is on pytest's pythonpath

sys.path.insert(0, str(REPO))  # benchmarks/ is a top-level folder of the repo, not part of the package

from benchmarks.update_ragged import (  # noqa: E402
    LAYOUTS,
    LENGTH_QUANTILES,
    length_quantiles_from_results,
    ours_packed,
    ragged_batch,
    trl_inputs,
)


def test_the_ragged_batch_is_the_same_on_both_sides_and_ragged():
    prompts, group, prompt_len, limit, pad = 4, 8, 6, 64, 0
    batch = ragged_batch(512, prompts, group, prompt_len, limit, seed=3)
    ours = ours_packed(batch, pad, "cpu")
    theirs = trl_inputs(batch, pad, "cpu")
    assert torch.equal(ours.input_ids, torch.cat([theirs["prompt_ids"], theirs["completion_ids"]], 1))
    assert torch.equal(ours.attention_mask, torch.cat([theirs["prompt_mask"], theirs["completion_mask"]], 1))
    assert ours.prompt_length == theirs["prompt_ids"].shape[1] == prompt_len
    assert torch.equal(ours.completion_mask, theirs["completion_mask"].float())
    assert torch.equal(theirs["advantages"], batch.advantages)
    lengths = [len(c) for c in batch.completion_ids]
    assert ours.completion_lengths.tolist() == theirs["completion_mask"].sum(1).tolist() == lengths
    assert int(theirs["num_items_in_batch"]) == sum(lengths)
    # Ragged: lengths differ within every group, some reach the limit and some stop well short of it.
    groups = [lengths[i:i + group] for i in range(0, len(lengths), group)]
    assert all(len(set(g)) > 1 for g in groups)
    assert max(lengths) == limit and min(lengths) < limit / 2
    # Advantages: centred and scaled within each group; the prompt counts once per group in the tokens.
    assert torch.allclose(batch.advantages.view(prompts, group).sum(1), torch.zeros(prompts), atol=1e-5)
    assert batch.trained_tokens == prompts * prompt_len + sum(lengths)
    # Seeded: the same batch again, another for another seed.
    again = ragged_batch(512, prompts, group, prompt_len, limit, seed=3)
    assert again.completion_ids == batch.completion_ids and torch.equal(again.advantages, batch.advantages)
    assert ragged_batch(512, prompts, group, prompt_len, limit, seed=4).completion_ids != batch.completion_ids


def test_the_length_distribution_is_the_one_of_the_stored_results():
    assert length_quantiles_from_results(REPO / "benchmarks" / "results") == LENGTH_QUANTILES


@pytest.mark.slow
def test_the_gpu_check_runs_update_ragged_and_gap_10_on_the_cpu(tmp_path):
    """Both stages' CPU replicas: the update table holds each of our layouts with a fixed and an auto
    micro-batch, and TRL's row; the gap stage a table per LM head with its 2 steps, each gap above 0."""
    env = replica_env(tmp_path / "image", tmp_path / "home", MISSING_WITH_WHEELS)
    out = tmp_path / "out"
    cmd = [sys.executable, "scripts/gpu_check.py", "run", str(out), "--cpu", "--no-install", "--budget", "900",
           "--stages", "update-ragged,gap-10"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert "| update-ragged | passed |" in summary and "| gap-10 | passed |" in summary, summary
    rows = [line.split(" | ") for line in summary.splitlines() if line.startswith(("| ours |", "| trl |"))]
    assert [(r[0], r[1], r[2].split(" ")[0]) for r in rows] == [
        *[("| ours", layout, micro) for layout in LAYOUTS for micro in ("4", "auto")], ("| trl", "padded", "4")]
    assert all(float(r[3]) > 0 for r in rows)
    assert "ours/TRL tokens/s: " in summary
    for head in ("bf16", "float32"):
        assert f"### The sampler/trainer log-prob gap, LM head {head}" in summary
        steps = [line.split("|") for line in summary.splitlines() if line.startswith(f"| {head} | ")]
        assert [s[2].strip() for s in steps] == ["1", "2", "mean"]
        assert all(float(s[4]) > 0 for s in steps[:2])  # rms d: a bf16 copy never samples as the trainer scores
    files = {p.name for p in out.iterdir()}
    assert files == {"summary.md", "sides.tar.gz", "update-ragged.log", "gap-10.log"}


def test_auto_micro_batches_on_cuda_are_sized_by_the_trainers_budget(tiny_model_dir, monkeypatch):
    """``auto`` on a CUDA machine: the plan sizes from memory, and the rows are the budget's whole groups
    at the batch's lengths (CUDA's memory counters stand in here: 5 GiB free of 80, nothing held by torch,
    which leaves 1 GiB after the 5% margin: the tiny model's 16 rows fit in one micro-batch)."""
    from benchmarks import update_ragged
    from maxent_grpo.models import load_model_and_tokenizer
    from maxent_grpo.training.micro_batches import MicroBatchBudget
    from maxent_grpo.training.precision import Machine

    model, tok = load_model_and_tokenizer(tiny_model_dir)
    batch = ragged_batch(model.config.vocab_size, 4, 4, 8, 32)
    monkeypatch.setattr(Machine, "here", classmethod(lambda cls, training=True: cls(fast_bf16=True, cuda=True)))
    plan = update_ragged.our_plan("padded", "auto", batch, 32, bf16=True)
    assert plan.micro_batch_from_memory
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    seen = []
    rows = MicroBatchBudget.rows
    monkeypatch.setattr(MicroBatchBudget, "rows", lambda self, *a: seen.append(a) or rows(self, *a))
    packed = ours_packed(batch, tok.pad_token_id, "cpu")
    got = update_ragged.micro_rows(plan, model, packed)
    assert seen == [(16, packed.input_ids.shape[1], packed.completion_mask.shape[1])]
    assert got == 16
