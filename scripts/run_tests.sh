#!/usr/bin/env bash
# Installs ancre-dit with its test extras on a fresh machine and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install torch==2.14.1 torchvision==0.29.1
python3 -m pip install -e ".[dev]"
# One worker per core (pytest-xdist): many tests wait on subprocesses, launchers and signals, and the
# others run one thread each. PYTEST_WORKERS=0 runs them in this process.
python3 -m pytest -n "${PYTEST_WORKERS:-auto}" --dist worksteal --durations=15 tests "$@"
