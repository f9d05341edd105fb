"""Errors a user can act on: each says what was wrong, with which input, and what to do."""


class FeedrateError(Exception):
    """Base class: caught at the command line and printed as one message, no traceback."""

    exit_code = 2


class ConfigError(FeedrateError):
    """A config value that cannot work, found before any data is built or worker started."""


class DatasetError(FeedrateError):
    """A dataset that cannot be built or used as configured."""


class Interrupted(FeedrateError):
    """The user pressed Ctrl-C: the run stopped cleanly at a step boundary."""

    exit_code = 130


class SampleError(FeedrateError):
    """A sample that could not be loaded. One string argument, so PyTorch can re-raise it
    from a worker process in the main one."""


class CollateError(FeedrateError):
    """The collate function named in ``loader.collate_fn`` failed on a batch. One string
    argument, as :class:`SampleError`, to cross from a worker."""


# What PyTorch raises in a forked worker that touches CUDA the parent had initialised: not a
# bad sample (every one would fail), but the start method (faults.diagnose names it)
CUDA_AFTER_FORK = "Cannot re-initialize CUDA in forked subprocess"
