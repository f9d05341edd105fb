#!/bin/bash
# Kept as run; its outputs are in benchmarks/results/2026-12-01_cpu-2core-travel/ (this script once lived there).
# Presets that travel, measured on one machine: a loader sweep with a memory budget and one
# without, the same preset moved to other machines, loader=auto, and a run whose storage slows
# down half-way. Run from a clean checkout: bash benchmarks/recorded/<this dir>/run.sh
# (it writes presets into conf/loader/ of that checkout, and its outputs beside this script).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
PY=${PY:-.venv/bin/python}
WORKLOAD="dataset=synthetic dataset.io_latency_ms=10 dataset.dtype=float32 model=pooled_linear trainer.measure=loader"
SHORT="trainer.max_steps=60 trainer.warmup_steps=10 trainer.window_steps=10 trainer.progress=false trainer.save_checkpoint=false"
log() { echo "== $*"; }

if [ -z "${SKIP_SWEEPS:-}" ]; then
  log "1. sweep with a 0.9 GB memory budget"
  $PY train.py -m sweep=loader $WORKLOAD sweep.memory_budget_gb=0.9 sweep.preset_name=budget_0_9gb \
    hydra.sweep.dir="$HERE/sweep_budget" > "$HERE/sweep_budget.log" 2>&1
  log "2. the same sweep without a budget"
  $PY train.py -m sweep=loader $WORKLOAD sweep.preset_name=unbounded \
    hydra.sweep.dir="$HERE/sweep_unbounded" > "$HERE/sweep_unbounded.log" 2>&1
  cp conf/loader/budget_0_9gb.yaml conf/loader/unbounded.yaml "$HERE/"
else  # SKIP_SWEEPS=1: the presets the sweeps wrote before
  cp "$HERE/budget_0_9gb.yaml" "$HERE/unbounded.yaml" conf/loader/
fi

log "3. the unbounded preset, moved to a 16-core H200 node and to a 32-core CPU node"
$PY - <<'PY'
import yaml
from pathlib import Path
src = Path("conf/loader/unbounded.yaml").read_text()
for name, machine, workers in (
    ("h200_16core", {"usable_cores": 16, "ram_gb": 128.0, "gpu_name": "NVIDIA H200", "gpu_count": 1}, 64),
    ("cpu_32core", {"usable_cores": 32, "ram_gb": 256.0, "gpu_name": None, "gpu_count": 0}, 96),
):
    head, _, body = src.partition("defaults:")
    data = yaml.safe_load("defaults:" + body)
    data["measured_on"]["machine"].update(machine)
    data["num_workers"] = workers
    text = head.replace("loader=unbounded", f"loader={name}") + yaml.safe_dump(data, sort_keys=False)
    Path(f"conf/loader/{name}.yaml").write_text(text)
PY
$PY train.py $WORKLOAD loader=h200_16core $SHORT hydra.run.dir="$HERE/run_moved" > "$HERE/run_moved.log" 2>&1
grep "measured elsewhere" "$HERE/run_moved.log"
$PY -m feedrate.doctor --no-measure $WORKLOAD loader=h200_16core > "$HERE/doctor_moved.txt" 2>&1
grep -A1 "^Loader preset$" "$HERE/doctor_moved.txt"

log "4. loader=auto: this machine's presets; without them, the closest that fits; another workload"
$PY train.py $WORKLOAD loader=auto $SHORT hydra.run.dir="$HERE/run_auto" > "$HERE/run_auto.log" 2>&1
grep "loader=auto picked" "$HERE/run_auto.log"
rm conf/loader/unbounded.yaml conf/loader/budget_0_9gb.yaml  # copies of them are in $HERE
$PY train.py $WORKLOAD loader=auto $SHORT hydra.run.dir="$HERE/run_auto_elsewhere" > "$HERE/run_auto_elsewhere.log" 2>&1
grep "loader=auto picked" "$HERE/run_auto_elsewhere.log"
cp "$HERE/budget_0_9gb.yaml" "$HERE/unbounded.yaml" conf/loader/
$PY train.py $WORKLOAD dataset.io_latency_ms=5 loader=auto $SHORT hydra.run.dir="$HERE/run_auto_other_workload" > "$HERE/run_auto_other_workload.log" 2>&1
grep "loader=auto picked" "$HERE/run_auto_other_workload.log"

log "5. a run whose storage slows down half-way"
$PY train.py dataset=synthetic dataset.image_size=32 dataset.slowdown_after_s=8 dataset.slowdown_ms=10 \
  model=tiny_cnn loader=recipe loader.batch_size=32 trainer.max_steps=100000 trainer.max_seconds=20 \
  trainer.progress=false trainer.save_checkpoint=false hydra.run.dir="$HERE/run_drift" > "$HERE/run_drift.log" 2>&1
grep "fell behind" "$HERE/run_drift.log"
rm -f conf/loader/h200_16core.yaml conf/loader/cpu_32core.yaml conf/loader/budget_0_9gb.yaml conf/loader/unbounded.yaml
