#!/usr/bin/env bash
# The quick test loop on the oldest torch the package supports (pyproject.toml's floor), in a
# virtual environment of its own, so that the floor stays true: bash scripts/test_oldest_torch.sh [VENV_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=2.6.0 TORCHVISION=0.21.0  # keep in step with pyproject.toml's torch>=
VENV="${1:-${TMPDIR:-/tmp}/ancre-dit-torch-$TORCH}"
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q "torch==$TORCH" "torchvision==$TORCHVISION"
"$VENV/bin/python" -m pip install -q -e ".[dev]"
"$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'
"$VENV/bin/python" -m pytest -m "not slow" -n "${PYTEST_WORKERS:-auto}" tests
