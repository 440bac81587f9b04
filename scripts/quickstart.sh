#!/usr/bin/env bash
# The README's first command: install, train the embedded digits default with ANCRe residuals on
# the CPU, sample from its EMA weights and check the digits. Everything lands in results/quickstart/:
#   checkpoints/<step>/ (sample.py reads these), samples/<step>.png (EMA grids during training),
#   topology.json + topology.png (learned residual wiring), loss.png, quality.png (held-out loss and
#   the digits metric every 200 steps, from logs/evals.jsonl), log.txt, logs/ (TensorBoard),
#   samples.npz + samples.png (the final EMA samples).
# The recipe (configs/quickstart.yaml): flow matching, 6 ANCRe blocks, 600 steps; about 2 minutes on
# 2 CPU cores once the packages are installed, plus pip's check, which a rerun skips
# (BENCHMARKS.md, "The quickstart").
# Extra arguments are config overrides, e.g. `bash scripts/quickstart.sh train.max_steps=500`.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=results/quickstart

# pip runs unless this python already installed this checkout as pyproject.toml now reads (its
# check costs about 20 s on a rerun): the stamp records the interpreter, the installed versions of
# torch and ancre-dit, and pyproject.toml's hash, so any change to those installs again.
STAMP=results/.installed
installed_state() {
  python3 - <<'PY'
import hashlib, importlib.metadata as md, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "missing"
print(sys.executable, version("torch"), version("ancre-dit"), hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest())
PY
}
if [[ "${SKIP_INSTALL:-0}" != 1 && "$(cat "$STAMP" 2>/dev/null)" != "$(installed_state)" ]]; then
  python3 -m pip install torch==2.14.1 torchvision==0.29.1
  python3 -m pip install -e ".[dev]"
  mkdir -p results && installed_state > "$STAMP"
fi

# Both cores: the model's matrix products are large enough for a second thread to pay (1.47x a step).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"

# The resume makes a rerun continue (or finish at once) instead of starting over.
python3 train.py --config configs/quickstart.yaml run_dir="$RUN" --resume auto "$@"

CKPT=$(ls -d "$RUN"/checkpoints/[0-9]* | sort | tail -n 1)
python3 sample.py --ckpt "$CKPT" --num-samples 200 --batch-size 200 --cfg-scale 2.0 --sampler heun --steps 10 --out "$RUN/samples.npz" \
  --grid "$RUN/samples.png" --cpu
# Offline check (no Inception weights needed): an independent classifier's accuracy on the samples.
python3 evaluate.py --samples "$RUN/samples.npz" --digits
echo "quickstart outputs: $RUN (checkpoints/, samples.png, samples/, topology.png, loss.png, quality.png, diagnostics.png, log.txt)"
