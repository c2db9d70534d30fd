"""The files a run writes, read and written one way: atomic text files and ``metrics.jsonl``.

A leaf module (standard library only), used by every layer that writes a run's
files, so that each is written with the same durability: the text goes to a
temporary file beside the target, which is fsynced, renamed over the target, and
the folder fsynced; a reader (or a crash) sees the old file or the new one, never
half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

METRICS_NAME = "metrics.jsonl"
# 52 bits: the hash is exact as a float too (the trackers log metrics as floats).
PROMPT_HASH_HEX_DIGITS = 13


def prompt_ids_hash(prompt_ids: Sequence[Sequence[int]]) -> int:
    """``metrics.jsonl``'s ``prompt_ids_hash``: which prompts a step trained on, as one integer.

    ``prompt_ids`` holds the token ids each prompt was fed to generation with, one list per
    prompt (not per completion), without padding. They are sorted first, so the hash names the
    step's multiset of prompts whatever their order or their split over processes; it is the
    first 52 bits of the SHA-256 of their compact JSON. The benchmarks compare it across
    trainers (``benchmarks/run.py``).
    """
    canonical = sorted([int(t) for t in ids] for ids in prompt_ids)
    digest = hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()
    return int(digest[:PROMPT_HASH_HEX_DIGITS], 16)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace ``path``'s contents with ``text`` atomically and durably."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a folder's entries (a rename into it, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def parse_metrics_lines(lines: Sequence[str]) -> tuple[list[dict], list[str]]:
    """Records sorted by step and the problems met (unreadable lines, lines without a step).

    A step logged twice (a run resumed from a checkpoint older than its last logged
    step) keeps its last record: the one from the run that went on.
    """
    by_step: dict[int, dict] = {}
    problems = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            problems.append(f"line {number} is not JSON (a run killed while writing?)")
            continue
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            problems.append(f"line {number} has no integer 'step'")
            continue
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)], problems


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a ``metrics.jsonl``, one per step (a torn last line is left out); [] if absent."""
    p = Path(path)
    if not p.exists():
        return []
    return parse_metrics_lines(p.read_text().splitlines())[0]
