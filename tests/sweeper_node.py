"""One node of a shared-study sweep, its trials simulated (tests/fakes.py), as its own process:

    python -m tests.sweeper_node PROJECT SECONDS_A_TRIAL OVERRIDES...

tests/test_sweep.py starts two at once on one study, as two identical machines would, and
kills one mid-trial. Prints the sweep's output; exits with the sweep's status."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import fakes


class _Uncaptured:
    """What fakes.sweep reads of pytest's capsys: here the output goes straight out."""

    def readouterr(self):
        class Nothing:
            out = err = ""

        return Nothing()


def main() -> int:
    project, seconds, overrides = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
    patch = pytest.MonkeyPatch()
    try:
        swept = fakes.sweep(
            project,
            *overrides,
            runner=fakes.Simulated(seconds=seconds),
            monkeypatch=patch,
            capsys=_Uncaptured(),
        )
    finally:
        patch.undo()
    return swept.returncode


if __name__ == "__main__":
    sys.exit(main())
