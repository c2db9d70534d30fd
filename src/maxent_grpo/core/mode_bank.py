"""The prompt-local bank of verified modes that replay rehearses (ALGORITHMS.md §17).

remax-rl 0.1.1's rules (``remax/core/admission.py``, ``remax/core/scheduling.py``), kept
exactly:

* A prompt is keyed by the SHA-256 hex of its token ids as a compact JSON list.
* A row is admissible iff it is active (in the loss), its reward is > 0 and the verifier
  gave it a non-empty mode key. A row where reward and verifier disagree stays out
  (counted in ``disagreements``).
* Per prompt: a ledger ``key -> admissible rows`` (cumulative), the prompt's token ids and
  at most ``capacity`` exemplars ``key -> response ids``. New keys (absent from the ledger
  before this group) are visited in ascending order; while there is room, each gets the
  lexicographically smallest token tuple among this group's admissible rows with that
  key; the first new key that finds the bank full ends the visit (it and the rest only
  enter the ledger). No eviction, no replacement.
* The schedule: the prompts holding an exemplar, sorted by key; ``start = cursor mod n``,
  take ``min(groups_per_step, n)`` prompts from there cyclically, ``cursor = (start + taken)
  mod n``. A replay group is all of a prompt's exemplars in ascending key order.

The bank is plain Python (ints and strings): ``state_dict()`` is JSON-able, and a run
resumed from it schedules exactly what the uninterrupted run does.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["AdmitStats", "ModeBank", "ReplayGroup", "prompt_key"]

STATE_VERSION = 1


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """SHA-256 hex of the prompt's token ids written as ``[1,2,3]`` (remax's ``_prompt_key``)."""
    ids = _token_tuple(prompt_ids, "prompt")
    return hashlib.sha256(json.dumps(list(ids), separators=(",", ":")).encode()).hexdigest()


def _token_tuple(ids: Sequence[int], what: str) -> tuple[int, ...]:
    out = []
    for t in ids:
        if isinstance(t, bool) or int(t) != t or t < 0:
            raise ValueError(f"{what} token ids must be non-negative integers, got {t!r}")
        out.append(int(t))
    if not out:
        raise ValueError(f"{what} token ids must not be empty")
    return tuple(out)


@dataclass(frozen=True)
class ReplayGroup:
    """One prompt's exemplars, modes in ascending key order."""

    prompt_ids: tuple[int, ...]
    keys: tuple[str, ...]
    exemplars: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class AdmitStats:
    new_modes: int  # keys first seen in this call
    admitted_rows: int
    disagreements: int  # active rows where (reward > 0) and (verifier gave a key) differ


class ModeBank:
    def __init__(self, capacity: int = 16, groups_per_step: int = 1):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"replay.capacity must be an int >= 1, got {capacity!r}")
        if isinstance(groups_per_step, bool) or not isinstance(groups_per_step, int) or groups_per_step < 1:
            raise ValueError(f"replay.groups_per_step must be an int >= 1, got {groups_per_step!r}")
        self.capacity = capacity
        self.groups_per_step = groups_per_step
        self._ledger: dict[str, dict[str, int]] = {}
        self._prompts: dict[str, tuple[int, ...]] = {}
        self._exemplars: dict[str, dict[str, tuple[int, ...]]] = {}
        self.cursor = 0
        self.groups_scored = 0
        self.rows_scored = 0

    # ---- admission -------------------------------------------------------------------------

    def admit_group(self, prompt_ids: Sequence[int], keys: Sequence[str | None], rewards: Sequence[float],
                    active: Sequence[bool], responses: Sequence[Sequence[int]]) -> AdmitStats:
        """Admit one fresh group (all rows of one prompt)."""
        n = len(keys)
        if not (n == len(rewards) == len(active) == len(responses)) or n == 0:
            raise ValueError("a bank group needs one key, reward, active flag and response per row (and >= 1 row)")
        pkey = prompt_key(prompt_ids)
        eligible = [bool(a) and float(r) > 0 and isinstance(k, str) and bool(k)
                    for k, r, a in zip(keys, rewards, active)]
        disagreements = sum(bool(a) and ((float(r) > 0) != (isinstance(k, str) and bool(k)))
                            for k, r, a in zip(keys, rewards, active))
        ledger = self._ledger.get(pkey, {})
        current: dict[str, int] = {}
        for k, keep in zip(keys, eligible):
            if keep:
                current[k] = current.get(k, 0) + 1
        new_keys = sorted(set(current) - set(ledger))
        if current:
            updated = dict(ledger)
            for k, c in current.items():
                updated[k] = updated.get(k, 0) + c
            self._ledger[pkey] = updated
        if new_keys:  # every ledger entry starts with one, so every ledger prompt has its ids
            ids = _token_tuple(prompt_ids, "prompt")
            stored = self._prompts.get(pkey)
            if stored is not None and stored != ids:
                raise ValueError("replay bank: prompt key collision (two prompts with one SHA-256)")
            self._prompts[pkey] = ids
            exemplars = self._exemplars.setdefault(pkey, {})
            for k in new_keys:
                if len(exemplars) >= self.capacity:
                    break
                exemplars[k] = min(_token_tuple(resp, "response") for resp, key, keep in zip(responses, keys, eligible)
                                   if keep and key == k)
        self.groups_scored += 1
        self.rows_scored += n
        return AdmitStats(new_modes=len(new_keys), admitted_rows=sum(eligible), disagreements=disagreements)

    # ---- schedule --------------------------------------------------------------------------

    def schedule(self) -> list[ReplayGroup]:
        """This step's replay groups (advances the cursor); empty while no prompt holds an exemplar."""
        eligible = sorted(k for k, ex in self._exemplars.items() if ex)
        if not eligible:
            return []
        count = min(self.groups_per_step, len(eligible))
        start = self.cursor % len(eligible)
        chosen = [eligible[(start + i) % len(eligible)] for i in range(count)]
        self.cursor = (start + count) % len(eligible)
        return [self._group(k) for k in chosen]

    def _group(self, pkey: str) -> ReplayGroup:
        keys = tuple(sorted(self._exemplars[pkey]))
        return ReplayGroup(self._prompts[pkey], keys, tuple(self._exemplars[pkey][k] for k in keys))

    # ---- metrics ---------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """``bank/*`` metrics: prompts, modes (ledger keys), exemplars and their tokens, keys
        with no exemplar (capacity_dropped) and the share of prompts with >= 2 modes."""
        modes = sum(len(v) for v in self._ledger.values())
        exemplars = sum(len(v) for v in self._exemplars.values())
        prompts = len(self._ledger)
        return {
            "bank/prompts": float(prompts),
            "bank/modes": float(modes),
            "bank/exemplars": float(exemplars),
            "bank/exemplar_tokens": float(sum(len(e) for v in self._exemplars.values() for e in v.values())),
            "bank/capacity_dropped": float(modes - exemplars),
            "bank/support_ge2_frac": sum(len(v) >= 2 for v in self._ledger.values()) / prompts if prompts else 0.0,
        }

    # ---- checkpoint ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "capacity": self.capacity,
            "groups_per_step": self.groups_per_step,
            "cursor": self.cursor,
            "groups_scored": self.groups_scored,
            "rows_scored": self.rows_scored,
            "prompts": {
                pkey: {"prompt_ids": list(self._prompts[pkey]),
                       "ledger": dict(sorted(ledger.items())),
                       "exemplars": {k: list(v) for k, v in sorted(self._exemplars.get(pkey, {}).items())}}
                for pkey, ledger in sorted(self._ledger.items())
            },
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a saved bank; refuses another version, capacity or groups per step, a prompt
        whose ids do not hash to its key, an exemplar missing from the ledger and more
        exemplars than capacity."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"replay bank state version {state.get('version')!r}, expected {STATE_VERSION}")
        for name in ("capacity", "groups_per_step"):
            if state[name] != getattr(self, name):
                raise ValueError(f"the checkpoint's replay bank has {name} {state[name]}, this run {getattr(self, name)}")
        ledgers, prompts, exemplars = {}, {}, {}
        for pkey, entry in state["prompts"].items():
            ledger = {str(k): int(c) for k, c in entry["ledger"].items()}
            held = {str(k): _token_tuple(v, "response") for k, v in entry["exemplars"].items()}
            if prompt_key(entry["prompt_ids"]) != pkey:
                raise ValueError(f"replay bank: prompt {pkey[:12]}... does not hash to its key")
            prompts[pkey] = tuple(entry["prompt_ids"])
            if set(held) - set(ledger):
                raise ValueError(f"replay bank: prompt {pkey[:12]}... has exemplars missing from its ledger")
            if len(held) > self.capacity:
                raise ValueError(f"replay bank: prompt {pkey[:12]}... holds {len(held)} exemplars > capacity {self.capacity}")
            ledgers[pkey] = ledger
            if held:
                exemplars[pkey] = held
        self._ledger, self._prompts, self._exemplars = ledgers, prompts, exemplars
        self.cursor = int(state["cursor"])
        self.groups_scored = int(state["groups_scored"])
        self.rows_scored = int(state["rows_scored"])
