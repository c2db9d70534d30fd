"""The README's commands, paths and signatures are the code's: a renamed flag, a moved file or a
changed signature fails here instead of drifting."""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import maxent_grpo
from maxent_grpo.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CODE_BLOCKS = re.findall(r"```[a-z]*\n(.*?)```", README, re.S)


def _commands() -> list[str]:
    """Every ``maxent-grpo SUB ...`` in the README: inline code spans, and code-block lines with their
    indented continuation lines; cut at `` -- `` (what follows goes to another program)."""
    found = [m.group(1) for m in re.finditer(r"`(maxent-grpo [^`]*)`", README)]
    for block in CODE_BLOCKS:
        for chunk in re.split(r"\n(?=\S)", block):
            if chunk.startswith("maxent-grpo "):
                found.append(" ".join(chunk.split()))
    return [c.split(" -- ")[0] for c in found]


def test_readme_commands_name_real_subcommands_and_options():
    subparsers = next(a for a in build_parser()._actions if a.dest == "command").choices
    commands = _commands()
    assert len(commands) >= 8
    for command in commands:
        words = command.split()
        assert words[1] in subparsers, f"README: {command!r}: no subcommand {words[1]!r}"
        options = subparsers[words[1]]._option_string_actions
        for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", " ".join(words[2:])):
            assert flag in options, f"README: {command!r}: maxent-grpo {words[1]} has no option {flag}"


def test_readme_paths_and_modules_exist():
    paths = set(re.findall(r"(?<![\w/.-])((?:scripts|recipes|examples|docs|benchmarks)/[\w./-]+\.(?:sh|yaml|py|jsonl|md))",
                           README))
    assert len(paths) >= 10
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == [], f"README names files that do not exist: {missing}"
    for module in set(re.findall(r"python -m ([\w.]+)", README)):
        assert importlib.util.find_spec(module) is not None, f"README: python -m {module}: no such module"


def _callables_named(name: str) -> list:
    """Every module-level function and class method called ``name`` in the package (the modules
    whose source defines it)."""
    found = []
    src = Path(maxent_grpo.__file__).parent
    for path in sorted(src.rglob("*.py")):
        if not re.search(rf"^\s*(?:async )?def {name}\(", path.read_text(), re.M):
            continue
        module = importlib.import_module(".".join(("maxent_grpo", *path.relative_to(src).with_suffix("").parts)))
        for obj in vars(module).values():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj) and obj.__name__ == name:
                found.append(obj)
            elif inspect.isclass(obj) and inspect.isfunction(vars(obj).get(name)):
                found.append(vars(obj)[name])
    return found


def _agrees(fn, shown: list[str]) -> bool:
    """README's ``name(a, b, *, c, d)``: as many required positional parameters as names before ``*``
    (``self`` aside; the README may name their types), and after ``*`` exactly the keyword-only ones."""
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    before = shown[: shown.index("*")] if "*" in shown else shown
    if len(before) != len(required):
        return False
    if "*" in shown:
        return shown[shown.index("*") + 1:] == [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    return True


# Python's own functions (range, zip) are called in the README's examples, not documented there.
SIGNATURES = [m for block in CODE_BLOCKS for m in re.finditer(r"\b([a-z_]\w*)\(([\w\s,*]*)\)", block)
              if not hasattr(builtins, m.group(1))]


@pytest.mark.parametrize("match", SIGNATURES, ids=[m.group(1) for m in SIGNATURES])
def test_readme_signatures_match_the_code(match):
    name = match.group(1)
    shown = [a.strip() for a in match.group(2).split(",") if a.strip()]
    candidates = _callables_named(name)
    assert candidates, f"README shows {match.group(0)}, and the package has no function {name}"
    assert any(_agrees(fn, shown) for fn in candidates), (
        f"README shows {match.group(0)}; the code has "
        + "; ".join(f"{fn.__qualname__}{inspect.signature(fn)}" for fn in candidates))
