#!/usr/bin/env bash
# Set everything up and run the whole test suite, offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
export HF_HOME="$(mktemp -d)"
trap 'rm -rf "$HF_HOME"' EXIT
.venv/bin/python -m pytest -q "$@"
