#!/bin/bash
# Kept as run; its outputs are in benchmarks/results/2026-12-01_cpu-2core-travel/ (this script once lived there).
# The two presets the sweeps wrote (run.sh steps 1-2), measured in 5 alternating rounds as a
# sweep's final rounds are (streaming, 3 s windows), and compared: unbounded / budget.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../../.."
PY=${PY:-.venv/bin/python}
WORKLOAD="dataset=synthetic dataset.io_latency_ms=10 dataset.dtype=float32 model=pooled_linear trainer.measure=loader"
RUN="trainer.stream=true trainer.max_steps=100000 trainer.max_seconds=3 trainer.progress=false trainer.save_checkpoint=false"
cp "$HERE/budget_0_9gb.yaml" "$HERE/unbounded.yaml" conf/loader/
rm -rf "$HERE/alternate"
for round in 1 2 3 4 5; do
  for preset in unbounded budget_0_9gb; do
    [ $((round % 2)) -eq 0 ] && preset=$([ $preset = unbounded ] && echo budget_0_9gb || echo unbounded)
    $PY train.py $WORKLOAD loader=$preset $RUN hydra.run.dir="$HERE/alternate/$preset/$round" > /dev/null 2>&1
  done
done
rm -f conf/loader/budget_0_9gb.yaml conf/loader/unbounded.yaml
$PY - "$HERE/alternate" <<'PY'
import json, sys
from pathlib import Path
from feedrate.stats import compare
root = Path(sys.argv[1])
runs = {p: [json.loads((root / p / str(r) / "metrics.json").read_text()) for r in range(1, 6)]
        for p in ("unbounded", "budget_0_9gb")}
for p, ms in runs.items():
    print(f"{p:13} samples/s {[round(m['samples_per_sec']) for m in ms]}"
          f"  peak PSS MB {[round(m['peak_pss_mb']) for m in ms]}")
rate = {p: [m["samples_per_sec"] for m in ms] for p, ms in runs.items()}
print("unbounded / budget_0_9gb:", compare(rate["unbounded"], rate["budget_0_9gb"]).describe())
PY
