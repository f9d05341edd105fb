"""A process that dies with the one that started it (Linux): a sweep's trial, a warm trial
host, and each rank of a torchrun trial, so that a killed sweep leaves nothing running."""

from __future__ import annotations

import ctypes
import os
import signal

# Set for a torchrun trial's ranks: each dies with torchrun (launch.py), which dies with the sweep
DIE_WITH_PARENT = "FEEDRATE_DIE_WITH_PARENT"

try:  # loaded here, not in the forked child, where loading a library is not safe
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not Linux
    _LIBC = None


def die_with_parent(parent: int) -> None:
    """In the trial process (Linux): SIGKILL when the sweep that started it dies, so a killed
    sweep leaves no trial running. Its DataLoader workers then see their parent gone and exit.
    Without it (not Linux), the sweep's own cleanup still kills the trial on Ctrl-C."""
    if _LIBC is None:
        return
    _LIBC.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the sweep died before the line above: follow it now
        os._exit(137)


def asked_of_a_rank() -> bool:
    """This process is a rank of a sweep's torchrun trial, which must die with torchrun."""
    return bool(os.environ.get(DIE_WITH_PARENT))
