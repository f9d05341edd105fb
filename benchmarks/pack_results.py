"""Keep a result folder small: what a reader opens stays as files, the raw runs go into one
compressed archive beside them.

    python benchmarks/pack_results.py benchmarks/results/<folder> [...]   # or --all

A folder keeps, as files: ``README.md``, ``command.txt``, ``results.json`` (``bench.json``,
``summary.json``, a run's printed ``summary.txt``), its tables (``table.md``, ``tables.md``),
its plots (``*.png``), the presets it measured (``*.yaml``) and the scripts that made it
(``*.py``, ``*.sh``). Everything else (the Hydra run folders, logs, study databases,
``runs.jsonl``) goes into ``raw.tar.gz``; an archive already there is opened and written again
with the new members added, so there is always one. Nothing is lost: the archive is written to
a temporary file and checked (every member listed) before the files it holds are removed.
``tar -xzf raw.tar.gz`` in the folder puts them back where they were.
``tests/test_results.py`` caps what a folder may keep.
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ARCHIVE = "raw.tar.gz"
# What a reader opens: the files a folder keeps as they are (top level only)
KEEP = (
    "README.md",
    "command.txt",
    "results.json",
    "bench.json",
    "summary.json",
    "summary.txt",  # a run's printed summary, as the README shows it
    "table.md",
    "tables.md",
    "*.png",
    "*.yaml",
    "*.py",
    "*.sh",
    ARCHIVE,
)
MAX_FILES = 16  # files one result folder may keep (tests/test_results.py)


def kept(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in KEEP)


def to_pack(folder: Path) -> list[Path]:
    """What goes into the archive: every entry of ``folder`` it does not keep as a file."""
    return sorted(p for p in folder.iterdir() if p.is_dir() or not kept(p.name))


def pack(folder: Path) -> int:
    """Move what :func:`to_pack` names into ``folder/raw.tar.gz``; the count of entries moved.
    Refuses (nothing moved) a symlink among them, and an entry whose name the archive holds
    already: a second member of one name would hide the first from ``tar -x``."""
    entries = to_pack(folder)
    if not entries:
        return 0
    links = [
        p for e in entries for p in [e, *(e.rglob("*") if e.is_dir() else [])] if p.is_symlink()
    ]
    if links:
        raise ValueError(f"{folder}: symlinks {[str(p) for p in links]}: pack their targets")
    archive = folder / ARCHIVE
    held: set[str] = set()
    if archive.exists():
        with tarfile.open(archive, "r:gz") as old:
            held = set(old.getnames())
    clash = [
        e.name for e in entries if e.name in held or any(n.startswith(f"{e.name}/") for n in held)
    ]
    if clash:
        raise ValueError(f"{archive} holds {clash} already: rename them, or unpack it first")
    fd, tmp = tempfile.mkstemp(prefix=".raw-", suffix=".tar.gz", dir=folder)
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz", compresslevel=9) as out:
            if archive.exists():  # one archive: the old members first, as they were
                with tarfile.open(archive, "r:gz") as old:
                    for member in old.getmembers():
                        data = old.extractfile(member) if member.isfile() else None
                        out.addfile(member, data)
            for entry in entries:
                out.add(entry, arcname=entry.name)
        with tarfile.open(tmp, "r:gz") as check:  # readable to its end before anything goes
            names = set(check.getnames())
        missing = [e.name for e in entries if e.name not in names] + sorted(held - names)
        if missing:
            raise RuntimeError(f"{tmp} lacks {missing}: nothing removed")
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for entry in entries:
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return len(entries)


def tracked_folders() -> list[Path]:
    """The result folders the tree holds: not one a bench is writing now (untracked)."""
    import subprocess

    listed = subprocess.run(
        ["git", "ls-files", str(RESULTS)], cwd=RESULTS, capture_output=True, text=True
    ).stdout.split()
    return sorted({RESULTS / Path(p).parts[2] for p in listed if len(Path(p).parts) > 3})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path)
    parser.add_argument(
        "--all", action="store_true", help="every folder under results/ that git tracks"
    )
    args = parser.parse_args(argv)
    folders = tracked_folders() if args.all else args.folders
    if not folders:
        parser.error("name a result folder, or --all")
    for folder in folders:
        if not folder.is_dir():
            parser.error(f"{folder} is not a folder")
        moved = pack(folder)
        files = sum(1 for p in folder.iterdir())
        note = f"{moved} entries into {ARCHIVE}" if moved else "nothing to pack"
        print(f"{folder.name}: {note}; {files} files kept", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
