"""``python -m feedrate``: the ``feedrate`` command (``torchrun -m feedrate train ...`` too)."""

import sys

from feedrate.cli import main

sys.exit(main())
