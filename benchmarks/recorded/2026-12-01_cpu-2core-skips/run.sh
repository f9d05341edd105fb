#!/bin/bash
# Kept as run; its outputs are in benchmarks/results/2026-12-01_cpu-2core-skips/ (this script once lived there).
# Skipped trials under a memory budget: does the search still run n_trials, and does TPE learn
# from the skips? The same budget sweep at two commits, on a fresh study each.
#   8092e1d: a skipped trial does not count against n_trials, and is told to Optuna as FAIL
#   24f1ff5: the same, told as PRUNED (TPE ranks it below every completed trial)
# Run from a clean clone of each commit (make setup first): bash <this script> failed|pruned
# (sweep_failed.log here was run by hand with sweep.preset_name=budget_0_9gb, the same sweep)
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
PY=${PY:-.venv/bin/python}
$PY train.py -m sweep=loader dataset=synthetic dataset.io_latency_ms=10 dataset.dtype=float32 \
  model=pooled_linear trainer.measure=loader sweep.memory_budget_gb=0.9 \
  sweep.preset_name=budget_0_9gb_$1 hydra.sweep.dir="/tmp/sweep_budget_$1" > "$HERE/sweep_$1.log" 2>&1
cp "/tmp/sweep_budget_$1/trials.csv" "$HERE/trials_$1.csv"
