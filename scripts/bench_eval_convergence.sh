#!/usr/bin/env bash
# Convergence through the product itself (issue 12): cascaded against ANCRe on the digits default,
# depth 12 and depth 24, 3 seeds each, with the in-training evaluation on (held-out loss + digits
# metric every EVAL_EVERY steps), then one compare_runs.py report per depth.
#   bash scripts/bench_eval_convergence.sh [RUNS_DIR] [REPORT_DIR]
# Sized for a shared 2-core CPU box (about 30 minutes): width 64, batch 32, a few hundred steps.
# Four streams run side by side (one per depth and topology, seeds in turn; one torch thread each),
# so the two topologies of a depth share the machine's load alike.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-results/bench-evalrun}
REPORT=${2:-benchmarks/results/evalrun}
STEPS12=${STEPS12:-300}
STEPS24=${STEPS24:-150}
EVAL_EVERY=${EVAL_EVERY:-50}
export OMP_NUM_THREADS=1

common=(model.hidden_size=64 model.num_heads=2 model.tau=0.01 train.global_batch_size=32 train.lr=1e-3
        train.ema_decay=0.995 train.ema_warmup=true train.sample_every=0 train.log_every=25 train.keep_last=1
        train.eval_every="$EVAL_EVERY" eval.num_samples=100 eval.batch_size=100 eval.sampler=dpm-solver
        eval.steps=10 "eval.cfg_scales=[1.0]" eval.heldout_draws=1 log.tensorboard=false)

stream() {  # depth steps topology
  topo=$3
  for seed in 0 1 2; do
      python3 train.py --config configs/digits-ancre.yaml run_dir="$RUNS/d$1-$topo-s$seed" --resume auto \
        model.depth="$1" model.topology="$topo" train.seed="$seed" train.max_steps="$2" train.ckpt_every="$2" \
        "${common[@]}" > "$RUNS/d$1-$topo-s$seed.log" 2>&1
      echo "$(date -u +%H:%M:%S) done d$1-$topo-s$seed"
  done
}

mkdir -p "$RUNS"
start=$(date +%s)
for topo in cascaded ancre; do
  stream 12 "$STEPS12" "$topo" &
  stream 24 "$STEPS24" "$topo" &
done
wait
echo "training wall time: $(( $(date +%s) - start )) s"
for d in 12 24; do
  python3 scripts/compare_runs.py "$RUNS"/d$d-cascaded-s[0-9] "$RUNS"/d$d-ancre-s[0-9] --group "d$d-cascaded-*" \
    --group "d$d-ancre-*" --out "$REPORT/depth$d"
done
