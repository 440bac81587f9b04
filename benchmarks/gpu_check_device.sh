#!/usr/bin/env bash
# benchmarks/gpu_check.py on a GPU machine without network: one whose image has PyTorch (and timm,
# accelerate, einops, ...) but not every dependency of ours, and where pip cannot download anything.
# Our package is not installed there: the check runs from a copy of this tree through PYTHONPATH, and
# the missing pure-Python packages travel with the tree as wheels in .whl/ (git-ignored).
#
#   on a machine with network, once:      bash benchmarks/gpu_check_device.sh --fetch
#   ... for a GPU machine whose Python differs from this one (pydantic-core is a compiled wheel):
#       bash benchmarks/gpu_check_device.sh --fetch --python-version 3.12 --platform manylinux2014_x86_64
#   copy the tree, .whl/ included, then:  bash benchmarks/gpu_check_device.sh OUT_DIR
#   extra arguments go to gpu_check.py:   bash benchmarks/gpu_check_device.sh OUT_DIR --steps 10
#
# Everything lands in OUT_DIR: gpu_check.json, gpu_check.md (both rewritten after every item, so a
# run stopped at a time limit keeps what it measured) and gpu_check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${ANCRE_WHEELS:-.whl}"
# What a PyTorch-only image usually lacks (diffusers needs importlib_metadata, pydantic its three helpers);
# the versions our CI tests with.
MISSING_THERE=(diffusers==0.42.1 torch-fidelity==0.4.0 importlib_metadata==10.2.0
               pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2)

if [[ "${1:-}" == --fetch ]]; then
  shift
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "$@" "${MISSING_THERE[@]}"
  echo "wheels for the GPU machine in $WHEELS: $(ls "$WHEELS" | tr '\n' ' ')($(du -sh "$WHEELS" | cut -f1))"
  exit 0
fi

OUT_DIR="${1:?usage: gpu_check_device.sh OUT_DIR [gpu_check.py arguments] | --fetch}"
shift
mkdir -p "$OUT_DIR"
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ancre_site \
    "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/ancre_site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c 'import torch; print("torch", torch.__version__, "| cuda", torch.version.cuda, "|",
            torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU visible")' \
  | tee "$OUT_DIR/gpu_check.log"
python3 -m benchmarks.gpu_check --out "$OUT_DIR" "$@" 2>&1 | tee -a "$OUT_DIR/gpu_check.log"
