#!/usr/bin/env bash
# scripts/gpu_check.py on a lent GPU machine that has PyTorch (and timm, accelerate, einops, ...) but
# not every dependency of ours, and no network (.library/device/KINDS.md lists what it holds).
# Our package is not installed there: it runs from the copied tree through PYTHONPATH, and the
# missing pure-Python packages travel as wheels in .whl/ (git-ignored: the run's carry names it).
#
#   here, once, with registry access:   bash scripts/gpu_check_device.sh --fetch
#   there (device run, carry [".whl"]): bash scripts/gpu_check_device.sh "$OUT"
#   extra arguments go to gpu_check.py: bash scripts/gpu_check_device.sh "$OUT" --budget-s 400
#
# Everything lands in OUT_DIR: gpu_check.json, gpu_check.md (both rewritten after every item, so a
# run stopped at its time limit keeps what it measured) and gpu_check.log.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${ANCRE_WHEELS:-.whl}"
# Not in the machine's image (diffusers needs importlib_metadata); the versions our CI tests with.
MISSING_THERE=(diffusers==0.42.1 torch-fidelity==0.4.0 importlib_metadata==10.2.0)

if [[ "${1:-}" == --fetch ]]; then
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "${MISSING_THERE[@]}"
  echo "wheels for the device machine in $WHEELS: $(ls "$WHEELS" | tr '\n' ' ')($(du -sh "$WHEELS" | cut -f1))"
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
python3 scripts/gpu_check.py --out "$OUT_DIR" "$@" 2>&1 | tee -a "$OUT_DIR/gpu_check.log"
