"""The tuning loader inside Lightning and the Hugging Face Trainer: every sample trained once
an epoch, across a resume, on 1 and 2 processes; and the examples, run as a user runs them."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.tuning_fakes import Indices, tuning_loader

ROOT = Path(__file__).resolve().parents[1]
SAMPLES, EPOCHS = 240, 3

# Looked up, not imported: Lightning and transformers take seconds to import, and only the
# tests that run them in this process do (the rest start processes of their own)
pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(name) for name in ("lightning", "transformers")),
    reason="the integrations extra: pip install -e '.[integrations]'",
)


def per_epoch(parts: dict[str, dict]) -> list[list[int]]:
    """Every process's samples of each epoch, the first run's and the resumed run's."""
    return [
        [i for part in parts.values() for i in part["seen"].get(str(e), [])] for e in range(EPOCHS)
    ]


def lightning_runs(out: Path, devices: int, stop_at: int, in_process: bool) -> dict[str, dict]:
    """The counting script, stopped mid-epoch with a checkpoint, then resumed from it."""
    runs = [["--stop-at", str(stop_at)], ["--resume"]]
    for extra in runs:
        argv = [str(out), "--devices", str(devices), "--epochs", str(EPOCHS), *extra]
        if in_process:
            from tests.lightning_counting import main

            main(argv)
        else:
            proc = subprocess.run(
                [sys.executable, "tests/lightning_counting.py", *argv],
                cwd=ROOT, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
    return {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*_rank*.json"))}


@pytest.mark.parametrize("stop_at", [37, 60])  # mid-epoch, and after an epoch's last batch
def test_lightning_trains_every_sample_once_an_epoch_across_a_resume(tmp_path, stop_at):
    parts = lightning_runs(tmp_path, devices=1, stop_at=stop_at, in_process=True)
    assert set(parts) == {"first_rank0", "resumed_rank0"}
    for epoch in per_epoch(parts):
        assert sorted(epoch) == list(range(SAMPLES))
    first, resumed = parts["first_rank0"]["report"], parts["resumed_rank0"]["report"]
    assert len(resumed["tried"]) >= 2  # it switched settings inside Lightning's loop
    assert resumed["tried"][: len(first["tried"])] == first["tried"]  # the tuning went on


@pytest.mark.slow
def test_lightning_on_two_processes_trains_every_sample_once_across_a_resume(tmp_path):
    parts = lightning_runs(tmp_path, devices=2, stop_at=19, in_process=False)
    assert len(parts) == 4  # two ranks, two runs
    for epoch in per_epoch(parts):
        assert sorted(epoch) == list(range(SAMPLES))
    for run in ("first", "resumed"):  # every rank holds rank 0's figures and choice
        rank0, rank1 = (parts[f"{run}_rank{r}"]["report"] for r in (0, 1))
        assert rank0["tried"] == rank1["tried"] and rank0["chosen"] == rank1["chosen"]
    assert len(parts["resumed_rank0"]["report"]["tried"]) >= 2


class Keyed(torch.utils.data.Dataset):
    """Indices as the Trainer's batches are: dicts of the model's arguments."""

    def __init__(self, n: int) -> None:
        self.inner = Indices(n)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        return {"index": self.inner[i]}


class Recorder(nn.Module):
    """A model that returns its own loss, and keeps which samples it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.seen: list[int] = []

    def forward(self, index: torch.Tensor) -> dict:
        self.seen += index.tolist()
        return {"loss": (self.w * index.float()).pow(2).mean()}


def test_the_hf_trainer_trains_every_sample_once_an_epoch_across_a_resume(tmp_path):
    from transformers import TrainingArguments

    sys.path.insert(0, str(ROOT))
    from examples.hf_trainer import TunedTrainer

    class Fast(TunedTrainer):  # the example's Trainer, on the tests' clock
        def get_train_dataloader(self):
            return self.resumed(
                tuning_loader(
                    self.train_dataset, collate_fn=self.data_collator, seed=self.args.seed
                )
            )

    def train(max_steps: int, resume: str | None = None) -> tuple[list[int], Fast]:
        model = Recorder()
        args = TrainingArguments(
            output_dir=str(tmp_path), per_device_train_batch_size=4, num_train_epochs=EPOCHS,
            max_steps=max_steps, save_strategy="steps", save_steps=37, report_to=[],
            disable_tqdm=True, logging_strategy="no", learning_rate=1e-6, use_cpu=True,
        )  # fmt: skip
        trainer = Fast(model=model, args=args, train_dataset=Keyed(SAMPLES))
        trainer.train(resume_from_checkpoint=resume)
        return model.seen, trainer

    first, before = train(37)  # a checkpoint after 37 steps, mid-epoch, and the run ends
    saved = json.loads((tmp_path / "checkpoint-37" / "autotune_loader.json").read_text())
    second, trainer = train(-1, resume=str(tmp_path / "checkpoint-37"))
    # the tuning went on from the checkpoint's: what it had measured, and its seconds
    assert saved["figures"] and saved["batches"] == 37 % (SAMPLES // 4)
    assert trainer.tuned.report()["tried"][: len(saved["figures"])] == saved["figures"]
    assert trainer.tuned.report()["seconds"] >= saved["spent_s"]
    assert len(first) == 37 * 4
    seen = first + second
    epochs = [seen[e * SAMPLES : (e + 1) * SAMPLES] for e in range(EPOCHS)]
    assert len(seen) == EPOCHS * SAMPLES
    assert all(sorted(e) == list(range(SAMPLES)) for e in epochs)
    assert epochs[0] != epochs[1]  # each epoch its own shuffle, as the Trainer sets it


# -- the examples, as a user runs them -----------------------------------------------------------


def run_example(*args: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, *args, "--seconds", "8", "--budget-s", "7", "--length", "3000",
         "--median-ms", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.slow
@pytest.mark.alone
def test_the_lightning_example_tunes_on_two_processes():
    out, log = run_example("examples/lightning_module.py", "--devices", "2")
    assert out["samples"] > 0 and out["autotune"]["chosen"] is not None
    assert len(out["autotune"]["tried"]) >= 2 and "autotune_loader chose" in log


@pytest.mark.slow
@pytest.mark.alone
def test_the_hf_trainer_example_tunes():
    out, log = run_example("examples/hf_trainer.py")
    assert out["samples"] > 0 and "autotune_loader chose" in log
