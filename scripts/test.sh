#!/usr/bin/env bash
# Set everything up and run the whole test suite, offline.
# With no arguments: the main suite in .venv, then the vLLM backend tests in
# .venv-vllm (vLLM's CPU build; scripts/setup_vllm.sh). With arguments: pytest
# in .venv with those arguments only (e.g. tests/core/test_step.py -x); run
# scripts/test_vllm.sh [ARGS] for the vLLM tests alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export HF_HOME="$(mktemp -d)"
trap 'rm -rf "$HF_HOME"' EXIT
.venv/bin/python -m pytest -q "$@"
if [ "$#" -eq 0 ]; then
  bash scripts/test_vllm.sh
fi
