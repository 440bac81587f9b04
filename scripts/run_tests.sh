#!/usr/bin/env bash
# Installs ancre-dit with its test extras on a fresh machine and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install torch==2.14.1 torchvision==0.29.1
python3 -m pip install -e ".[dev]"
python3 -m pytest tests "$@"
