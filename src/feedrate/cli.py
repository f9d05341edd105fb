"""``feedrate``: the command an installed feedrate puts on the PATH.

    feedrate train [overrides]     what python train.py [overrides] runs in the checkout
    feedrate sweep [overrides]     python train.py -m sweep=loader [overrides]
    feedrate doctor [overrides]    python -m feedrate.doctor [overrides]
    feedrate presets [overrides]   each loader preset: where and when it was measured, its
                                   figure, and whether it fits this machine and workload

Run it in a project directory: the project's own ``conf/`` comes before feedrate's packaged
configs (its presets and configs are found by name), a sweep writes its preset into it
(``conf/loader/<name>.yaml``), and its modules import as they would beside ``train.py``
(``dataset=custom dataset._target_=mydata.MyDataset``). Overrides without a command train:
``feedrate loader=recipe`` is ``feedrate train loader=recipe``.
"""

from __future__ import annotations

import os
import sys

COMMANDS = ("train", "sweep", "doctor", "presets")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(__doc__.split("\n\n", 1)[1].rstrip())
        return 0 if args else 2
    if args[0] == "--version":
        from importlib.metadata import version

        print(f"feedrate {version('feedrate')}")
        return 0
    if args[0] not in COMMANDS and not args[0].startswith("-") and "=" not in args[0]:
        print(
            f"feedrate: unknown command {args[0]!r}; one of {', '.join(COMMANDS)}, or overrides"
            " (key=value) to train",
            file=sys.stderr,
        )
        return 2
    command = args.pop(0) if args[0] in COMMANDS else "train"
    _project_on_path()
    if command == "doctor":
        from feedrate.doctor import main as doctor

        return doctor(args)
    if command == "presets":
        return presets(args)
    if command == "sweep":
        args = ["-m", "sweep=loader", *args]
    return _train(args)


def _project_on_path() -> None:
    """This directory is the project (its conf/ first: :mod:`feedrate.project`), and its
    modules import, here and in every process a run starts (its trial hosts, its ``spawn``
    workers), as ``python train.py`` imports those beside it."""
    from feedrate.project import CLI_VAR, PROJECT_VAR

    here = os.getcwd()
    os.environ[PROJECT_VAR], os.environ[CLI_VAR] = here, "1"
    if here not in sys.path:
        sys.path.insert(0, here)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *paths])


def _train(args: list[str]) -> int:
    import hydra

    import feedrate.launch
    from feedrate.config import TRUSTED_TARGETS
    from feedrate.launch import default_config_dir

    # Hydra reads the command line itself; what it runs again (a fresh trial, the preset's
    # check) is this program with those arguments, which train too
    sys.argv = [sys.argv[0], *args]

    def train(cfg):
        return feedrate.launch.main(cfg)

    train.__module__ = "train"  # Hydra names the job after it, as after train.py: train.log
    hydra.main(
        config_path=str(default_config_dir()),
        config_name="train",
        execution_whitelist=TRUSTED_TARGETS,
    )(train)()
    return 0


def presets(args: list[str]) -> int:
    """Print every loader preset this project sees, first the project's own."""
    from hydra.errors import HydraException

    from feedrate import hardware, provenance
    from feedrate.errors import FeedrateError
    from feedrate.launch import compose, loader_preset_dirs

    if any(a in ("-h", "--help") for a in args):
        print("feedrate presets [overrides]: each loader preset this project sees, and whether it")
        print("fits this machine and the workload the overrides compose (the default job's)")
        return 0
    try:
        cfg = compose(args)  # the workload a preset is compared with: the default job's
    except (FeedrateError, HydraException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    fingerprint = hardware.detect(cfg.dataset.get("root") or cfg.dataset.get("path"))
    resolved = hardware.resolve(cfg.hardware, fingerprint)
    here = provenance.Here.of(cfg, fingerprint, resolved, args)
    dirs = loader_preset_dirs()
    rows = provenance.catalogue(dirs, here, resolved.is_cuda)
    print(
        f"loader presets ({', '.join(str(d) for d in dirs)}); this machine: {fingerprint.short()}"
    )
    width = max([len(r["name"]) for r in rows] + [6])
    for row in rows:
        print(f"  {row['name']:<{width}}  {_described(row)}")
        print(f"  {'':<{width}}  {row['path']}")
    return 0


def _described(row: dict) -> str:
    from feedrate.provenance import describe_machine

    m = row["measured_on"]
    if not m:
        return row["here"]
    try:
        rate = m.get("samples_per_sec")
        figure = f"{rate:,.0f} samples/s" if rate else "no figure"
        tuned = describe_machine(m["machine"])
        return f"{figure}, {str(m.get('date', '?'))[:10]}, on {tuned}; {row['here']}"
    except (KeyError, TypeError, ValueError) as exc:  # a measured_on edited by hand
        return f"its measured_on cannot be read ({type(exc).__name__}: {exc})"


if __name__ == "__main__":
    sys.exit(main())
