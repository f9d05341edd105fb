"""Where the configs come from, and where a preset goes.

feedrate's own configs ship in the package (``feedrate/conf``; in the checkout, a link to its
``conf/``). ``feedrate train`` composes from them. Run in a project directory, that project's
``conf/`` comes first on Hydra's search path (the ``ProjectConfig`` search-path plugin): its own
presets and configs are found by name, one of its own with a packaged name wins, and a sweep or
``loader=autotune`` writes its preset there (``conf/loader/``), never into the installed package.
``python train.py`` in the checkout composes from the checkout's ``conf/``, as it always has.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from omegaconf import DictConfig

from feedrate.errors import ConfigError

PROVIDER = "feedrate-project"  # the project's conf/ on Hydra's search path
# The project directory, set by the ``feedrate`` command (its working directory) and by
# ``feedrate.compose()`` outside a checkout; every process a run starts inherits it.
PROJECT_VAR = "FEEDRATE_PROJECT"
CLI_VAR = "FEEDRATE_CLI"  # set by the ``feedrate`` command: the commands printed say it
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a preset's name: a file in conf/loader/


def project_dir() -> Path | None:
    """The project whose ``conf/`` comes first, or None (``python train.py`` in a checkout,
    or a config directory of the user's own choosing)."""
    found = os.environ.get(PROJECT_VAR)
    return Path(found) if found else None


def packaged_config_dir() -> Path:
    """feedrate's own ``conf/``, as installed (the checkout's, through the link)."""
    return (Path(__file__).parent / "conf").resolve()


def is_packaged(path: str | Path) -> bool:
    return Path(str(path).removeprefix("file://")).resolve() == packaged_config_dir()


def _sources(hydra: DictConfig) -> list:
    return list(hydra.runtime.config_sources)


def primary_config_dir(hydra: DictConfig) -> Path | None:
    """The conf/ a Hydra app composed from (``hydra`` is the run's ``hydra`` node)."""
    for source in _sources(hydra):
        if source.provider == "main" and source.schema == "file":
            return Path(source.path)
    return None


def project_config_dir(hydra: DictConfig) -> Path | None:
    """The project's conf/ that came before the packaged configs, or None (the checkout's
    ``python train.py``, or a config dir of the user's own choosing)."""
    for source in _sources(hydra):
        if source.provider == PROVIDER:
            return Path(source.path)
    return None


def preset_config_dir(hydra: DictConfig | None, fallback: Path | None = None) -> Path | None:
    """The conf/ a preset is written into: the project's, else the one the app composed from;
    ``fallback`` outside a Hydra app."""
    if hydra is None:
        return fallback
    return project_config_dir(hydra) or primary_config_dir(hydra)


def preset_file(conf_dir: Path | None, name: str, keys: str) -> Path:
    """Where the preset ``name`` is written: ``conf_dir/loader/<name>.yaml`` (``conf_dir``
    from :func:`preset_config_dir`), refusing names that would leave that folder (said as
    ``<keys>.preset_name``). The sweep, ``loader=autotune`` and the doctor all ask here."""
    if not NAME.match(name) or name.endswith(".yaml"):
        raise ConfigError(
            f"{keys}.preset_name={name!r} is not a valid preset name; use letters, digits, '_',"
            f" '-' and '.', e.g. {keys}.preset_name=tuned_8core_nvme"
        )
    if conf_dir is None:
        raise ConfigError(
            f"cannot find the config directory to write loader={name} into: run from a project"
            " with a conf/ folder, or through train.py"
        )
    return Path(conf_dir) / "loader" / f"{name}.yaml"


def loader_dirs(hydra: DictConfig | None, fallback: Path, first: Path | None = None) -> list[Path]:
    """Where loader presets are read from, first wins, each once: ``first`` (a project's
    ``conf/loader/`` named outside a Hydra app), the project's ``conf/loader/``, then the
    primary conf's (``fallback``'s outside a Hydra app)."""
    dirs = []
    if hydra is not None:
        dirs = [d for d in (project_config_dir(hydra), primary_config_dir(hydra)) if d]
    found = [d / "loader" for d in dirs or [fallback]]
    unique: list[Path] = []
    for d in [first, *found] if first is not None else found:
        if d.resolve() not in [u.resolve() for u in unique]:
            unique.append(d)
    return unique


def command(sweep: bool = False) -> str:
    """How to run this program again, for the commands feedrate prints (a preset's header,
    a resume hint): ``feedrate train`` / ``feedrate sweep`` under the installed command, else
    ``python train.py`` / ``python train.py -m sweep=loader``."""
    installed = bool(os.environ.get(CLI_VAR)) or Path(sys.argv[0]).name == "feedrate"
    if sweep:
        return "feedrate sweep" if installed else "python train.py -m sweep=loader"
    return "feedrate train" if installed else "python train.py"
