"""Where a run's peak memory sits: resident memory sampled by phase of the step.

``python benchmarks/memory_phases.py -- train --config C.yaml --output-dir OUT`` runs our CLI
in this process while a thread samples the resident set (``VmRSS``) every ``--every`` seconds
and names the phase from the main thread's stack: the innermost frame whose function is in
:data:`PHASES` (generation, the shared prompt prefill, the policy forward, its backward, the
optimizer step, the reference pass, checkpointing). It prints, per phase, the samples taken
and the highest RSS seen, and the process's own high-water mark (``VmHWM``, which no sample
can miss). Nothing in the trainer is changed or wrapped.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

# (function name, file name) of a frame -> phase; the innermost match on the stack wins.
PHASES = {
    ("_prefill", "hf.py"): "generate: prompt prefill",
    ("_generate_chunk", "hf.py"): "generate",
    ("backward", "_tensor.py"): "policy backward",
    ("logps", "logprobs.py"): "policy forward",
    ("step", "adam.py"): "optimizer step",
    ("step", "optimizer.py"): "optimizer step",
    ("__call__", "step.py"): "optimizer update (clip, step, zero)",
    ("save", "setup.py"): "checkpoint",
    ("finish_batch", "pipeline.py"): "batch preparation",
    ("reward", "stages.py"): "rewards",
}


def _rss(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _phase(frame) -> str:
    found = []
    while frame is not None:
        code = frame.f_code
        name = PHASES.get((code.co_name, Path(code.co_filename).name))
        if name is not None:
            found.append(name)
        frame = frame.f_back
    if not found:
        return "other"
    if found[0] == "policy forward" and "batch preparation" in found:
        return "reference forward"  # scored while the batch is prepared, before the update
    return found[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--every", type=float, default=0.01, help="seconds between samples")
    parser.add_argument("--json-out", type=Path, default=None)
    parser.add_argument("--trim", default="", help="experiment: glibc malloc_trim(0) on entering these phases "
                        "(comma-separated; 'all': every change of phase; 'sample': at every sample)")
    parser.add_argument("cli_args", nargs=argparse.REMAINDER, help="-- then the maxent-grpo arguments")
    args = parser.parse_args(argv)
    cli_args = args.cli_args[1:] if args.cli_args[:1] == ["--"] else args.cli_args
    from maxent_grpo.cli import main as cli_main

    main_id = threading.get_ident()
    peaks: dict[str, int] = {}
    counts: dict[str, int] = {}
    done = threading.Event()

    from maxent_grpo.training.host_memory import host_memory_release

    release = host_memory_release("cpu") if args.trim else None
    if args.trim and release is None:
        parser.error("--trim needs glibc's malloc_trim")

    last = [None]

    def sample():
        while not done.is_set():
            frame = sys._current_frames().get(main_id)
            phase = _phase(frame)
            if args.trim == "sample" or (phase != last[0] and (args.trim == "all" or phase in args.trim.split(","))):
                release()
            last[0] = phase
            rss = _rss("VmRSS")
            peaks[phase] = max(peaks.get(phase, 0), rss)
            counts[phase] = counts.get(phase, 0) + 1
            time.sleep(args.every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        code = cli_main(cli_args)
    finally:
        done.set()
        sampler.join()
    hwm = _rss("VmHWM")
    gib = 1024**3
    print("| phase | samples | peak RSS GiB |\n|---|---|---|")
    for phase, peak in sorted(peaks.items(), key=lambda kv: -kv[1]):
        print(f"| {phase} | {counts[phase]} | {peak / gib:.2f} |")
    print(f"process high-water mark (VmHWM): {hwm / gib:.2f} GiB")
    if args.json_out is not None:
        args.json_out.write_text(json.dumps({"peaks": peaks, "counts": counts, "hwm": hwm}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
