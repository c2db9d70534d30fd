#!/usr/bin/env bash
# Set up .venv-vllm (vLLM's CPU build) and run the vLLM backend tests there, offline.
# Arguments go to pytest (default: tests/rollout/test_vllm.py and test_vllm_async.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_vllm.sh
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
# vLLM's CPU KV cache defaults to several GiB per engine; the tests' tiny engines need little.
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export HF_HOME="$(mktemp -d)"
trap 'rm -rf "$HF_HOME"' EXIT
if [ "$#" -eq 0 ]; then set -- tests/rollout/test_vllm.py tests/rollout/test_vllm_async.py tests/rollout/test_vllm_lora_adapter.py; fi
# -p no:logging: vLLM logs from atexit handlers after pytest has closed its capture streams.
.venv-vllm/bin/python -m pytest -q -p no:logging "$@"
