"""The GPU check in one prepared call: ``prepare`` here, ``run`` on the GPU machine.

    python scripts/gpu_check.py prepare              # here (needs PyPI): wheels into .gpu-wheels/
    python3 scripts/gpu_check.py run OUT [--budget S] # there (no registry): install, tier, benchmarks

The GPU machine the check is made for (docs/SCALING.md, "The GPU check") has torch,
transformers, accelerate, peft, pandas, pyarrow and pytest, but no ``datasets``, ``trl``,
``reasoning-gym``, ``math-verify`` or ``vllm``, and cannot reach a package registry. Our GPU path
needs none of the last three (the tier and ``benchmarks/gpu.py`` use ``pair_sum`` tasks and
rewards of our own) and the tier needs no ``datasets`` (generated sources are ``Rows``);
``datasets`` (the benchmark's prompts are a JSONL file on our side, a ``Dataset`` on TRL's) and
``trl`` (TRL's side) travel as wheels. ``prepare`` downloads them for CPython 3.12 manylinux x86-64 (two
``datasets`` releases, one per ``pyarrow`` range, since the image's ``pyarrow`` is not known here),
and checks that they and the working tree stay under 40 MiB (the machine takes 64 MiB).

``run`` installs the wheels into a temporary site with ``--no-index --no-deps`` (the ``datasets``
whose ``pyarrow`` requirement the image meets), then runs its stages one after another, each under
its own time limit so that a cut stage leaves the others' results (a benchmark prints its table again
after each side that finishes). By default, one call inside 10 minutes: the GPU tier (``pytest -m gpu``
from the repository root), ``benchmarks/gpu.py`` at 0.5B (ours, TRL, and TRL with
``cache_implementation: static``; same prompts, same GPU) and ``decode-ragged`` (decoding alone with rows
that end at different steps: our fixed compiled batch against the shrinking one). Also: ``decode``
(``benchmarks/decode.py`` at 0.5B: our compiled and eager loops against ``generate`` with a dynamic and
a static cache, all rows to the end), ``gpu-1.5b`` (the benchmark at 1.5B); ``profile`` runs
``benchmarks/update_profile.py`` (where the update phase goes), ``gpu-7b`` 7B with LoRA (a call of its
own). Not measured on a GPU yet, so not in the default call: ``update-ragged``
(``benchmarks/update_ragged.py``: the update alone on one ragged batch, each of our layouts with a fixed
and an ``auto`` micro-batch against TRL's ``compute_loss``) and ``gap-10`` (``benchmarks/head_gap.py``:
our trainer 10 steps at 0.5B in bf16, the sampler/trainer log-prob gap each step with the LM head in bf16
and in float32); ``run OUT --stages update-ragged,gap-10`` runs both. It writes ``OUT/summary.md`` (the device, torch and CUDA, each stage's outcome and time, the
benchmark tables), each stage's log and ``sides.tar.gz`` (the benchmarks' raw JSON and every side's log,
config and metrics): the machine returns at most 8 files, so one call runs at most 6 stages.
``--cpu`` runs the same stages on a machine without a GPU (the replica test): the tier is then
skipped by pytest, the benchmark prints its plan, and the decode stages, ``update-ragged`` and ``gap-10``
(2 steps) run the tiny model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".gpu-wheels"
LIMIT_MIB = 40
# What the GPU machine's image lacks and our GPU path imports (datasets: the loaders; trl: TRL's side).
# Two datasets releases: 5.2.0 needs pyarrow >= 24, 4.8.5 pyarrow >= 21.
WHEEL_PINS = ("datasets==5.2.0", "datasets==4.8.5", "dill==0.4.1", "multiprocess==0.70.19", "trl==1.16.0")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
SITE = Path("/tmp/maxent-gpu-site")
STAGES = ("tier", "decode", "gpu-0.5b", "gpu-1.5b", "decode-ragged", "profile", "gpu-7b", "update-ragged", "gap-10")
# What one call runs unless told otherwise, inside 10 minutes (a command's limit there). Measured on an
# H200 (BENCHMARKS.md §9, 2026-11-29): the tier's 10 CUDA tests took 107 s with a warm compile cache and
# were cut at 110 s after 6 of them with a cold one; decode took 112 s; gpu-0.5b 158 s with its third side
# failing at once (about 60 s more when it runs); gpu-1.5b 190 s likewise. decode's table is in §9, so
# the default call runs the ragged one instead. 7B (LoRA; ~15 GB of random weights written first):
# --stages gpu-7b.
DEFAULT_STAGES = ("tier", "gpu-0.5b", "decode-ragged")
TIER_LIMIT = 200
# Not in DEFAULT_STAGES: the default call's limits (200 + 240 + 120 s) already fill its 560 s budget.
# Not measured on a GPU yet; each limit is its nearest measured stage's, with margin. update-ragged runs
# 9 variants (4 layouts x 2 micro-batches, and TRL) of 4 passes over one 0.5B batch like profile's: on the
# H100 (2026-11-26) profile's 5 variants of 4 passes took 23 s by their medians and printed before the
# stage was cut at 90 s in its profiler trace; 9 variants, TRL's trainer built and the model loaded: 150 s.
# gap-10 runs 2 fresh processes of our trainer, 10 steps each, at gpu-0.5b's setting: on the H200
# (2026-11-29) our side of gpu-0.5b took about 40 s for 3 steps (21 s of it compiling the decoding loop)
# and 2.1 s a step after, so about 60 s a run; gpu-0.5b's own limit leaves twice that.
UPDATE_RAGGED_LIMIT = 150
GAP_LIMIT = 240
# (stage, model, steps, the stage's limit, each side's): the first step of each side is its warm-up.
BENCHMARKS = (("gpu-0.5b", "qwen2.5-0.5b", 3, 240, 90), ("gpu-1.5b", "qwen2.5-1.5b", 3, 330, 110),
              ("gpu-7b", "qwen2.5-7b", 3, 480, 170))


# ------------------------------------------------------------------ prepare (here)


def tree_mib() -> float:
    """What travels: tracked and untracked-not-ignored files, plus the wheel folder."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    files = [ROOT / os.fsdecode(f) for f in listed if f]
    files += list(WHEELS.glob("*.whl"))
    return sum(f.stat().st_size for f in files if f.is_file()) / 2**20


def prepare(pythons: list[str]) -> int:
    """Wheels for the GPU machine's CPython 3.12 (and ``pythons``, for a replica here)."""
    WHEELS.mkdir(exist_ok=True)
    for python in ["3.12", *pythons]:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
               python, "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(WHEELS)]
        for pin in WHEEL_PINS:  # one at a time: the two datasets pins conflict for pip's resolver
            subprocess.run(cmd + [pin], check=True)
    size = tree_mib()
    wheels = sorted(p.name for p in WHEELS.glob("*.whl"))
    print(f"{len(wheels)} wheels in {WHEELS.relative_to(ROOT)}/ ({sum(p.stat().st_size for p in WHEELS.glob('*.whl')) / 2**20:.1f} MiB): "
          + ", ".join(wheels))
    print(f"working tree + wheels: {size:.1f} MiB (limit {LIMIT_MIB} MiB)")
    if size > LIMIT_MIB:
        print(f"gpu_check prepare: {size:.1f} MiB would travel, over {LIMIT_MIB} MiB", file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------ run (there)


def _pick_wheels() -> list[Path]:
    """The wheels this Python can install, less the datasets releases whose pyarrow requirement the
    installed pyarrow fails (the newest that fits is kept)."""
    import zipfile

    import pyarrow
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version

    have = Version(pyarrow.__version__)
    rank = {tag: i for i, tag in enumerate(sys_tags())}  # best first: cp312's py312 before py311
    best: dict[tuple[str, Version], tuple[int, Path]] = {}
    for wheel in WHEELS.glob("*.whl"):
        name, version, _, tags = parse_wheel_filename(wheel.name)
        fit = min((rank[t] for t in tags if t in rank), default=None)
        if fit is not None and ((name, version) not in best or fit < best[name, version][0]):
            best[name, version] = (fit, wheel)
    chosen, datasets = [], []
    for _, wheel in sorted(best.values()):
        if not wheel.name.startswith("datasets-"):
            chosen.append(wheel)
            continue
        with zipfile.ZipFile(wheel) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            reqs = [Requirement(line.split(":", 1)[1].strip()) for line in zf.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
        arrow = [r for r in reqs if r.name == "pyarrow" and r.marker is None]
        if all(have in r.specifier for r in arrow):
            datasets.append((Version(wheel.name.split("-")[1]), wheel))
    if not datasets:
        raise SystemExit(f"gpu_check: no carried datasets wheel accepts pyarrow {have}")
    return chosen + [max(datasets)[1]]


def install() -> str:
    wheels = _pick_wheels()
    if SITE.exists():
        shutil.rmtree(SITE)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", str(SITE), *map(str, wheels)], check=True)
    return ", ".join(w.name for w in wheels)


class Stages:
    """Runs commands one by one, each under its own limit, and keeps what each gave."""

    def __init__(self, out: Path, env: dict, deadline: float):
        self.out, self.env, self.deadline, self.rows = out, env, deadline, []

    def run(self, name: str, cmd: list[str], limit: float) -> str:
        left = self.deadline - time.monotonic()
        limit = min(limit, left)
        log = self.out / f"{name}.log"
        if limit < 20:
            self.rows.append((name, "not run: the call's time was spent", 0.0))
            return ""
        start = time.monotonic()
        with open(log, "w") as fh:
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            # Its own process group: a cut stage's children (torchrun, a side) go with it.
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=limit)
                outcome = "passed" if code == 0 else f"failed (exit {code})"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                outcome = f"cut at its limit of {limit:.0f} s"
        seconds = time.monotonic() - start
        self.rows.append((name, outcome, seconds))
        print(f"[gpu_check] {name}: {outcome} in {seconds:.0f} s", flush=True)
        return log.read_text(errors="replace")


def _device_lines(env: dict) -> list[str]:
    probe = ("import torch, transformers, accelerate, peft, platform; "
             "print('python', platform.python_version(), '| torch', torch.__version__, '| CUDA', torch.version.cuda, "
             "'| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| peft', peft.__version__); "
             "print('device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device', "
             "'|', f'{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB' if torch.cuda.is_available() else '')")
    got = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT)
    lines = (got.stdout + got.stderr).strip().splitlines()
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
                           capture_output=True, text=True)
        lines.append("nvidia-smi: " + q.stdout.strip())
    return lines


def _tables(log: str) -> str:
    """The benchmarks' markdown tables out of a log: each from its '### ' heading through its rows, its
    ratio line ('ours/TRL') and its notes ('* '). A table printed again as more sides finish keeps its
    last printing."""
    tables: dict[str, list[str]] = {}
    current = None
    for line in log.splitlines():
        if line.startswith("### "):
            current = tables[line] = [line]
        elif current is not None and (not line.strip() or line.startswith(("|", "ours/TRL", "* "))):
            current.append(line)
        else:
            current = None
    return "\n".join("\n".join(lines).strip() + "\n" for lines in tables.values())


def _pack_logs(work: Path, dest: Path) -> None:
    """Each side's log, config, metrics and result (no weights) in one archive."""
    import tarfile

    with tarfile.open(dest, "w:gz") as tar:
        for path in sorted(work.rglob("*")):
            if path.is_file() and path.suffix in {".log", ".json", ".jsonl", ".yaml", ".md"} and "random" not in path.parts:
                if path.stat().st_size < 4 * 2**20:
                    tar.add(path, arcname=str(path.relative_to(work)))


def run(out: Path, budget: float, cpu: bool, only: list[str], bench_steps: int | None, wheels: bool = True) -> int:
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    deadline = t0 + budget
    installed = install() if wheels else "none installed (--no-install)"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    home = Path(env.get("TMPDIR", "/tmp")) / "maxent-gpu-home"
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(home / "hf"), WANDB_MODE="offline",
               MAXENT_GRPO_BENCH_CACHE=str(home / "bench"), MAXENT_GRPO_CACHE=str(home / "cache"),
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    device = _device_lines(env)
    print("\n".join(device), flush=True)
    stages = Stages(out, env, deadline)
    py = sys.executable
    if "tier" in only:
        stages.run("tier", [py, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-rA", "--durations=0"], TIER_LIMIT)
    bench = []
    # Decoding alone at 0.5B, 64 rows x (168 + 256) tokens: our compiled loop (fixed batch, shrinking),
    # our eager loop, generate (dynamic and static cache); -ragged: rows ending at different steps.
    small = ["--cpu", "--model", "tiny", "--rows", "8", "--prompts", "2", "--prompt-len", "16", "--new-tokens", "16"]
    for name, extra, limit in (("decode", [], 150),
                               ("decode-ragged", ["--ragged", "256", "--variants", "compiled,compiled-shrink,eager"], 120)):
        if name in only:
            log = stages.run(name, [py, "benchmarks/decode.py", "--model", "qwen2.5-0.5b", *extra]
                             + (small if cpu else []), limit)
            bench.append(_tables(log))
    for name, model, steps, limit, side_limit in BENCHMARKS:
        if name not in only:
            continue
        steps = bench_steps or steps
        args = [py, "benchmarks/gpu.py", "--models", model, "--steps", str(steps), "--timeout", str(side_limit),
                "--work-dir", str(home / "work" / name), "--json-out", str(home / "work" / f"{name}.json")]
        log = stages.run(name, args + (["--plan"] if cpu else []), limit)
        bench.append(_tables(log) if not cpu else log[-2000:])
    if "profile" in only:
        # Ragged completions (as sampled ones are), so the padding-free variant has padding to remove.
        log = stages.run("profile", [py, "benchmarks/update_profile.py", "--model", "qwen2.5-0.5b", "--ragged"]
                         + (["--cpu", "--prompts", "2", "--group", "4", "--prompt-len", "16", "--completion-len", "16"]
                            if cpu else []), 70)
        bench.append("\n".join(line for line in log.splitlines() if line.startswith("|") or line.startswith("qwen")
                               or line.startswith("tiny")))
    if "update-ragged" in only:
        log = stages.run("update-ragged", [py, "benchmarks/update_ragged.py", "--model", "qwen2.5-0.5b"]
                         + (["--cpu"] if cpu else []), UPDATE_RAGGED_LIMIT)
        bench.append(_tables(log))
    if "gap-10" in only:
        model, steps = ("tiny", 2) if cpu else ("qwen2.5-0.5b", 10)
        log = stages.run("gap-10", [py, "benchmarks/head_gap.py", "--random-model", model, "--steps", str(steps),
                                    "--out", str(home / "work" / "gap-10")], GAP_LIMIT)
        bench.append(_tables(log))
    lines = ["# GPU check", "", *[f"- {d}" for d in device], f"- wheels: {installed}",
             f"- total: {time.monotonic() - t0:.0f} s of a {budget:.0f} s budget", "",
             "| stage | outcome | seconds |", "|---|---|---|",
             *[f"| {n} | {o} | {s:.0f} |" for n, o, s in stages.rows], "", *bench]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    _pack_logs(home / "work", out / "sides.tar.gz")
    print("\n".join(lines), flush=True)
    return 0 if all(o == "passed" for _, o, _ in stages.rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    pr = sub.add_parser("prepare", help="download the wheels the GPU machine lacks (here, with PyPI)")
    pr.add_argument("--also-python", action="append", default=[], metavar="X.Y",
                    help="also fetch wheels for this CPython (a replica of the image here), e.g. 3.11")
    r = sub.add_parser("run", help="install them and run the stages (on the GPU machine)")
    r.add_argument("out", type=Path, help="folder for summary.md and the logs")
    r.add_argument("--budget", type=float, default=560.0, help="seconds for the whole call (stages are cut to fit)")
    r.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                   help=f"comma-separated subset of {','.join(STAGES)} (default: {','.join(DEFAULT_STAGES)})")
    r.add_argument("--bench-steps", type=int, help="steps per benchmark run (default: 4 at 0.5B, 3 at 1.5B)")
    r.add_argument("--no-install", action="store_true",
                   help="install no wheels: the environment has what the stages import (the replica test)")
    r.add_argument("--cpu", action="store_true", help="no GPU here: the tier skips, the benchmark prints its plan")
    args = p.parse_args(argv)
    if args.verb == "prepare":
        return prepare(args.also_python)
    only = [s for s in args.stages.split(",") if s]
    if set(only) - set(STAGES):
        p.error(f"unknown stage {sorted(set(only) - set(STAGES))}: stages are {', '.join(STAGES)}")
    return run(args.out, args.budget, args.cpu, only, args.bench_steps, wheels=not args.no_install)


if __name__ == "__main__":
    sys.exit(main())
