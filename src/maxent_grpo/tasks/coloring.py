"""Graph-colouring completion: colour the remaining nodes of a small graph with 3 colours.

A graph of 4-6 nodes named 1, 2, 3, ..., edges listed; some nodes are already
coloured (R, G or B, a proper partial colouring). The answer names a colour for
each uncoloured node, e.g. ``3=R, 4=G``.

Verifier: every uncoloured node gets exactly one colour of R, G, B, no other
node is named, and the full colouring gives different colours to the two ends
of every edge. Mode key: the assignment, ``node=colour`` pairs sorted by node
(``4=G, 3=R`` and ``3=R,4=G`` are one mode). The valid completions are
enumerated by brute force (3^u assignments of the u uncoloured nodes).
"""

from __future__ import annotations

import itertools
import random
import re

__all__ = ["COLOURS", "enumerate_modes", "make_problem", "mode_key", "parse_assignment", "verify"]

COLOURS = ("R", "G", "B")
_PAIR = re.compile(r"([1-9])\s*(?:=|:|is)\s*([A-Za-z]+)")
_SEPARATORS = re.compile(r"[\s,;]*")
_COLOUR_WORDS = {"r": "R", "red": "R", "g": "G", "green": "G", "b": "B", "blue": "B"}


def parse_assignment(answer: str | None) -> dict[str, str] | None:
    """``{"3": "R", ...}`` from ``3=R, 4=G`` (colour words red/green/blue allowed), or None.

    None when the text holds anything besides such pairs and separators, or names a node twice.
    """
    if answer is None:
        return None
    assignment: dict[str, str] = {}
    position = 0
    text = answer.strip()
    for match in _PAIR.finditer(text):
        if _SEPARATORS.fullmatch(text[position : match.start()]) is None:
            return None
        node, colour = match[1], _COLOUR_WORDS.get(match[2].lower())
        if colour is None or node in assignment:
            return None
        assignment[node] = colour
        position = match.end()
    if not assignment or _SEPARATORS.fullmatch(text[position:]) is None:
        return None
    return assignment


def _proper(colouring: dict[str, str], edges: list[list[str]]) -> bool:
    return all(colouring[a] != colouring[b] for a, b in edges)


def verify(answer: str | None, nodes: list[str], edges: list[list[str]], fixed: dict[str, str]) -> bool:
    """True when ``answer`` colours exactly the nodes not in ``fixed`` and the whole colouring is proper."""
    assignment = parse_assignment(answer)
    free = [n for n in nodes if n not in fixed]
    if assignment is None or sorted(assignment) != sorted(free):
        return False
    return _proper({**fixed, **assignment}, edges)


def mode_key(answer: str | None, nodes: list[str], edges: list[list[str]], fixed: dict[str, str]) -> str | None:
    """``3=R,4=G`` (sorted by node) for a valid answer; None for an invalid one."""
    if not verify(answer, nodes, edges, fixed):
        return None
    assignment = parse_assignment(answer)
    return ",".join(f"{n}={assignment[n]}" for n in sorted(assignment))


def enumerate_modes(nodes: list[str], edges: list[list[str]], fixed: dict[str, str]) -> list[str]:
    """The mode keys of every valid completion, sorted."""
    free = [n for n in nodes if n not in fixed]
    modes = []
    for colours in itertools.product(COLOURS, repeat=len(free)):
        assignment = dict(zip(free, colours))
        if _proper({**fixed, **assignment}, edges):
            modes.append(",".join(f"{n}={assignment[n]}" for n in sorted(assignment)))
    return sorted(modes)


def make_problem(rng: random.Random, *, min_modes: int = 2, max_modes: int = 8) -> dict:
    """A random graph of 4-6 nodes with 2 uncoloured nodes (sometimes 3) and ``min_modes``..``max_modes`` modes."""
    while True:
        n = rng.randint(4, 6)
        nodes = [str(i + 1) for i in range(n)]
        edges = [[a, b] for a, b in itertools.combinations(nodes, 2) if rng.random() < 0.45]
        if len(edges) < n - 1:
            continue
        free = sorted(rng.sample(nodes, 3 if rng.random() < 0.25 else 2))
        fixed = {v: rng.choice(COLOURS) for v in nodes if v not in free}
        if not _proper(fixed, [e for e in edges if e[0] in fixed and e[1] in fixed]):
            continue
        modes = enumerate_modes(nodes, edges, fixed)
        if min_modes <= len(modes) <= max_modes:
            return {"nodes": nodes, "edges": edges, "fixed": fixed, "num_valid": len(modes), "example": modes[0]}
