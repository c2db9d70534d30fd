"""The ``(key, type, default, help)`` rows of ``maxent-grpo train --help``, read off the config
dataclasses: each field carries its one line of help (``metadata["help"]``), beside its default."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Literal

from maxent_grpo.config.load import TrainConfig


def field_help() -> list[tuple[str, str, str, str]]:
    """``(dotted key, type, default, help)`` for every config field, for ``--help``: its help is on the
    field (``metadata["help"]``), where it is declared."""
    rows: list[tuple[str, str, str, str]] = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{prefix}{f.name}"
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint):
                walk(hint, key + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            if isinstance(default, list) and default and dataclasses.is_dataclass(default[0]):
                default = [dataclasses.asdict(d) for d in default]
            rows.append((key, _type_name(hint), repr(default), f.metadata["help"]))

    walk(TrainConfig, "")
    return rows


def _type_name(hint) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "|".join(map(str, typing.get_args(hint)))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint))


def config_reference() -> str:
    """docs/CONFIG.md: every config key, its type, default and help, section by section."""
    out = ["# Configuration reference", "",
           "Generated from the config dataclasses' fields (`python -m maxent_grpo.config.help "
           "--write docs/CONFIG.md`); `maxent-grpo train --help` prints the same lines. Each key's help is "
           "declared on its field, beside its default.", ""]
    section = None
    for key, type_name, default, text in field_help():
        top = key.split(".")[0] if "." in key else "(top level)"
        if top != section:
            section = top
            out += ["", f"## `{section}`" if section != "(top level)" else "## top level", "",
                    "| key | type | default | meaning |", "|---|---|---|---|"]
        cell = lambda s: s.replace("|", "\\|").replace("\n", " ")  # noqa: E731
        out.append(f"| `{key}` | {cell(type_name)} | `{cell(default)}` | {cell(text)} |")
    return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"


if __name__ == "__main__":
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description="Write the configuration reference (docs/CONFIG.md).")
    parser.add_argument("--write", type=Path, required=True)
    args = parser.parse_args()
    args.write.write_text(config_reference())
