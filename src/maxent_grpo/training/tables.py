"""Completion tables: ``OUTPUT_DIR/completions/step-N.jsonl`` and the trackers' table view."""

from __future__ import annotations

import json
import math
from pathlib import Path

from maxent_grpo.run_files import write_text_atomic
from maxent_grpo.training.distributed import Dist
from maxent_grpo.training.pipeline import PreparedBatch

COLUMNS = ["prompt", "completion", "rewards", "reward", "advantage", "weight", "length", "finish_reason", "rank"]


def completion_rows(prepared: PreparedBatch) -> list[dict]:
    rc, rollout = prepared.reward_comp, prepared.rollout
    g = rollout.num_generations
    lengths = prepared.packed.completion_mask.sum(1)
    weights = prepared.weight_stats.flat_weights if prepared.weight_stats is not None else None
    rows = []
    for i, text in enumerate(rollout.completion_texts):
        rewards = {
            name: (None if math.isnan(float(rc.per_function[i, k])) else float(rc.per_function[i, k]))
            for k, name in enumerate(rc.reward_names)
        }
        total = float(rc.total[i])
        rows.append({
            "prompt": rollout.prompts[i // g],
            "completion": text,
            "rewards": rewards,
            "reward": None if math.isnan(total) else total,
            "advantage": float(prepared.advantages[i]),
            "weight": None if weights is None else float(weights[i]),
            "length": int(lengths[i]),
            "finish_reason": rollout.finish_reasons[i],
            # Columns the reward functions added (TRL's log_extra).
            **{name: values[i] for name, values in prepared.extra_columns.items()},
        })
    return rows


def gather_completion_rows(prepared: PreparedBatch, dist: Dist) -> list[dict]:
    """Every process's completion rows, rank by rank, each tagged with its ``rank``."""
    return dist.gather_objects([{**row, "rank": dist.rank} for row in completion_rows(prepared)])


def write_completion_table(output_dir: Path, step: int, rows: list[dict], trackers) -> None:
    folder = Path(output_dir) / "completions"
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / f"step-{step}.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    columns = COLUMNS + sorted({c for r in rows for c in r} - set(COLUMNS))
    table_rows = [[json.dumps(r.get(c)) if isinstance(r.get(c), (dict, list)) else r.get(c) for c in columns]
                  for r in rows]
    trackers.log_table("completions", columns, table_rows, step)
