"""Schemas for every config group, registered in Hydra's ConfigStore.

Each group in ``conf/`` has a dataclass here, so a typo (``loader.num_wokers=8``) or a wrong
type (``loader.batch_size=big``) fails at composition and names the key, before any data is
built or any worker is started. Value checks that types cannot express (sizes that must be
positive, options that contradict each other) live in :mod:`feedrate.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

# What ``hydra.utils.instantiate`` may call (Hydra 1.4's execution whitelist): feedrate's own
# classes and torchvision's, at any depth, and the one target the run's config names for the
# dataset or the model (``dataset=custom dataset._target_=my_pkg.data.MyDataset``: a class of
# the user's own is the point). A target nested in that class's arguments must be one of ours.
BUILT_IN_TARGETS = ("feedrate.*", "torchvision.models.*", "torchvision.datasets.*")
# ... and what Hydra itself instantiates for a run (train.py's @hydra.main): the sweeper's
# search space and the sweep's callback are feedrate's, Optuna's samplers the sweeper's.
TRUSTED_TARGETS = [*BUILT_IN_TARGETS, "optuna.samplers.*"]


def execution_whitelist(target: str | None) -> list[str]:
    return [*BUILT_IN_TARGETS, *([str(target)] if target else [])]


DEFAULT_COLLATE = "torch.utils.data.default_collate"
DEFAULT_STEP = "feedrate.steps.classify"


class StartMethod(Enum):
    """``multiprocessing`` start methods for DataLoader workers."""

    fork = "fork"
    spawn = "spawn"
    forkserver = "forkserver"


class Engine(Enum):
    """What runs the loader's workers: processes (the DataLoader) or threads of the training
    process (feedrate.threads)."""

    process = "process"
    thread = "thread"


class Device(Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class AmpDtype(Enum):
    auto = "auto"  # bf16 on a CUDA device that supports it, otherwise none
    none = "none"
    bf16 = "bf16"
    fp16 = "fp16"


class Decode(Enum):
    cpu = "cpu"  # in the workers, per sample (Pillow)
    device = "device"  # workers read bytes; the training process decodes the batch on the device


class Measure(Enum):
    train = "train"  # the real training step: what the run is for
    loader = "loader"  # batches delivered to the device, no model: the loader's ceiling
    compute = "compute"  # the model on one device-resident batch, no loader: the model's ceiling


class OnDrift(Enum):
    warn = "warn"  # the drift guard's warning only
    retune = "retune"  # loader=autotune: tune again at the next epoch boundary


class Optimizer(Enum):
    sgd = "sgd"
    adamw = "adamw"


@dataclass
class MeasuredMachine:
    """The machine a preset was tuned on (feedrate.hardware.Fingerprint's figures)."""

    usable_cores: float = MISSING
    ram_gb: float = MISSING
    shm_gb: float | None = None
    gpu_name: str | None = None
    gpu_count: int = 0
    cpu_model: str = ""


@dataclass
class MeasuredWorkload:
    """What a preset was tuned to feed: the dataset and model built (target and settings),
    the batch size and the precision."""

    dataset: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    batch_size: int = MISSING
    precision: str = MISSING
    # training processes on the node (torchrun's --nproc_per_node) sharing its cores
    ranks_per_node: int = 1
    # the user's own training step and collate function, by import path (null: the defaults)
    step: str | None = None
    collate_fn: str | None = None


@dataclass
class MeasuredOn:
    """A preset's provenance, which feedrate reads: where and on what it was measured, and
    what it measured (docs/design.md, "Presets that travel")."""

    machine: MeasuredMachine = field(default_factory=MeasuredMachine)
    workload: MeasuredWorkload = field(default_factory=MeasuredWorkload)
    samples_per_sec: float | None = None
    data_wait_frac: float | None = None
    peak_pss_mb: float | None = None  # the whole tree: main process and workers
    date: str = ""
    study: str = ""


@dataclass
class LoaderConfig:
    """``torch.utils.data.DataLoader`` arguments, under the DataLoader's own names, and the
    thread counts of its workers and of the training process.

    ``pin_memory: null`` lets the hardware profile decide (pinned on CUDA, off on CPU).
    ``prefetch_factor: null`` is PyTorch's own default (2 per worker when there are workers).
    ``shuffle`` defaults to true because this is a training loader.
    """

    batch_size: int = 64
    num_workers: int = 0
    # the workers: processes (the DataLoader's) or threads of the training process, which
    # cost no copy of the dataset and win where samples wait on I/O (docs/design.md)
    engine: Engine = Engine.process
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    multiprocessing_context: StartMethod | None = None
    timeout: float = 0.0
    drop_last: bool = False
    shuffle: bool = True
    # Intra-op threads of each worker (null: PyTorch's 1; more only with forkserver or spawn:
    # forked workers hang) and of the main process while it trains (null:
    # hardware.torch_threads). On a CPU host the model and the workers share the cores, so how
    # they split them is tuned with the workers and travels in the preset.
    worker_threads: int | None = None
    main_threads: int | None = None
    # Where JPEGs are decoded: cpu (the workers) or device (the training process, per batch,
    # on the GPU when there is one); photos, image_folder and webdataset only
    decode: Decode = Decode.cpu
    # num_workers and main_threads are each rank's under torchrun (a preset from
    # sweep.ranks_per_node > 1); false: the machine's, split between the ranks on it
    per_rank: bool = False
    # The collate function, by import path: PyTorch's default_collate, or your own
    # (loader.collate_fn._target_=pkg.collate; other keys bound by keyword) for batches of
    # any structure, such as boxes that vary in number
    collate_fn: Any = field(default_factory=lambda: {"_target_": DEFAULT_COLLATE})
    # loader=auto: the run picks the preset measured on this machine and workload
    auto: bool = False
    # loader=autotune: the run tunes the loader while it trains (trainer.autotune)
    autotune: bool = False
    # Written by the sweep with the preset: where it was tuned. A run elsewhere says so.
    measured_on: MeasuredOn | None = None


@dataclass
class PhotosConfig:
    """JPEG photos in ImageFolder layout, built once from scikit-image's bundled photographs."""

    _target_: str = "feedrate.dataset.build_photos"
    on_error: str = "raise"  # raise: name the failing sample; skip: drop and count it
    root: str = "~/.cache/feedrate/photos"
    n_images: int = 3000
    image_size: int = 224
    jpeg_quality: int = 90
    seed: int = 0


@dataclass
class WebDatasetConfig:
    """The photos as tar shards, streamed with ``webdataset`` (an ``IterableDataset``)."""

    _target_: str = "feedrate.stream.build_webdataset"
    on_error: str = "raise"  # raise: name the failing sample; skip: drop it inside the stream
    root: str = "~/.cache/feedrate/shards"
    photos_root: str = "~/.cache/feedrate/photos"
    n_images: int = 3000
    n_shards: int = 16
    image_size: int = 224
    shuffle_buffer: int = 256
    shard_latency_ms: float = 0.0
    sample_latency_ms: float = 0.0
    seed: int = 0


@dataclass
class SyntheticConfig:
    """In-memory images with a simulated per-sample I/O latency and CPU cost."""

    _target_: str = "feedrate.dataset.SyntheticDataset"
    on_error: str = "raise"  # raise: name the failing sample; skip: drop and count it
    n_samples: int = 10_000
    image_size: int = 224
    channels: int = 3
    num_classes: int = 10
    io_latency_ms: float = 0.0
    cpu_ms: float = 0.0
    dtype: str = "uint8"
    seed: int = 0
    # Storage that slows down mid-run: slowdown_ms more per sample, slowdown_after_s after the
    # dataset is built (null: never). What the drift guard is for.
    slowdown_after_s: float | None = None
    slowdown_ms: float = 0.0


@dataclass
class MemmapConfig:
    """uint8 images in one memory-mapped ``.npy`` file, built once from the photos."""

    _target_: str = "feedrate.dataset.build_memmap"
    on_error: str = "raise"  # raise: name the failing sample; skip: drop and count it
    path: str = "~/.cache/feedrate/memmap"
    photos_root: str = "~/.cache/feedrate/photos"
    n_images: int = 3000
    stored_size: int = 256
    image_size: int = 224
    seed: int = 0


@dataclass
class ImageFolderConfig:
    """Any directory in ImageFolder layout (``root/<class>/<image>``)."""

    _target_: str = "feedrate.dataset.build_image_folder"
    on_error: str = "raise"  # raise: name the failing sample; skip: drop and count it
    root: str = MISSING
    image_size: int = 224


@dataclass
class TinyCNNConfig:
    _target_: str = "feedrate.model.TinyCNN"
    _partial_: bool = True
    width: int = 16


@dataclass
class PooledLinearConfig:
    _target_: str = "feedrate.model.PooledLinear"
    _partial_: bool = True
    grid: int = 8


@dataclass
class TorchvisionModelConfig:
    """A torchvision classification model, randomly initialised (no weight download)."""

    _target_: str = MISSING
    _partial_: bool = True
    weights: str | None = None


@dataclass
class HardwareConfig:
    """How the device is driven. ``auto`` values are resolved from the detected hardware."""

    name: str = "auto"
    device: Device = Device.auto
    amp_dtype: AmpDtype = AmpDtype.auto
    channels_last: bool | None = None
    cudnn_benchmark: bool | None = None
    non_blocking: bool | None = None
    pin_memory: bool | None = None
    torch_threads: int | None = None
    expect_gpu: str | None = None
    # The memory guard stops a run whose processes (main + workers, PSS) pass this, before the
    # OOM killer does; null: 90% of the memory available to the run when it starts.
    memory_limit_gb: float | None = None


@dataclass
class AutotuneConfig:
    """``loader=autotune``: the run's loader is a tuning loader (:mod:`feedrate.autotune`,
    :class:`feedrate.tuning.TuningLoader`). Each setting it tries is a new DataLoader that
    goes on where the one before stopped in the epoch."""

    # The tuning, in seconds of the run; null: 60, at most a fifth of trainer.max_seconds, at
    # most 120; 0: no tuning. The run trains all along; the rest of it runs the setting chosen.
    budget_s: float | None = None
    # A setting whose loader delivers no batch for this many seconds has failed (a worker
    # stuck: a deadlock after fork, a read that hangs) and the next one goes on, in one
    # process (loader.timeout, when set, applies instead). null: a stuck setting waits, as a
    # plain DataLoader does.
    stall_s: float | None = 60.0
    max_workers: int | None = None  # the machine's; null: 8 per core, between 64 and 256
    from_preset: bool = True  # false: search even where a preset was measured here
    preset_name: str | None = None  # conf/loader/<name>.yaml; null: autotuned_<cores>core_<cpu|gpu>
    # The choice, or the start where it held beside settings that all ran (not a preset that holds)
    write_preset: bool = True
    overwrite: bool = False  # replace a preset feedrate did not write
    # When the drift guard sees the data wait rise: warn, or tune again at the next epoch start
    on_drift: OnDrift = OnDrift.warn
    max_retunes: int = 3  # on_drift=retune: at most this many times a run
    # What may run the workers (loader.engine): processes, threads, or both, measured; thread
    # is left out where the dataset cannot be read by threads (a stream, thread_safe = False)
    engines: list[Engine] = field(default_factory=lambda: [Engine.process, Engine.thread])
    # Turn the training process's intra-op threads too (the run's, or one), as the model of
    # the pipeline predicts: the step and the workers share the cores. null: where the model
    # trains on the CPU and loader.main_threads is not set.
    split_threads: bool | None = None


@dataclass
class TrainerConfig:
    max_steps: int | None = 200
    epochs: int | None = None
    warmup_steps: int = 20
    window_steps: int = 20
    max_seconds: float | None = None
    # What turns a batch into a loss (feedrate.steps): today's classification step, or your
    # own function by import path (trainer.step._target_=pkg.steps.my_step)
    step: Any = field(default_factory=lambda: {"_target_": DEFAULT_STEP})
    optimizer: Optimizer = Optimizer.sgd
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0
    # Share of the dataset held out (never trained on) for val_loss / val_accuracy; 0: none.
    val_fraction: float = 0.0
    checkpoint_dir: str = "checkpoints"  # inside the run's output dir
    save_checkpoint: bool = True
    checkpoint_every: int | None = 100  # steps; null: only at the end (and on Ctrl-C)
    resume: bool = False  # continue from <run dir>/<checkpoint_dir>/last.pt
    progress: bool = True
    measure: Measure = Measure.train
    # Warm up until the start-up backlog (num_workers x prefetch_factor batches) is consumed
    # and two windows of window_steps agree within 10%; false: exactly warmup_steps.
    steady_state: bool = True
    # The longest the warm-up may last from the first step, settled or not; null: no bound.
    # A sweep's trials bound it by their window, as the tuning loader's settings are.
    warmup_max_s: float | None = None
    # Memory (PSS of the process tree, the guard's input) is read every memory_sample_s outside
    # the measured window; inside it only when the machine's free memory says the tree grew.
    # null: read only before and after the window, and no memory guard.
    memory_sample_s: float | None = 2.0
    # Stop measuring once the running samples/s is below this (after 1 s and two windows): the
    # loader sweep sets it to half its best trial, so a clearly worse trial costs little.
    abandon_below: float | None = None
    # Stream samples without epoch ends (a sampler that reshuffles forever): the steady state
    # the sweep compares. samples/s is then the lower of consumed and produced.
    stream: bool = False
    # Each batch says what it cost its worker (its reads' and its collate's wall and CPU time,
    # its bytes: feedrate.costs), and metrics.json "costs" sums up the measured ones: what the
    # model of the pipeline predicts from. The loader sweep's trials turn it on.
    costs: bool = False
    # The drift guard: warn once when the data-wait share of the last drift_windows windows
    # is drift_rise or more above the run's first ones (or the preset's); null: off.
    drift_rise: float | None = 0.25
    drift_windows: int = 5
    autotune: AutotuneConfig = field(default_factory=AutotuneConfig)


@dataclass
class SweepConfig:
    """``sweep=loader``: what to search, how to decide, where the preset goes."""

    preset_name: str = MISSING  # conf/loader/<preset_name>.yaml; default from the fingerprint
    overwrite: bool = False  # replace a preset feedrate did not write
    study_dir: str = "outputs/sweeps"  # SQLite studies; the same command resumes its study
    # Where the study lives instead: a database URL (postgresql+psycopg://user@host/db, the
    # password from PGPASSWORD or ~/.pgpass) or journal:///shared/fs/<file>.log (Optuna's
    # journal file). null: a SQLite file under study_dir.
    storage: str | None = None
    # ... where several sweepers share it: a running trial whose sweeper has not said it is
    # alive for this long is asked again (its sweeper was killed, or its node lost)
    stale_after_s: float = 120.0
    max_workers: int | None = None  # null: from the fingerprint, far past the core count
    # Empty: the platform's default start method only (fork on Linux, spawn on macOS/Windows).
    start_methods: list[str] = field(default_factory=list)
    # What may run the workers (loader.engine): processes, threads, or both, measured; thread
    # is left out where the dataset cannot be read by threads (a stream, thread_safe = False)
    engines: list[Engine] = field(default_factory=lambda: [Engine.process, Engine.thread])
    tune_batch_size: bool = False  # off: batch size changes training, not just loading
    batch_sizes: list[int] = field(default_factory=lambda: [32, 64, 128, 256])
    finalists: int = 2  # best candidates re-measured against the baselines
    # ... after the best, only trials within this share of its search figure, and none that
    # differs from one already picked by a few workers alone (no final round tells them apart)
    finalist_within: float = 0.10
    # Alternating re-measurements of each finalist and baseline: at most final_rounds; after
    # 3, no more once every contestant is significantly slower than another or within
    # `equivalence` of the fastest (more rounds could not change the choice by more). The
    # fastest wins, or a cheaper contestant whose whole interval lies within `equivalence`
    # of it: one merely not shown slower is not taken.
    final_rounds: int = 5
    equivalence: float = 0.05
    final_seconds: float = 3.0  # measured window of each final run, after its warm-up
    # The sweep's time, seconds: past the third final round, none starts that would end after it
    # (a tie not settled by then goes to the fastest by the paired rounds). Where the third
    # would, a contestant 2 x equivalence behind in both rounds is measured no further.
    # null: no bound.
    budget_s: float | None = 120.0
    # Before searching, loader-only and compute-only are measured; the search stops when a
    # trial reaches (1 - stop_within) of the ceiling they make. false (the default): the
    # model's climb ends where it has nothing left to verify.
    measure_ceilings: bool = False
    # Where the winner's time goes: false (the default), from what its final runs' batches
    # cost (trainer.costs), no run more; true, by the differential method, its loader-only
    # and compute-only runs (two runs more; so too whenever measure_ceilings is true).
    measure_gap: bool = False
    stop_within: float = 0.03
    # A trial stops measuring once clearly worse: below this share of the best trial so far.
    abandon_below: float = 0.5
    # Once every seed above the best trial's worker count is clearly slower than it, worker
    # counts past the first of those seeds are not searched (each costs its start-up and
    # finds nothing: the rate falls there). false: search up to max_workers all the same.
    bound_by_seeds: bool = True
    # No trial twice as wide as a pool the model, from the fastest trial's costs, rates held
    # by the step, the cores or the GIL: its other half would only wait. false: run them.
    bound_by_model: bool = True
    # Search loader.worker_threads and loader.main_threads too; null: where the model trains
    # on the CPU the workers use (not on a GPU, where one thread a worker is the norm).
    search_threads: bool | None = None
    write_preset: bool = True
    # Peak memory (PSS of the training process and its workers) a trial may use, in GB;
    # null: the SLURM allocation or cgroup limit when one is set. Over it: infeasible.
    memory_budget_gb: float | None = None
    # Tune the job as it will run: each trial is torchrun with this many ranks on this node,
    # the search is per rank (loader.per_rank) and the objective is the ranks' sum. The finals
    # add Lightning's per-rank formula and a one-process preset divided between the ranks:
    # `divided`, or null for the one loader=auto picks for one process here (if any).
    ranks_per_node: int = 1
    divided: str | None = None


# Metrics train.py can return to a sweeper (`objective=`); all are in metrics.json.
METRIC_NAMES = (
    "samples_per_sec",
    "consumed_samples_per_sec",
    "produced_samples_per_sec",
    "epoch_restart_s",
    "cpu_util",
    "other_cpu_frac",
    "peak_shm_mb",
    "window_spread",
    "data_wait_frac",
    "first_batch_s",
    "step_time_p50_ms",
    "step_time_p90_ms",
    "final_loss",
    "train_accuracy",
    "val_loss",
    "val_accuracy",
    "peak_pss_mb",
)


@dataclass
class TrainConfig:
    dataset: Any = MISSING
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    model: Any = MISSING
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # Which metric train.py returns, so a Hydra sweeper can optimise it.
    objective: str = "samples_per_sec"
    sweep: SweepConfig | None = None


def trainer_spec(node: Any) -> TrainerConfig:
    """The composed ``trainer`` node as plain typed values (:class:`TrainerConfig`, its
    interpolations resolved), made once where the run is built: the loop, the meter and the
    tuning take these, not the config."""
    if isinstance(node, TrainerConfig):
        return node
    from omegaconf import OmegaConf

    spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainerConfig), node))
    assert isinstance(spec, TrainerConfig)
    return spec


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(group="dataset", name="photos_schema", node=PhotosConfig)
    cs.store(group="dataset", name="synthetic_schema", node=SyntheticConfig)
    cs.store(group="dataset", name="memmap_schema", node=MemmapConfig)
    cs.store(group="dataset", name="webdataset_schema", node=WebDatasetConfig)
    cs.store(group="dataset", name="image_folder_schema", node=ImageFolderConfig)
    cs.store(group="model", name="tiny_cnn_schema", node=TinyCNNConfig)
    cs.store(group="model", name="torchvision_schema", node=TorchvisionModelConfig)
    cs.store(group="model", name="pooled_linear_schema", node=PooledLinearConfig)


register_configs()
