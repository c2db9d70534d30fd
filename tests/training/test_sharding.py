"""FSDP2 (``training.strategy: fsdp2``) on 2 gloo processes: the single-process gradient,
the gathered weights, exact resume, a checkpoint ``from_pretrained`` loads and a save that
fails cleanly; and the config combinations it refuses."""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from maxent_grpo.training.checkpoint import verify_checkpoint
from maxent_grpo.config.load import ConfigError, GenerationConfig, load_config
from tiny_runs import compiled

from ddp_step_worker import build_rows, build_shared_rows, micro_batches, step  # noqa: E402
from fsdp2_step_worker import load_model  # noqa: E402
from test_resume import _args, _comparable, _rank_errors, _torchrun  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
# The same micro-batches as the two ranks together: rank 0 has rows 0-3, rank 1 rows 4-7.
RANK_MICRO_BATCHES = [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_fsdp2_processes_give_the_single_process_gradient_and_the_full_weights(tiny_model_dir, tmp_path):
    out = tmp_path / "rank0.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str((Path(__file__).resolve().parents[1] / "fsdp2_step_worker.py")), str(tiny_model_dir), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sharded = torch.load(out)

    # Gathered from the shards: every entry of the loaded model, bit for bit, the tied head included.
    loaded = sharded["loaded"]
    assert "lm_head.weight" in loaded
    for got in (sharded["gathered"], sharded["streamed"]):
        assert got.keys() == loaded.keys()
        assert all(torch.equal(got[k], loaded[k]) for k in loaded)

    model = load_model(str(tiny_model_dir))
    rows = build_rows(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    single = step(model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batches(rows, RANK_MICRO_BATCHES),
                  beta=0.05, loss_type="dapo")
    grads = {k: before[k] - v for k, v in model.state_dict().items()}
    assert max(float(g.abs().max()) for g in grads.values()) > 1e-3
    assert max(float((sharded["grads"][k] - grads[k]).abs().max()) for k in grads) < 1e-6
    assert sharded["loss"] == pytest.approx(single.loss, rel=1e-5)
    # Gradients reduce-scattered once per step (the trainer's gradient_sync), not after each of
    # the two micro-batches, and the same update either way.
    units = sharded["units"]
    assert (sharded["reduce_scatters"], sharded["every_reduce_scatters"]) == (units, 2 * units)
    assert max(float((sharded["grads_every"][k] - sharded["grads"][k]).abs().max()) for k in grads) < 1e-6
    assert sharded["metrics"]["grad_norm"] == pytest.approx(single.metrics["grad_norm"], rel=1e-5)

    # The one-pass layout under FSDP2 (each shared prompt once, completions behind it) takes the step one
    # process takes with one padded row per completion.
    model = load_model(str(tiny_model_dir))
    shared = build_shared_rows(model)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    padded = step(model, torch.optim.SGD(model.parameters(), lr=1.0), micro_batches(shared, RANK_MICRO_BATCHES),
                  beta=0.05, loss_type="dapo", share_prompts=False)
    grads = {k: before[k] - v for k, v in model.state_dict().items()}
    assert max(float((sharded["grads_inline"][k] - grads[k]).abs().max()) for k in grads) < 1e-6
    assert sharded["loss_inline"] == pytest.approx(padded.loss, rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sampling_a_sharded_policy_keeps_ranks_in_step_and_samples_what_one_process_samples(tiny_model_dir, tmp_path):
    """Rank 0 asks for 2 new tokens, rank 1 for 7: rank 0 runs placeholder forwards until rank 1
    is done (both run the same number), and each rank draws what the unsharded model draws with
    its seed."""
    import json

    from fsdp2_sampling_worker import NEW_TOKENS, sample
    from maxent_grpo.models import load_model_and_tokenizer

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str((Path(__file__).resolve().parents[1] / "fsdp2_sampling_worker.py")), str(tiny_model_dir), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["forwards"] == ranks[1]["forwards"] > NEW_TOKENS[0] + 1
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    for rank, got in enumerate(ranks):
        expected = sample(model, tok, rank, synced=False)
        assert [c["ids"] for c in got["completions"]] == [c["ids"] for c in expected]
        assert [c["reason"] for c in got["completions"]] == [c["reason"] for c in expected]
        for a, b in zip(got["completions"], expected):
            assert a["logps"] == pytest.approx(b["logps"], abs=1e-5)
    assert max(len(c["ids"]) for c in ranks[0]["completions"]) <= NEW_TOKENS[0]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_broadcast_load_gives_the_full_load_step_and_resumes_the_same_weights(tiny_model_dir, tmp_path):
    """Built on the meta device on every rank and filled from rank 0 (issue 21 §4): the same weights,
    first step (loss, grad norm, updated weights) and tied head as every rank loading the whole
    model; the rotary ``inv_freq`` (a non-persistent buffer no state dict holds) right on every
    rank; and a resume into a fresh meta-built model restores the weights and the optimizer."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str((Path(__file__).resolve().parents[1] / "fsdp2_load_worker.py")), str(tiny_model_dir), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "result.pt")

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    assert "lm_head.weight" in got["before"]["full"]
    assert same(got["before"]["loaded"], got["before"]["full"])
    full, loaded = got["full"], got["loaded"]
    assert (loaded["loss"], loaded["grad_norm"]) == (full["loss"], full["grad_norm"])
    assert same(loaded["after"], full["after"])
    assert max(float((full["after"][k] - got["before"]["full"][k]).abs().max()) for k in full["after"]) > 1e-4
    for rank in got["ranks"]:
        assert rank["tied"] == (True, True) and rank["resumed_tied"]
        reference = rank["full_buffers"]
        assert any(name.endswith("inv_freq") for name in reference)
        assert same(rank["loaded_buffers"], reference) and same(rank["resumed_buffers"], reference)

    assert got["resumed"]["step"] == 1
    assert same(got["resumed"]["weights"], loaded["after"])
    assert got["resumed"]["second"]["loss"] == loaded["second"]["loss"]
    assert same(got["resumed"]["second"]["after"], loaded["second"]["after"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_run_trains_resumes_exactly_and_saves_a_hugging_face_model(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from maxent_grpo.training.metrics import read_metrics

    fsdp2 = ("training.strategy=fsdp2",)
    full, part = tmp_path / "full", tmp_path / "part"
    proc = _torchrun(_args(tiny_model_dir, full, 3, *fsdp2))
    assert proc.returncode == 0, _rank_errors(proc)
    # A run stopped after step 2: the same folder without the last checkpoint (one launch fewer).
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoints" / "step-3")
    proc = _torchrun([*_args(tiny_model_dir, part, 3, *fsdp2), "--resume"])
    assert proc.returncode == 0, _rank_errors(proc)

    expected = _comparable(read_metrics(full / "metrics.jsonl"))
    assert [r["step"] for r in expected] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in expected)
    assert _comparable(read_metrics(part / "metrics.jsonl")) == expected

    ckpt = full / "checkpoints" / "step-3"
    assert (ckpt / "optimizer" / ".metadata").is_file() and not (ckpt / "optimizer.pt").exists()
    # The tied head is saved once, as save_pretrained does for an unsharded model.
    assert "lm_head.weight" not in load_file(ckpt / "model.safetensors")
    trained = AutoModelForCausalLM.from_pretrained(ckpt)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert trained.lm_head.weight is trained.model.embed_tokens.weight
    with torch.no_grad():
        moved = max(float((p - q).abs().max()) for p, q in zip(trained.parameters(), start.parameters()))
    assert moved > 1e-3
    # The resumed run ends on the same weights.
    resumed = AutoModelForCausalLM.from_pretrained(part / "checkpoints" / "step-3")
    assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), resumed.parameters()))


# The CLI as torchrun's -m starts it, after lowering the file-size limit of the ranks listed in
# SMALL_FILE_RANKS: a write past it fails with EFBIG (Python ignores SIGXFSZ), as on a full disk.
_CLI_WITH_SMALL_FILES = """\
import os, resource, runpy
if os.environ["RANK"] in os.environ["SMALL_FILE_RANKS"].split(","):
    limit = int(os.environ["SMALL_FILE_LIMIT"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
runpy.run_module("maxent_grpo.cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_activation_checkpointing_under_fsdp2_recomputes_and_leaves_the_gradient_unchanged(tiny_model_dir, tmp_path):
    out = tmp_path / "rank0.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str((Path(__file__).resolve().parents[1] / "fsdp2_checkpointing_worker.py")), str(tiny_model_dir), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = torch.load(out)
    off, on = runs["off"], runs["on"]
    assert on["mlp_calls"] == off["mlp_calls"] + 2  # one recompute in each of the 2 micro-batches' backward
    scale = max(float(g.abs().max()) for g in off["grads"].values())
    assert scale > 1e-3
    assert max(float((on["grads"][k] - off["grads"][k]).abs().max()) for k in off["grads"]) <= 1e-6 * scale


_PROCESS_GROUP_WORKER = """\
import os, sys
import torch.distributed as dist
from maxent_grpo.training.distributed import process_group

try:
    with process_group(timeout_minutes=5) as d:
        assert d.any_rank(True)  # a collective
        if sys.argv[1] == "error":
            raise RuntimeError("a failing run")
except RuntimeError:
    pass
assert not dist.is_initialized()
os.write(1, f"left {d.rank}\\n".encode())  # one write: the ranks share the pipe
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["success", "error"])
def test_a_run_leaves_its_process_group_on_success_and_on_error(how):
    """The group is destroyed while the interpreter is whole: a gloo group left for exit to destroy
    aborts a rank now and then (``terminate called without an active exception``, SIGABRT)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--no-python", sys.executable, "-c", _PROCESS_GROUP_WORKER, how]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(proc.stdout.split("\n")[:-1]) == ["left 0", "left 1"], proc.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("ranks", ["0,1", "1"], ids=["every-rank", "rank-1-only"])
def test_a_failing_fsdp2_save_stops_every_rank_with_one_line_and_keeps_the_earlier_checkpoint(
    ranks, tiny_model_dir, tmp_path
):
    """The optimizer shards of step 2 (DCP) do not fit, on every rank or on one: no rank hangs or
    prints a traceback, no staging folder is left, and step 1 is named and intact."""
    out, logs = tmp_path / "run", tmp_path / "logs"
    fsdp2 = ("training.strategy=fsdp2",)
    proc = _torchrun(_args(tiny_model_dir, out, 1, *fsdp2))
    assert proc.returncode == 0, _rank_errors(proc)
    previous = out / "checkpoints" / "step-1"
    # As in test_run_safety: half the weights file. Each rank's optimizer shard is larger (AdamW keeps
    # two values per weight of its half), so step 2 fails in dcp.save, before rank 0 writes the weights.
    limit = (previous / "model.safetensors").stat().st_size // 2
    env = {**os.environ, "MAXENT_GRPO_LOG": "WARNING", "OMP_NUM_THREADS": "1",
           "SMALL_FILE_RANKS": ranks, "SMALL_FILE_LIMIT": str(limit)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           # Each rank's output in its own file: torchrun's report of a failed worker is a traceback of its own.
           "--log-dir", str(logs), "--redirects", "3",
           "--no-python", sys.executable, "-c", _CLI_WITH_SMALL_FILES,
           *_args(tiny_model_dir, out, 3, *fsdp2), "--resume"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, launcher_err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the workers
        proc.communicate()
        pytest.fail("the run hung after the failed save")
    assert proc.returncode != 0, launcher_err[-3000:]
    assert "SIGABRT" not in launcher_err, launcher_err[-3000:]  # no rank died in teardown

    for rank in (0, 1):
        err = next(logs.rglob(f"attempt_0/{rank}/stderr.log")).read_text()
        assert "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("maxent-grpo: error: could not save the checkpoint of step 2: "), err
        assert "File too large" in last and last.endswith(f"the latest complete checkpoint is {previous}"), last
    assert verify_checkpoint(previous)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-1"]  # no .tmp-* folders


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.lora.enabled=true", "model.lora.enabled"),
        ("generation.dtype=bfloat16", "generation.dtype"),
        ("loss.dynamic_sampling=true", "loss.dynamic_sampling"),
    ],
)
def test_fsdp2_refuses_what_it_cannot_do_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=rf"^{key}: .*training.strategy=fsdp2"):
        compiled(None, ["training.strategy=fsdp2", override])
    # model.dtype is the compute dtype: the sharded policy is still stored in float32, so a bf16
    # sampling copy is a separate copy under bf16 compute too.
    with pytest.raises(ConfigError, match=rf"^{key}: .*training.strategy=fsdp2"):
        compiled(None, ["training.strategy=fsdp2", "model.dtype=bfloat16", override])


def test_fsdp2_accepts_sampling_from_the_policy_and_unknown_strategies_are_refused():
    assert load_config(None, ["training.strategy=fsdp2", "generation.dtype=auto"]).training.strategy == "fsdp2"
    with pytest.raises(ConfigError, match="^training.strategy: 'fsdp' is not one of ddp, fsdp2"):
        compiled(None, ["training.strategy=fsdp"])


@pytest.mark.skipif("backend" not in {f.name for f in dataclasses.fields(GenerationConfig)},
                    reason="the recipe samples with generation.backend: vllm (issue 10's backends)")
def test_the_gpu_recipe_is_a_valid_fsdp2_config():
    cfg = load_config(REPO / "recipes" / "qwen2.5-1.5b-gsm8k-fsdp2.yaml")
    assert cfg.training.strategy == "fsdp2" and cfg.generation.backend == "vllm"
    completions = cfg.training.prompts_per_step * cfg.generation.num_generations
    assert completions % cfg.training.micro_batch_size == 0


def test_fsdp2_with_one_process_fails_before_loading_a_model(tmp_path, capsys):
    from maxent_grpo.cli import main

    code = main(["train", "--output-dir", str(tmp_path / "run"), "--set", "training.strategy=fsdp2",
                 "--set", "model.name_or_path=/nonexistent"])
    assert code != 0
    assert "training.strategy: fsdp2 needs several processes" in capsys.readouterr().err
