"""What one benchmark run measured, and the markdown table built from many runs.

Every side (ours, TRL, the floor) produces a :class:`RunResult`; the children
write it as JSON, the harness reads it back and fills in the peak RSS it
measured itself with ``wait4`` (the same number for every side).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

# ours_vllm: our trainer sampling with an in-process vLLM engine (generation.backend: vllm).
SIDES = ("ours", "ours_vllm", "trl", "floor")


@dataclass
class RunResult:
    side: str
    step_times: list[float]  # seconds per optimizer step, in order
    rewards: list[float | None]  # mean total reward of each step's completions (None: not measured, the floor)
    completion_tokens: list[int | None]  # generated tokens per step (None: the side did not log it)
    generate_times: list[float | None] = field(default_factory=list)  # seconds in generation per step
    cpu_times: list[float | None] = field(default_factory=list)  # process CPU seconds per step (robust to a busy machine)
    peak_rss_bytes: int = 0
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)
    # Per step, the hash of the prompt token ids the step trained on (maxent_grpo.run_files.prompt_ids_hash).
    prompt_hashes: list[int] = field(default_factory=list)

    def to_json(self, path: Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=1))

    @classmethod
    def from_json(cls, path: Path) -> RunResult:
        return cls(**json.loads(Path(path).read_text()))


def prompt_mismatch(runs: dict[str, list[RunResult]]) -> str | None:
    """None when, in every repetition, every side trained on the same prompt token ids at every
    step; otherwise one line naming the first repetition, step and sides that differ."""
    sides = list(runs)
    for side in sides:
        for rep, run in enumerate(runs[side]):
            if len(run.prompt_hashes) != len(run.step_times):
                return (f"rep {rep + 1}: {side} recorded {len(run.prompt_hashes)} prompt hashes for "
                        f"{len(run.step_times)} steps")
    first = sides[0]
    for rep in range(min(len(runs[s]) for s in sides)):
        for side in sides[1:]:
            mine, theirs = runs[first][rep].prompt_hashes, runs[side][rep].prompt_hashes
            if len(mine) != len(theirs):
                return f"rep {rep + 1}: {first} ran {len(mine)} steps, {side} {len(theirs)}"
            for step, (a, b) in enumerate(zip(mine, theirs), start=1):
                if a != b:
                    return (f"rep {rep + 1} step {step}: {first} and {side} trained on different prompt token ids "
                            f"(prompt hash {a:013x} vs {b:013x})")
    return None


@dataclass(frozen=True)
class SideSummary:
    side: str
    runs: int
    steps_timed: int
    median_s: float
    min_s: float
    max_s: float
    cpu_median_s: float | None
    peak_rss_bytes: int  # median over runs of each run's peak
    tokens_per_s: float | None
    generate_share: float | None  # fraction of timed step time spent generating
    mean_reward: float | None
    warmup_dropped: bool


def summarize(side: str, runs: list[RunResult]) -> SideSummary:
    """Pool the post-warm-up steps of all runs of one side (the first step of a run is its warm-up)."""
    if not runs:
        raise ValueError(f"runs: no runs for side {side!r}")
    drop = 1 if all(len(r.step_times) > 1 for r in runs) else 0
    times, tokens, gen, rewards, cpu = [], [], [], [], []
    for r in runs:
        times += r.step_times[drop:]
        cpu += r.cpu_times[drop:]
        tokens += r.completion_tokens[drop:]
        gen += r.generate_times[drop:]
        rewards += [x for x in r.rewards if x is not None]
    if not times:
        raise ValueError(f"runs: side {side!r} has no timed steps")
    total = sum(times)
    tps = sum(tokens) / total if tokens and all(t is not None for t in tokens) else None
    share = sum(gen) / total if gen and all(g is not None for g in gen) else None
    return SideSummary(
        side=side,
        runs=len(runs),
        steps_timed=len(times),
        median_s=statistics.median(times),
        min_s=min(times),
        max_s=max(times),
        cpu_median_s=statistics.median(cpu) if cpu and all(c is not None for c in cpu) else None,
        peak_rss_bytes=int(statistics.median(r.peak_rss_bytes for r in runs)),
        tokens_per_s=tps,
        generate_share=share,
        mean_reward=statistics.fmean(rewards) if rewards else None,
        warmup_dropped=bool(drop),
    )


def _ratio(a: float, b: float | None) -> str:
    return "—" if b is None or b == 0 else f"{a / b:.2f}"


def markdown_table(summaries: dict[str, SideSummary], title: str) -> str:
    """Seconds per step (median [min, max]), ratios to TRL and to the floor, peak RSS, tokens/s."""
    trl = summaries.get("trl")
    floor = summaries.get("floor")
    lines = [
        f"### {title}",
        "",
        "| side | s/step median | min | max | ÷ TRL | ÷ floor | peak RSS GiB | RSS ÷ TRL "
        "| completion tok/s | generate share | CPU s/step | mean reward | steps timed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for side in SIDES:
        if side not in summaries:
            continue
        s = summaries[side]
        rss = s.peak_rss_bytes / 2**30
        lines.append(
            f"| {side} | {s.median_s:.3f} | {s.min_s:.3f} | {s.max_s:.3f} "
            f"| {_ratio(s.median_s, trl.median_s if trl else None)} "
            f"| {_ratio(s.median_s, floor.median_s if floor else None)} "
            f"| {rss:.2f} | {_ratio(s.peak_rss_bytes, trl.peak_rss_bytes if trl else None)} "
            f"| {'—' if s.tokens_per_s is None else f'{s.tokens_per_s:.0f}'} "
            f"| {'—' if s.generate_share is None else f'{s.generate_share:.0%}'} "
            f"| {'—' if s.cpu_median_s is None else f'{s.cpu_median_s:.2f}'} "
            f"| {'—' if s.mean_reward is None else f'{s.mean_reward:.3f}'} "
            f"| {s.steps_timed} ({s.runs} runs{'' if s.warmup_dropped else ', no warm-up dropped'}) |"
        )
    return "\n".join(lines)
