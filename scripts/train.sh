#!/usr/bin/env bash
# Set everything up and train. With no arguments: the built-in default
# (SmolLM2-135M-Instruct, reasoning-gym chain_sum, MaxEnt listwise, ~10 min on 2 CPU cores).
# Any arguments are passed to `maxent-grpo train`, e.g. --config recipes/grpo.yaml.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" TOKENIZERS_PARALLELISM=false
exec .venv/bin/maxent-grpo train "$@"
