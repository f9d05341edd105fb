#!/bin/bash
# Kept as run; its outputs are in benchmarks/results/2026-12-01_cpu-2core-webdataset/ (this script once lived there).
# alternating: photos/recipe, webdataset/recipe, webdataset/recipe+decode=device; 2 rounds
cd /tmp/wds
OUT=/tmp/cmp; rm -rf $OUT; mkdir -p $OUT
for r in 1 2; do
  for c in photos webdataset webdataset_device; do
    case $c in
      photos) a="dataset=photos";;
      webdataset) a="dataset=webdataset";;
      webdataset_device) a="dataset=webdataset loader.decode=device";;
    esac
    PYTHONPATH=/tmp/wds/src /work/main/.venv/bin/python train.py $a loader=recipe trainer.progress=false hydra.run.dir=$OUT/${c}_$r > $OUT/${c}_$r.log 2>&1
    python3 -c "import json;m=json.load(open('$OUT/${c}_$r/metrics.json'));print('$c $r', round(m['samples_per_sec'],1), 'wait', round(m['data_wait_frac'],3), 'first', round(m['first_batch_s'],2), 'restart', m['epoch_restart_s'] and round(m['epoch_restart_s'],2), 'cpu', m['cpu_util'] and round(m['cpu_util'],2), 'other', round(m['other_cpu_frac'] or 0,2), 'pss', round(m['peak_pss_mb']))" >> $OUT/summary.txt
  done
done
echo done >> $OUT/summary.txt
