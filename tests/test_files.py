"""Writes never leave a half-written file: killed or out of space mid-write, the old one stays."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap

import pytest
import torch

from feedrate.files import atomic_write, save_checkpoint

from .conftest import ROOT, unshare_works

# A child that writes a preset (text) or a checkpoint (torch.save) over an existing file, and
# stalls half-way: the moment the OOM killer or a power cut would pick.
WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from feedrate.files import atomic_write

    kind, path = sys.argv[1], sys.argv[2]

    class Stalls:
        def __init__(self, fh):
            self.fh = fh
        def write(self, data):
            self.fh.write(data[: len(data) // 2])
            self.fh.flush()
            print("half written", flush=True)
            time.sleep(60)

    if kind == "checkpoint":
        atomic_write(path, lambda fh: torch.save({"step": 2, "w": torch.ones(1000)}, Stalls(fh)))
    else:
        atomic_write(path, lambda fh: Stalls(fh).write(b"num_workers: 99\\n" * 100))
    """
)


@pytest.mark.parametrize("kind", ["checkpoint", "preset"])
def test_killed_mid_write_leaves_the_old_file(tmp_path, kind):
    target = tmp_path / ("last.pt" if kind == "checkpoint" else "tuned.yaml")
    if kind == "checkpoint":
        save_checkpoint(target, {"step": 1})
    else:
        target.write_text("num_workers: 4\n")
    before = target.read_bytes()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, kind, str(target)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline().strip() == "half written"
    writer.kill()
    writer.wait()
    assert target.read_bytes() == before
    if kind == "checkpoint":
        assert torch.load(target, weights_only=True) == {"step": 1}
    # what a killed writer leaves is a hidden temporary beside it, never the file itself
    others = [p.name for p in tmp_path.iterdir() if p != target]
    assert all(name.startswith(f".{target.name}.") for name in others), others


def test_an_error_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "last.pt"
    save_checkpoint(target, {"step": 1})

    def fails(fh):
        fh.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(target, fails)
    assert torch.load(target, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


@pytest.mark.skipif(not unshare_works(), reason="needs root to mount a small filesystem")
def test_a_full_disk_leaves_the_old_checkpoint():
    # A real ENOSPC: a 1 MB filesystem holding a small checkpoint, then a 4 MB one.
    script = textwrap.dedent(
        """
        import os, torch
        from feedrate.files import save_checkpoint
        path = "/mnt/ckpt/last.pt"
        save_checkpoint(path, {"step": 1})
        try:
            save_checkpoint(path, {"step": 2, "w": torch.ones(1_000_000)})
        except (OSError, RuntimeError) as exc:
            print("refused:", exc)
        print("step", torch.load(path, weights_only=True)["step"])
        print("files", sorted(os.listdir("/mnt/ckpt")))
        """
    )
    proc = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f"mkdir -p /mnt/ckpt && mount -t tmpfs -o size=1m tmpfs /mnt/ckpt &&"
            f" {sys.executable} -c '{script}'",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout and "step 1" in proc.stdout, proc.stdout
    assert "files ['last.pt']" in proc.stdout
