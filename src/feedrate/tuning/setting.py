"""One loader setting: what both tuners turn (docs/design.md, "The tuning loader")."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

log = logging.getLogger("feedrate.tuning")

PROCESS, THREAD = "process", "thread"  # loader.engine: worker processes, or threads


@dataclass(frozen=True)
class Setting:
    """One loader setting: the DataLoader's own arguments that the tuner turns, and whether
    its workers are processes or threads of the training process (``loader.engine``)."""

    num_workers: int
    prefetch_factor: int | None = None  # None: PyTorch's 2 (and none without workers)
    engine: str = PROCESS
    # the training process's intra-op threads (torch.set_num_threads), where the tuner turns
    # them: the step and the workers share the cores (None: the run's own, not turned)
    main_threads: int | None = None

    def __post_init__(self) -> None:
        """One way to say each setting: no prefetch without workers, 2 for PyTorch's default,
        and no thread workers without workers."""
        depth = None if not self.num_workers else (self.prefetch_factor or 2)
        object.__setattr__(self, "prefetch_factor", depth)
        if not self.num_workers:
            object.__setattr__(self, "engine", PROCESS)
        elif self.engine not in (PROCESS, THREAD):
            raise ValueError(f"engine={self.engine!r}: {PROCESS!r} or {THREAD!r}")

    @property
    def depth(self) -> int:
        return self.prefetch_factor or 2

    @property
    def threads(self) -> bool:
        return self.engine == THREAD

    def describe(self) -> str:
        threads = f", main_threads={self.main_threads}" if self.main_threads else ""
        if not self.num_workers:
            return f"num_workers=0{threads}"
        on = ", engine=thread" if self.threads else ""
        return f"num_workers={self.num_workers}, prefetch_factor={self.depth}{on}{threads}"

    def as_dict(self) -> dict:
        out = {
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor,
            "engine": self.engine,
        }
        if self.main_threads:
            out["main_threads"] = self.main_threads
        return out


def same_pool(a: Setting, b: Setting) -> bool:
    """One loader serves both: they differ in the step's threads alone, which the training
    process sets (``torch.set_num_threads``) while the workers go on."""
    return replace(a, main_threads=b.main_threads) == b


def on_searched(setting: Setting, searched: tuple[str, ...], whose: str) -> Setting:
    """``setting``, on the first engine searched where its own is left out here (threads, for
    data they cannot read, or not asked for), said."""
    if not setting.num_workers or setting.engine in searched:
        return setting
    log.warning(
        "autotune_loader: %s %s runs on an engine left out of the search here (engines: %s):"
        " it runs on %s instead",
        whose,
        setting.describe(),
        ", ".join(searched),
        searched[0],
    )
    return replace(setting, engine=searched[0])
