#!/usr/bin/env bash
# Install raytrain (and its test extra) into the active Python environment.
#
# torch comes first, chosen for the machine: an existing torch (a CUDA build on a GPU
# machine, say) is kept; a GPU machine without torch gets the default (CUDA) build; a
# machine without a GPU gets the CPU build, not the multi-GB CUDA one a bare `torch`
# requirement would pull.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${RAYTRAIN_TORCH_VERSION:-2.13.0}

if "$PY" -c "import torch" 2>/dev/null; then
    echo "install: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install: GPU found, installing torch (CUDA build)"
    "$PY" -m pip install "torch"
else
    echo "install: no GPU, installing torch ${TORCH_VERSION} (CPU build)"
    # A local wheel or mirror first (pip's find-links/index); then PyTorch's CPU index.
    "$PY" -m pip install "torch==${TORCH_VERSION}+cpu" 2>/dev/null \
        || "$PY" -m pip install "torch==${TORCH_VERSION}+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi
"$PY" -m pip install -e ".[test]"
