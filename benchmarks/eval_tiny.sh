#!/usr/bin/env bash
# The "dcache eval on the bundled tiny model" section of BENCHMARKS.md, produced by `dcache eval` itself:
#
#   bash benchmarks/eval_tiny.sh            # about 15 min on 2 busy CPU cores; SEEDS=8 for more samples
#   python benchmarks/assemble.py           # then rebuild BENCHMARKS.md
#
# 1. Calibration on labels 0-9, seed 0 (the bundled MagCache / TeaCache tables come from the same run):
#    an ERTACache plan (default threshold, with its timestep adjustment phi, which the plan carries as its step
#    action) and a static plan from `dcache search --method dp` at half the block FLOPs.
# 2. `dcache eval`: the uncached reference, six methods at their default settings (plus the faster presets of
#    FBCache and EasyCache, whose defaults reuse little on this model) and the DP plan, on held-out seeds (1000..),
#    labels 0-9. It writes benchmarks/results/eval_tiny/{report.md,report.html,results.json,*.png};
#    its records (.work/, ignored by git) let an interrupted run resume with the same command.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/eval_tiny
SEEDS=${SEEDS:-4}
PLAN=$OUT/plans/dp-0.5.plan.json
ERTA=$OUT/plans/ertacache.plan.json
DCACHE=${DCACHE:-"python -m dcache.pipelines.cli"}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one torch thread: the tiny model's tensors are small

if [ ! -f "$PLAN" ]; then
  SEARCH=$(mktemp -d)
  $DCACHE search --method dp --budget 0.5 --steps 28 --out "$SEARCH" --no-progress
  mkdir -p "$OUT/plans"
  cp "$SEARCH"/plans/*.plan.json "$PLAN"
  rm -rf "$SEARCH"
fi

if [ ! -f "$ERTA" ]; then
  python - "$ERTA" <<'PY'
import sys

from dcache.pipelines.runner import GenerationJob, load_pipeline
from dcache.schedules.tuning.ertacache_calibration import calibrate_ertacache

pipe, _ = load_pipeline("tiny")
pipe.set_progress_bar_config(disable=True)
job = GenerationJob(pipe, True, prompts=[str(i) for i in range(10)], seed=0)  # 28 steps, the pipeline's CFG
calibrate_ertacache(pipe, [job]).save(sys.argv[1])
print("wrote", sys.argv[1])
PY
fi

$DCACHE eval --model tiny --methods magcache,fbcache,fbcache-fast,teacache,taylorseer,"ertacache:plan=$ERTA" \
  --methods easycache,easycache-fast,"$PLAN" \
  --seeds "$SEEDS" --seed-offset 1000 --out "$OUT"
