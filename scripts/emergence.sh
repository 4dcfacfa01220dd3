#!/usr/bin/env bash
# The emergence grids of Gu et al. (2025), sections 4-7, at CPU scale, on the synthetic bigram-copy task
# (preset `synthetic`, 1,000 steps, 3 seeds a point; the baseline, shared by every grid, is trained once
# in data/emergence/base, with Sink_1 logged every 100 steps, and copied: --reuse). About 2 CPU-minutes a run. Each grid writes data/emergence/<grid>/{sweep,summary,
# curves}.csv and command.txt; finished runs are skipped, so the script resumes where it stopped.
# Usage: bash scripts/emergence.sh [GRID ...]   (default: every grid; JOBS=2 trains two runs at once)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-data/emergence}
BASE=(sweep --preset synthetic --steps 1000 --eval-every 200 --seed 0,1,2 --quiet --no-keep-models
      --jobs "${JOBS:-1}" --reuse "$OUT/base")
declare -A GRID=(
  [base]="--eval-every 100"
  [attention]="--attention softmax,softmax-scaled,softmax-pnorm,softpick,sigmoid,sigmoid-norm,elu1,elu1-norm,linear-elu1-norm,linear-identity,linear-mlp,linear-mlp-norm"
  [weight_decay]="--weight-decay 0,0.1,0.5,2,5"
  [lr]="--lr 1e-3,3e-3,1e-2"
  [fixed_position]="--fixed-token-position none,2,3"
  [biases]="--attention softmax,sink-token,kv-bias,k-bias,v-bias"
  [packing]="--dataset synthetic-docs --bos false,true --document-token none,0"
  [prefix]="--prefix-len 0,8"
  [window]="--sliding-window 4,16,none"
  [positions]="--positional-embedding-type rotary,none,alibi,sinusoidal,learned,relative --keep-models"  # weights kept: notebook 15, tests/positions/test_positions_grid.py
  [post_norm]="--norm-position pre,post"
)
ORDER=(base attention weight_decay fixed_position biases packing window prefix positions post_norm lr)
for grid in "${@:-${ORDER[@]}}"; do
  [ -n "${GRID[$grid]+set}" ] || { echo "unknown grid $grid; known: ${ORDER[*]}" >&2; exit 2; }
  # shellcheck disable=SC2086
  "$PY" -m analysis.train "${BASE[@]}" ${GRID[$grid]} ${EXTRA:-} --out "$OUT/$grid"
done
