"""The machine: a fingerprint of what it has, and the resolved settings for driving its device."""

from __future__ import annotations

import logging
import os
import platform
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch
from omegaconf import DictConfig

from feedrate.config import AmpDtype, Device
from feedrate.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Fingerprint:
    cpu_model: str
    physical_cores: int | None
    logical_cores: int
    usable_cores: float  # affinity mask and cgroup quota applied: what this process may use
    ram_gb: float
    shm_gb: float | None
    gpu_name: str | None
    gpu_count: int
    gpu_memory_gb: float | None
    data_disk_rotational: bool | None
    os: str
    python: str
    torch: str

    def short(self) -> str:
        gpu = f"{self.gpu_count}x {self.gpu_name}" if self.gpu_count else "no GPU"
        if self.gpu_count and self.gpu_memory_gb is not None:
            gpu += f" ({self.gpu_memory_gb:.0f} GB)"
        shm = f"{self.shm_gb:.1f}" if self.shm_gb is not None else "?"
        disk = {True: "HDD", False: "SSD", None: "disk ?"}[self.data_disk_rotational]
        return (
            f"{self.cpu_model} | {self.physical_cores} physical / {self.logical_cores} logical"
            f" cores ({self.usable_cores:g} usable) | RAM {self.ram_gb:.1f} GB"
            f" | /dev/shm {shm} GB | {gpu} | data on {disk}"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_PYTORCH_THREADS = torch.get_num_threads()  # PyTorch's choice for this process, at start


def pytorch_threads() -> int:
    """PyTorch's intra-op threads for this process as it started (``OMP_NUM_THREADS`` if set,
    else its count of the cores): not what a run, a trial or a candidate has set since."""
    return _PYTORCH_THREADS


def usable_cores() -> float:
    """Cores this process may actually use: the affinity mask, then any cgroup v2 CPU quota.

    Containers often report the host's core count through ``os.cpu_count()``; a loader tuned on
    that number oversubscribes the quota.
    """
    try:
        cores: float = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return cores


def available_memory() -> int:
    """Bytes this process could still allocate: RAM available, within any cgroup v2 limit."""
    available = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            # memory.current counts the page cache, which the kernel reclaims under pressure:
            # the inactive part is as good as free
            stat = dict(
                line.split()
                for line in Path("/sys/fs/cgroup/memory.stat").read_text().splitlines()
                if line.count(" ") == 1
            )
            used -= int(stat.get("inactive_file", 0))
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


def memory_allocation() -> tuple[float, str] | None:
    """(GB, where it comes from) of memory this job was allocated: SLURM's ``--mem`` or
    ``--mem-per-cpu``, else a cgroup v2 limit; None when nothing caps it below the machine."""
    per_node = os.environ.get("SLURM_MEM_PER_NODE")
    per_cpu = os.environ.get("SLURM_MEM_PER_CPU")
    cpus = os.environ.get("SLURM_CPUS_ON_NODE") or os.environ.get("SLURM_CPUS_PER_TASK")
    try:
        if per_node:
            return int(per_node) / 1024, "the SLURM allocation (SLURM_MEM_PER_NODE)"
        if per_cpu and cpus:
            gb = int(per_cpu) * int(cpus) / 1024
            return gb, "the SLURM allocation (SLURM_MEM_PER_CPU x SLURM_CPUS_ON_NODE)"
    except ValueError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return None
    if limit == "max" or int(limit) >= psutil.virtual_memory().total:
        return None
    return int(limit) / 2**30, "the cgroup memory limit (/sys/fs/cgroup/memory.max)"


def is_rotational(path: str | os.PathLike | None) -> bool | None:
    """Whether the block device holding ``path`` is a spinning disk (None when unknown)."""
    if path is None:
        return None
    p = Path(path).expanduser()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        dev = os.stat(p).st_dev
    except OSError:
        return None
    sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for candidate in (sys_dev / "queue/rotational", sys_dev / "../queue/rotational"):
        try:
            return candidate.resolve().read_text().strip() == "1"
        except OSError:
            continue
    return None  # overlay, tmpfs, network filesystems: no block device to ask


def shm_bytes() -> tuple[int, int] | None:
    """(total, used) bytes of /dev/shm, where worker batches travel to the main process."""
    try:
        usage = shutil.disk_usage("/dev/shm")
    except OSError:
        return None
    return usage.total, usage.used


def detect(data_path: str | os.PathLike | None = None) -> Fingerprint:
    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_name = torch.cuda.get_device_name(0) if gpu_count else None
    gpu_mem = torch.cuda.get_device_properties(0).total_memory / 1e9 if gpu_count else None
    shm = shm_bytes()
    return Fingerprint(
        cpu_model=_cpu_model(),
        physical_cores=psutil.cpu_count(logical=False),
        logical_cores=psutil.cpu_count(logical=True) or 1,
        usable_cores=usable_cores(),
        ram_gb=psutil.virtual_memory().total / 1e9,
        shm_gb=shm[0] / 1e9 if shm else None,
        gpu_name=gpu_name,
        gpu_count=gpu_count,
        gpu_memory_gb=gpu_mem,
        data_disk_rotational=is_rotational(data_path),
        os=f"{platform.system()} {platform.release()}",
        python=platform.python_version(),
        torch=torch.__version__,
    )


@dataclass
class Hardware:
    """The hardware profile with every ``auto``/``null`` resolved for this machine."""

    name: str
    device: torch.device
    amp_dtype: torch.dtype | None
    channels_last: bool
    cudnn_benchmark: bool
    non_blocking: bool
    pin_memory: bool
    torch_threads: int

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve(cfg: DictConfig, fingerprint: Fingerprint) -> Hardware:
    """Resolve ``cfg.hardware`` against the detected machine; refuse what it cannot do."""
    want = Device(cfg.device) if not isinstance(cfg.device, Device) else cfg.device
    has_cuda = fingerprint.gpu_count > 0
    if want is Device.cuda and not has_cuda:
        raise ConfigError(
            f"hardware.device=cuda (hardware={cfg.name}) but no CUDA device is visible"
            f" (torch {torch.__version__}, CUDA build: {torch.version.cuda is not None});"
            " use hardware=auto or hardware=cpu on this machine"
        )
    cuda = want is Device.cuda or (want is Device.auto and has_cuda)
    if (
        cfg.expect_gpu
        and cuda
        and cfg.expect_gpu.lower() not in (fingerprint.gpu_name or "").lower()
    ):
        log.warning(
            "hardware=%s expects a %s but found %s <cfg.hardware.expect_gpu>",
            cfg.name,
            cfg.expect_gpu,
            fingerprint.gpu_name,
        )

    amp = AmpDtype(cfg.amp_dtype) if not isinstance(cfg.amp_dtype, AmpDtype) else cfg.amp_dtype
    if amp is AmpDtype.auto:
        amp = AmpDtype.bf16 if cuda and torch.cuda.is_bf16_supported() else AmpDtype.none
    if amp is not AmpDtype.none and not cuda:
        log.info("amp_dtype=%s ignored on the CPU <cfg.hardware.amp_dtype>", amp.value)
        amp = AmpDtype.none
    dtype = {AmpDtype.none: None, AmpDtype.bf16: torch.bfloat16, AmpDtype.fp16: torch.float16}[amp]

    def pick(value: bool | None, on_cuda: bool) -> bool:
        return (cuda and on_cuda) if value is None else bool(value)

    threads = cfg.torch_threads or torch.get_num_threads()
    return Hardware(
        name=cfg.name,
        device=torch.device("cuda" if cuda else "cpu"),
        amp_dtype=dtype,
        channels_last=pick(cfg.channels_last, True),
        cudnn_benchmark=pick(cfg.cudnn_benchmark, True) and cuda,
        non_blocking=pick(cfg.non_blocking, True) and cuda,
        pin_memory=pick(cfg.pin_memory, True),
        torch_threads=threads,
    )
