# Kept as run; its outputs are in benchmarks/results/2026-12-02_cpu-2core-stalls-threads/ (this script once lived there).
cd /work/main
for mt in 2 1; do
  .venv/bin/python train.py dataset=custom dataset._target_=examples.stalls.StallingDataset model=tiny_cnn \
    loader.num_workers=32 loader.prefetch_factor=2 loader.main_threads=$mt \
    trainer.max_steps=null trainer.epochs=100000 trainer.max_seconds=45 trainer.save_checkpoint=false trainer.progress=false \
    hydra.run.dir=OUT/main_threads_$mt
  python3 -c "
import json; m=json.load(open('OUT/main_threads_$mt/metrics.json'))
print('mt=$mt', round(m['samples_per_sec']), 'whole', round(m['trained_samples']/m['train_seconds']), 'p50', round(m['step_time_p50_ms'],1), 'wait', round(m['data_wait_frac'],2), 'spread', round(m['window_spread'],2))
"
done
