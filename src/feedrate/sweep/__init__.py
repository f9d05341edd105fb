"""The loader sweep (``python train.py -m sweep=loader``), mirroring ``conf/sweep/``.

- :mod:`~feedrate.sweep.space`: what is searched, its bounds, the first trials and the climb
  past them;
- :mod:`~feedrate.sweep.search`: between trials, where the search may go and when it ends (the
  seeds' bound, the early stop of a clearly slower trial, the stop near the ceiling): the
  trial launcher asks it and runs the trials, the sweeper asks Optuna and tells it;
- :mod:`~feedrate.sweep.trial`: one trial, with a time limit, and what it left behind;
- :mod:`~feedrate.sweep.host`: the warm trial host that runs trial after trial in one process;
- :mod:`~feedrate.sweep.feasibility`: trials predicted to exhaust memory or /dev/shm, skipped;
- :mod:`~feedrate.sweep.ceiling`: loader-only and compute-only, the bound the search stops near;
- :mod:`~feedrate.sweep.study`: the Optuna study's storage, lock and unfinished trials;
- :mod:`~feedrate.sweep.decide`: the final rounds' contestants (the rules that decide are
  :mod:`feedrate.tuning.decide`, the climb's too);
- the winner is written to ``conf/loader/`` by :mod:`feedrate.tuning.preset`, the one preset
  writer (the tuning loader writes its presets there too);
- :mod:`~feedrate.sweep.report`: trials.csv, sweep_report.md and the plots;
- :mod:`~feedrate.sweep.callback`: the Hydra callback that runs all of it around the study.
"""
