"""Run one side (ours, TRL or the floor) once, in a fresh process, and read what it measured."""

from __future__ import annotations

from pathlib import Path

from benchmarks.children import python_module_cmd, run_child
from benchmarks.ours import run_ours
from benchmarks.results import RunResult
from benchmarks.settings import BenchSetting

RUNNER_MODULES = {"trl": "benchmarks.trl_runner", "floor": "benchmarks.floor"}


def run_side(side: str, setting: BenchSetting, model_dir: Path, work: Path, env: dict[str, str],
             timeout_s: float | None = None, ours_extra: dict | None = None) -> RunResult:
    """One run of ``side`` under ``work``; the peak RSS is the child's own (wait4).

    Our trainer always saves its last checkpoint (:func:`benchmarks.ours.final_model_dir`);
    TRL and the floor save nothing here (use :func:`run_trl_saving` for TRL's final model).
    """
    work.mkdir(parents=True, exist_ok=True)
    if side == "ours":
        return run_ours(setting, model_dir, work, env, extra=ours_extra, timeout_s=timeout_s)
    if side == "ours_vllm":
        extra = {**(ours_extra or {}), "generation": {"backend": "vllm"}}
        result = run_ours(setting, model_dir, work, env, extra=extra, timeout_s=timeout_s)
        result.side = "ours_vllm"
        return result
    if side not in RUNNER_MODULES:
        raise ValueError(f"side must be one of ours, ours_vllm, {', '.join(RUNNER_MODULES)}; got {side!r}")
    return _run_module(side, setting, model_dir, work, env, timeout_s, ())


def run_trl_saving(setting: BenchSetting, model_dir: Path, work: Path, env: dict[str, str],
                   timeout_s: float | None = None) -> tuple[RunResult, Path]:
    """A TRL run that also saves its final model; returns the result and the model folder."""
    work.mkdir(parents=True, exist_ok=True)
    save_dir = work / "final"
    result = _run_module("trl", setting, model_dir, work, env, timeout_s, ("--save-dir", str(save_dir)))
    return result, save_dir


def _run_module(side: str, setting: BenchSetting, model_dir: Path, work: Path, env: dict[str, str],
                timeout_s: float | None, extra_args: tuple[str, ...]) -> RunResult:
    setting_path = work / "setting.json"
    setting.to_json(setting_path)
    out = work / "result.json"
    cmd = python_module_cmd(
        RUNNER_MODULES[side], "--setting", str(setting_path), "--model-dir", str(model_dir), "--out", str(out),
        *extra_args,
    )
    child = run_child(cmd, work / f"{side}.log", env, timeout_s)
    result = RunResult.from_json(out)
    result.peak_rss_bytes = child.peak_rss_bytes
    result.wall_s = child.wall_s
    result.extra["process_cpu_s"] = child.cpu_s
    return result
