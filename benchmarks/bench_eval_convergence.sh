#!/usr/bin/env bash
# Convergence through the product itself: cascaded against ANCRe on the digits default,
# depth 12 and depth 24, 3 seeds each, with the in-training evaluation on (held-out loss + the digits
# metric every EVAL_EVERY steps), then one compare_runs.py report per depth.
#   bash benchmarks/bench_eval_convergence.sh [RUNS_DIR] [REPORT_DIR]
# Knobs (environment): STEPS12, STEPS24 (training steps per depth), EVAL_EVERY, OBJECTIVE (flow or
# ddpm), CFGS (the evaluation's guidance scales). The two topologies of a depth run side by side (one
# torch thread each, seeds in turn), so they share the machine's load alike; the depths run in turn.
# --resume auto: rerunning the command continues unfinished runs instead of starting them over.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-results/bench-evalrun}
REPORT=${2:-benchmarks/results/evalrun}
STEPS12=${STEPS12:-2000}
STEPS24=${STEPS24:-1500}
EVAL_EVERY=${EVAL_EVERY:-250}
OBJECTIVE=${OBJECTIVE:-flow}
CFGS=${CFGS:-[1.0,2.0]}
export OMP_NUM_THREADS=1

case "$OBJECTIVE" in
  flow) objective=(diffusion.objective=flow model.learn_sigma=false eval.sampler=heun eval.steps=10) ;;
  ddpm) objective=(diffusion.objective=ddpm model.learn_sigma=true eval.sampler=dpm-solver eval.steps=10) ;;
  *) echo "OBJECTIVE must be flow or ddpm" >&2; exit 2 ;;
esac
common=(model.hidden_size=64 model.num_heads=2 model.tau=0.01 train.global_batch_size=32 train.lr=1e-3
        train.ema_decay=0.995 train.ema_warmup=true train.sample_every=0 train.log_every=50 train.keep_last=1
        train.eval_every="$EVAL_EVERY" eval.num_samples=100 eval.batch_size=100 "eval.cfg_scales=$CFGS"
        eval.heldout_draws=1 log.tensorboard=false "${objective[@]}")

stream() {  # depth steps topology
  for seed in 0 1 2; do
      name="d$1-$3-s$seed"
      python3 train.py --config configs/digits-ancre.yaml run_dir="$RUNS/$name" --resume auto \
        model.depth="$1" model.topology="$3" train.seed="$seed" train.max_steps="$2" train.ckpt_every="$2" \
        "${common[@]}" > "$RUNS/$name.log" 2>&1
      echo "$(date -u +%H:%M:%S) done $name"
  done
}

mkdir -p "$RUNS"
start=$(date +%s)
for depth_steps in "12 $STEPS12" "24 $STEPS24"; do
  set -- $depth_steps
  stream "$1" "$2" cascaded &
  stream "$1" "$2" ancre &
  wait
done
echo "training wall time: $(( $(date +%s) - start )) s"
for d in 12 24; do
  python3 scripts/compare_runs.py "$RUNS"/d$d-cascaded-s[0-9] "$RUNS"/d$d-ancre-s[0-9] --group "d$d-cascaded-*" \
    --group "d$d-ancre-*" --out "$REPORT/depth$d"
done
