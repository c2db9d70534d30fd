"""One side (ours or TRL) of ``benchmarks/gpu.py`` on a GPU, with its step split into phases.

Run as ``python -m benchmarks.gpu_side --side ours|trl|trl-static --setting S.json --model-dir D --out R.json``
(``trl-static``: TRL with ``cache_implementation: static``).
Each side runs in this process, its phase functions wrapped by a :class:`PhaseMeter`:

* generate: HF generation. Ours: ``pipeline.produce_rollouts`` (the rewards, string checks,
  included); TRL: ``GRPOTrainer._generate``.
* score: the log-prob passes before the update (reference, old policy) and the advantages. Ours:
  ``pipeline.score_batch`` (the scoring stages); TRL: the rest of ``_generate_and_score_completions`` (its rewards included).
* update: the rest of the optimizer step: forward, backward, AdamW, logging. Ours:
  ``loop._update_and_log`` (the weight sync to the sampling copy included); TRL: from its step's
  ``on_step_begin`` to ``on_step_end`` less the two phases above.

Phases nest (TRL's generate inside score inside the step): time and memory go to the innermost
running phase. A phase's peak memory is ``torch.cuda.max_memory_allocated`` over its stretches,
the counter reset at every phase boundary: what the allocator held at its highest in that phase.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from pathlib import Path

PHASES = ("generate", "score", "update")


class PhaseMeter:
    """Seconds and peak CUDA memory of each phase, per optimizer step (an outermost "update" ends a step)."""

    def __init__(self, counters=None) -> None:
        """``counters``: ``torch.cuda`` (its ``synchronize``, ``max_memory_allocated`` and
        ``reset_peak_memory_stats``); the CPU smoke test gives a stand-in, CUDA being absent there."""
        import torch

        self._cuda = torch.cuda if counters is None else counters
        self._stack: list[str] = []
        self._start = time.perf_counter()
        self._current = self._empty()
        self.steps: list[dict] = []

    @staticmethod
    def _empty() -> dict:
        return {phase: {"seconds": 0.0, "peak_bytes": 0} for phase in PHASES}

    def _boundary(self) -> None:
        self._cuda.synchronize()
        now = time.perf_counter()
        if self._stack:
            record = self._current[self._stack[-1]]
            record["seconds"] += now - self._start
            record["peak_bytes"] = max(record["peak_bytes"], self._cuda.max_memory_allocated())
        self._cuda.reset_peak_memory_stats()
        self._start = now

    def enter(self, phase: str) -> None:
        self._boundary()
        self._stack.append(phase)

    def exit(self) -> None:
        self._boundary()
        phase = self._stack.pop()
        if phase == "update" and not self._stack:
            self.steps.append(self._current)
            self._current = self._empty()

    def wrap(self, owner, name: str, phase: str) -> None:
        """Replace ``owner.name`` (a module function or a class's method) by one that runs in ``phase``."""
        original: Callable = getattr(owner, name)

        @functools.wraps(original)
        def in_phase(*args, **kwargs):
            self.enter(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self.exit()

        setattr(owner, name, in_phase)


def run_ours(setting, model_dir: Path, work: Path, meter: PhaseMeter):
    from benchmarks.children import ChildRun, own_peak_rss_bytes
    from benchmarks.ours import read_metrics, result_from_metrics, write_config
    from maxent_grpo import cli
    from maxent_grpo.training import loop, pipeline, rollout_queue

    # The synchronous loop's batch (prepare_training_batch) and the rollout queue's each call their own name.
    meter.wrap(pipeline, "produce_rollouts", "generate")
    meter.wrap(rollout_queue, "produce_rollouts", "generate")
    meter.wrap(pipeline, "score_batch", "score")
    meter.wrap(loop, "_update_and_log", "update")
    # No final checkpoint: TRL's side writes none, and at 1.5B it is 18.5 GB and tens of seconds.
    config = write_config(setting, model_dir, work / "config.yaml", extra={"checkpoint": {"save_final": False}})
    start, cpu = time.perf_counter(), time.process_time()
    code = cli.main(["train", "--config", str(config), "--output-dir", str(work / "out"),
                     "--max-steps", str(setting.steps)])
    if code != 0:
        raise RuntimeError(f"our trainer exited with {code}")
    child = ChildRun(0, own_peak_rss_bytes(), time.process_time() - cpu, time.perf_counter() - start, work)
    return result_from_metrics(read_metrics(work / "out"), setting, child)


def run_trl(setting, model_dir: Path, work: Path, meter: PhaseMeter):
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from benchmarks import trl_runner

    class StepPhase(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            meter.enter("update")

        def on_step_end(self, args, state, control, **kwargs):
            meter.exit()

    meter.wrap(GRPOTrainer, "_generate", "generate")
    meter.wrap(GRPOTrainer, "_generate_and_score_completions", "score")
    return trl_runner.run_trl(setting, model_dir, callbacks=(StepPhase(),))


def main(argv: list[str] | None = None) -> None:
    import torch

    from benchmarks.settings import BenchSetting

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--side", choices=("ours", "trl", "trl-static"), required=True)
    parser.add_argument("--setting", type=Path, required=True, help="BenchSetting JSON")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="RunResult JSON to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_side: no CUDA device")
    setting = BenchSetting.from_json(args.setting)
    if args.side == "trl-static":
        setting = setting.replace(trl_cache="static")
    meter = PhaseMeter()
    runner = run_ours if args.side == "ours" else run_trl
    result = runner(setting, args.model_dir, args.out.parent, meter)
    if len(meter.steps) != setting.steps:
        raise RuntimeError(f"{args.side}: the phase meter saw {len(meter.steps)} steps, expected {setting.steps}")
    result.side = args.side
    result.extra = {"phases": meter.steps, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    result.to_json(args.out)


if __name__ == "__main__":
    main()
