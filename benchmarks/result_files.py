"""The studies' raw results under ``benchmarks/results/`` are JSON lines stored gzipped.

A study writes each of its JSON-lines files as ``NAME.jsonl.gz`` (:func:`write_text`, :func:`copy`);
its analysis reads a file by its plain name, ``NAME.jsonl``, and finds either form
(:func:`read_text`, :func:`read_jsonl`, :func:`exists`): a gzipped one from the repository, or a
plain one that a trainer has just written. The gzip header carries no time stamp, so the same
text always gives the same bytes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

SUFFIX = ".gz"


def gzipped(path: Path) -> Path:
    """``path``'s gzipped name: ``X.jsonl`` -> ``X.jsonl.gz``."""
    path = Path(path)
    return path.with_name(path.name + SUFFIX)


def stored(path: Path) -> Path | None:
    """The file that holds ``path``'s text: ``path`` itself if it exists, else its gzipped form, else None."""
    path = Path(path)
    for candidate in (path, gzipped(path)):
        if candidate.is_file():
            return candidate
    return None


def exists(path: Path) -> bool:
    """Whether ``path`` or its gzipped form exists."""
    return stored(path) is not None


def read_text(path: Path) -> str:
    """The text of ``path``, read from the file or from its gzipped form."""
    found = stored(path)
    if found is None:
        raise FileNotFoundError(f"{path} (nor {gzipped(path).name})")
    if found.name.endswith(SUFFIX):
        with gzip.open(found, "rt", encoding="utf-8") as f:
            return f.read()
    return found.read_text(encoding="utf-8")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file (blank lines skipped), plain or gzipped."""
    return [json.loads(line) for line in read_text(path).splitlines() if line.strip()]


def write_text(path: Path, text: str) -> Path:
    """Store ``text`` as ``path``'s gzipped form (a plain ``path`` there is removed); return the file written."""
    path = Path(path)
    out = gzipped(path)
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(text.encode("utf-8"))
    path.unlink(missing_ok=True)
    return out


def copy(src: Path, dest: Path) -> Path:
    """Store the text of ``src`` (plain or gzipped) as ``dest``'s gzipped form."""
    return write_text(dest, read_text(src))
