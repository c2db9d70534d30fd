"""The GPU path on a replica of the GPU machine's image, so that it cannot rot between the rare GPU loans.

The image (docs/SCALING.md, "The GPU check") has torch, transformers, accelerate, peft and pytest but
no ``datasets``, ``reasoning_gym``, ``math_verify``, ``trl`` or ``vllm``. Each command here runs in a
fresh process where those five cannot be imported (a ``sitecustomize`` makes the path finder miss
them, so ``importlib.util.find_spec`` says None as it would there): the tier's collection from the
repository root, a training run of the tiny model on the tier's data source, ``benchmarks/gpu.py
--plan``, and ``scripts/gpu_check.py run --cpu`` on its stages. The wheels themselves (``prepare``
needs PyPI) are not fetched here; the choice among them is checked on wheel files written here.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gpu_image import MISSING, REPO, replica_env as image_env  # tests/ is on pytest's pythonpath


@pytest.fixture(scope="module")
def replica_env(tmp_path_factory):
    return image_env(tmp_path_factory.mktemp("gpu-image"), tmp_path_factory.mktemp("home"), MISSING)


def _run(cmd, env, timeout=900):
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_replica_has_none_of_the_five(replica_env):
    probe = ("import importlib, importlib.util\n"
             f"for name in {MISSING!r}:\n"
             "    assert importlib.util.find_spec(name) is None, name\n"
             "    try:\n        importlib.import_module(name)\n    except ModuleNotFoundError:\n        continue\n"
             "    raise SystemExit(f'{name} imported')\n"
             "import torch, transformers, maxent_grpo.cli\n")
    _run([sys.executable, "-c", probe], replica_env)


def test_the_gpu_tier_collects_from_the_repository_root(replica_env):
    out = _run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
               replica_env)
    assert "tests/gpu/test_cuda.py::test_the_step_on_cuda_equals_the_step_on_the_cpu" in out


def test_the_tiers_training_run_needs_none_of_them(replica_env, tiny_model_dir, tmp_path):
    """The tier's run (tests/gpu/test_cuda.py) on the CPU: the tiny model on ``modebench:pair_sum``,
    our own generator, with the ``length`` reward; it saves the step's checkpoint."""
    from tiny_runs import tiny_overrides  # tests/ is on pytest's pythonpath

    args = tiny_overrides(tiny_model_dir, tmp_path / "run", rewards="[{name: length, kwargs: {max_length: 100000}}]",
                          steps=1, source="modebench:pair_sum", extra=["checkpoint.save_steps=1"])
    _run([sys.executable, "-m", "maxent_grpo.cli", "train", *args], replica_env)
    assert (tmp_path / "run" / "checkpoints" / "step-1").is_dir()


def test_the_gpu_benchmark_plans_without_them(replica_env):
    out = _run([sys.executable, "benchmarks/gpu.py", "--plan"], replica_env)
    assert "## gpu-qwen2.5-0.5b" in out and "pair_sum" in out


@pytest.mark.parametrize("stages", ["tier,gpu-0.5b,decode-ragged", "decode,gpu-1.5b,profile,gpu-7b"],
                         ids=["first-call", "the-rest"])
def test_the_gpu_check_runs_each_stage_on_the_cpu(replica_env, tmp_path, stages):
    """``run --cpu``: the tier (collected, skipped without CUDA), the decode stages on the tiny model
    (compiled decoding included), the benchmarks' plans and the update profile on the tiny model, each
    stage under its limit, the summary written, and no more than the 8 files the machine returns."""
    out = tmp_path / "out"
    _run([sys.executable, "scripts/gpu_check.py", "run", str(out), "--cpu", "--no-install", "--budget", "900",
          "--stages", stages], replica_env)
    summary = (out / "summary.md").read_text()
    for stage in stages.split(","):
        assert f"| {stage} | passed |" in summary, summary
    if "decode" in stages.split(","):
        assert "### Decoding alone" in summary and "| compiled |" in summary and "| generate-static |" in summary
    else:  # decode-ragged's variants alone, and no profile
        assert "| compiled-shrink |" in summary and "| generate |" not in summary
        assert "| ours, packed |" not in summary
    if "profile" in stages:
        assert "| ours |" in summary and "| ours, packed |" in summary  # the profile's table, on the tiny model
        assert "## gpu-qwen2.5-7b-lora16" in (out / "gpu-7b.log").read_text()  # 7B: LoRA on one GPU
    assert "trl-static" in (out / ("gpu-0.5b.log" if "gpu-0.5b" in stages else "gpu-1.5b.log")).read_text()
    files = {p.name for p in out.iterdir()}
    assert files == {"summary.md", "sides.tar.gz", *(f"{s}.log" for s in stages.split(","))} and len(files) <= 8


def _wheel(folder: Path, name: str, version: str, tag: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-{tag}.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}")
    return path


def test_the_run_installs_one_wheel_per_package_the_datasets_its_pyarrow_takes(tmp_path, monkeypatch):
    """Two datasets releases travel (one per pyarrow range); the run takes the newest whose range holds
    the installed pyarrow, and of a package built per Python, this interpreter's own wheel."""
    import pyarrow
    from packaging.version import Version

    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check

    have = Version(pyarrow.__version__)
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    _wheel(tmp_path, "datasets", "9.0.0", "py3-none-any", [f"pyarrow>={have.major + 1}.0.0"])  # too new for it
    _wheel(tmp_path, "datasets", "5.2.0", "py3-none-any", [f"pyarrow>={have.major}.0.0", "dill<0.4.2"])
    _wheel(tmp_path, "datasets", "4.8.5", "py3-none-any", ["pyarrow>=1.0.0"])
    _wheel(tmp_path, "multiprocess", "0.70.19", f"{py}-none-any", [])
    _wheel(tmp_path, "multiprocess", "0.70.19", "py39-none-any", [])  # an older Python's: not taken
    _wheel(tmp_path, "trl", "1.16.0", "py3-none-any", ["datasets>=4.7.0"])
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path)
    names = sorted(p.name for p in gpu_check._pick_wheels())
    assert names == sorted(["datasets-5.2.0-py3-none-any.whl", f"multiprocess-0.70.19-{py}-none-any.whl",
                            "trl-1.16.0-py3-none-any.whl"])
    for stale in tmp_path.glob("datasets-*"):
        if "5.2.0" in stale.name or "4.8.5" in stale.name:
            stale.unlink()
    with pytest.raises(SystemExit, match=f"no carried datasets wheel accepts pyarrow {have}"):
        gpu_check._pick_wheels()
