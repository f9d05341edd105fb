"""What the bench scripts share: where a result comes from, and a figure of rounds. A bench
script describes its contestants and its tables; these are the parts every one of them
writes the same way."""

from __future__ import annotations

import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Any


def provenance(fingerprint: Any) -> dict:
    """The head of a results.json: when, the command as run, the commit and the machine."""
    from feedrate.environment import git_commit

    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": git_commit(),
        "machine": fingerprint.as_dict(),
    }


def figure(**kwargs: Any) -> tuple[Any, Any]:
    """A matplotlib figure and its axes, drawn off screen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(**kwargs)


def rounds_bar(ax: Any, x: float, values: list[float], width: float, color: str, label: str):
    """A bar at the median of ``values``, with each round as a dot on it."""
    ax.bar(x, statistics.median(values), width, color=color, label=label)
    ax.plot([x] * len(values), values, "k.", markersize=4)


def save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
