"""What each bench's figures depend on, besides its workloads' own files: a result is stale
(benchmarks/doc_tables.py) only where one of these changed after it was measured."""

from __future__ import annotations

TUNER = (  # what decides and what measures a tuner's figures
    "src/feedrate/tuning",
    "src/feedrate/sweep",
    "src/feedrate/loader.py",
    "src/feedrate/threads.py",
    "src/feedrate/autotune.py",
    "src/feedrate/meter.py",
    "conf/loader",
    "conf/sweep",
)
RUN = (  # a trial is a run: its start, warm-up and end
    "src/feedrate/trainer.py",
    "src/feedrate/launch.py",
    "src/feedrate/monitor.py",
)
ENGINE = (
    "src/feedrate/loader.py",
    "src/feedrate/threads.py",
    "src/feedrate/meter.py",
    "src/feedrate/batch.py",
    "conf/loader",
)
SUITE = (  # the CI job's time: the code, the tests and how they are set up
    "tests",
    "src",
    "conf",
    "examples",
    "train.py",
    "Makefile",
    "pyproject.toml",
    "requirements.lock",
    ".ci",
)
DEPENDS_ON = {  # bench script -> paths
    "autotune_bench.py": TUNER,
    "loader_bench.py": TUNER,
    "sweep_time.py": (*TUNER, *RUN),
    "host_start.py": (*TUNER, *RUN),
    "warm_vs_fresh.py": (*TUNER, *RUN),
    "ranks_bench.py": (*TUNER, "src/feedrate/distributed.py"),
    "loop_bench.py": (
        *TUNER,
        "src/feedrate/trainer.py",
        "examples/plain_loop.py",
        "examples/lightning_module.py",
        "examples/hf_trainer.py",
    ),
    "engine_bench.py": (*ENGINE, "examples/catalog_store.py"),
    "engine_libraries.py": (*ENGINE, "src/feedrate/stream.py"),
    "costs_overhead.py": (*ENGINE, "src/feedrate/costs.py"),
    "suite_time.py": SUITE,
}
