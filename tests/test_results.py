"""benchmarks/results stays small and readable: each folder keeps what a reader opens (README,
command, results.json, tables, plots) and one archive of its raw runs; every link into it from
the README and docs/ resolves."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import pack_results  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FILES_A_FOLDER = 7  # on average, all folders together
MAX_BYTES = 60 * 2**20  # what benchmarks/results adds to a clone


def _tracked() -> list[str]:
    """The files under benchmarks/results as a clone has them (git's list: a bench writing a
    folder right now is not yet part of the tree), else as the disk has them."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "benchmarks/results"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(ROOT)) for p in RESULTS.rglob("*") if p.is_file()]
    return out.split()


def test_each_result_folder_keeps_what_a_reader_opens_and_one_archive():
    by_folder: dict[str, list[str]] = {}
    for path in _tracked():
        parts = path.split("/")
        assert len(parts) == 4, f"{path}: a subfolder; python benchmarks/pack_results.py it"
        by_folder.setdefault(parts[2], []).append(parts[3])
    assert by_folder, "no result folder found"
    for folder, names in by_folder.items():
        loose = [n for n in names if not pack_results.kept(n)]
        assert not loose, f"{folder}: {loose} belong in its raw.tar.gz (pack_results.py)"
        assert len(names) <= pack_results.MAX_FILES, f"{folder}: {len(names)} files"


def test_the_results_tree_stays_small_as_benches_add_folders():
    """Every run counts, so the tree grows by a folder a bench: what stays bounded is what a
    folder keeps on average (its README, command, figures, table, plot and one archive) and
    the bytes a clone carries."""
    tracked = _tracked()
    folders = {path.split("/")[2] for path in tracked}
    assert len(tracked) <= FILES_A_FOLDER * len(folders), (len(tracked), len(folders))
    size = sum((ROOT / path).stat().st_size for path in tracked if (ROOT / path).exists())
    assert size < MAX_BYTES, f"{size / 2**20:.1f} MB under benchmarks/results"


def test_every_link_into_the_results_resolves():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    links = [
        (doc.name, m.group(1))
        for doc in docs
        for m in re.finditer(r"(benchmarks/results/[\w.\-/]+[\w/])", doc.read_text())
    ]
    assert links
    broken = [(doc, link) for doc, link in links if not (ROOT / link).exists()]
    assert not broken, broken


def test_packing_moves_the_raw_runs_into_one_archive_and_loses_nothing(tmp_path):
    import tarfile

    folder = tmp_path / "2026-01-01_cpu-2core-x"
    (folder / "run0" / ".hydra").mkdir(parents=True)
    (folder / "run0" / ".hydra" / "config.yaml").write_text("a: 1\n")
    (folder / "run0" / "metrics.json").write_text("{}")
    (folder / "bench.log").write_text("log\n")
    for kept in ("README.md", "command.txt", "results.json", "table.md", "plot.png"):
        (folder / kept).write_text(kept)
    assert pack_results.pack(folder) == 2
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["README.md", "command.txt", "results.json", "table.md", "plot.png", "raw.tar.gz"]
    )
    (folder / "later.log").write_text("more\n")  # packed again: still one archive, both in
    assert pack_results.pack(folder) == 1
    with tarfile.open(folder / "raw.tar.gz") as archive:
        names = set(archive.getnames())
        assert {"run0/.hydra/config.yaml", "run0/metrics.json", "bench.log", "later.log"} <= names
        assert archive.extractfile("run0/.hydra/config.yaml").read() == b"a: 1\n"
    assert pack_results.pack(folder) == 0


def test_an_archive_that_cannot_be_read_leaves_every_file(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "raw.tar.gz").write_bytes(b"not a tar file")
    (folder / "bench.log").write_text("log\n")
    with pytest.raises(Exception):  # noqa: B017 - tarfile's own error, whichever it is
        pack_results.pack(folder)
    assert (folder / "bench.log").read_text() == "log\n"
    assert (folder / "raw.tar.gz").read_bytes() == b"not a tar file"
    assert sorted(p.name for p in folder.iterdir()) == ["bench.log", "raw.tar.gz"]


def test_no_table_in_the_results_says_pass():
    """Every table.md and tables.md under the one rule: met, missed or not shown, never a
    PASS that may have read a point ratio."""
    tables = [*RESULTS.glob("*/table.md"), *RESULTS.glob("*/tables.md")]
    assert tables
    said = [t.parent.name for t in tables if re.search(r"\bPASS\b", t.read_text())]
    assert not said, said


def test_an_old_table_row_is_judged_again_by_the_interval():
    import rejudge_tables

    text = (
        "| synthetic | tuned/best_grid | 1.00x [0.77, 1.19] tie within noise | >= 0.9 PASS |\n"
        "| synthetic_loader | tuned/recipe | 6.52x [5.81, 7.03] win | >= 5.0 PASS |\n"
        "| gpu | tuned/recipe | 1.41x [1.41, 1.41] no claim (1 runs, 5 needed) | >= 1.3 PASS |\n"
        "| photos | tuned/recipe | 0.90x [0.85, 0.95] loss | not significantly worse PASS |\n"
        "| x | tuned/ceiling | 0.55x [0.50, 0.60] loss | >= 0.9 MISS |\n"
    )
    out, n = rejudge_tables.rejudge(text)
    assert n == 5
    assert [line.rsplit("|", 2)[-2].strip() for line in out.splitlines()] == [
        ">= 0.9 not shown",
        ">= 5.0 met",
        ">= 1.3 not shown",
        "not significantly worse missed",
        ">= 0.9 missed",
    ]


def test_the_generated_tables_match_the_results_they_cite():
    """Every table in the README and docs/benchmarks.md between ``<!-- generated -->`` marks
    is what benchmarks/doc_tables.py writes from the results.json it cites, stale marks
    included (the code it measured changed after the result's commit)."""
    import doc_tables

    assert doc_tables.main([]) == 0, "python benchmarks/doc_tables.py --write"


def test_a_table_typed_over_or_gone_stale_is_caught(tmp_path, monkeypatch):
    import doc_tables

    doc = tmp_path / "README.md"
    monkeypatch.setattr(doc_tables, "DOCS", [doc])
    doc.write_text(
        "x\n<!-- generated: readme-results -->\n| typed | by hand |\n<!-- /generated -->\n"
    )
    assert doc_tables.main([]) == 1
    assert doc_tables.main(["--write"]) == 0 and doc_tables.main([]) == 0
    assert "| typed | by hand |" not in doc.read_text()
    assert "2026-11-30_cpu-2core-d" in doc.read_text()
    # the result's commit against a HEAD whose src/ differs from it: stale, and said
    assert "stale since" in doc_tables.staleness(doc_tables.provenance("2026-11-30_cpu-2core-d")[0])
    assert doc_tables.staleness("0" * 40).startswith("; its commit 0000000 is not in this clone")


def test_a_result_is_stale_only_where_a_file_its_figures_depend_on_changed():
    """A bench names what its figures depend on (DEPENDS_ON); its workloads add their own
    files. A change elsewhere (the doctor, the docs) leaves its figures standing; the mark
    names the file that changed."""
    import doc_tables

    folder = "2026-12-07_cpu-2core-epyc-autotune-sensors-180s-b"  # autotune_bench, 162dd440
    paths = doc_tables.depends_on(folder)
    assert {"src/feedrate/tuning", "src/feedrate/loader.py", "examples/sensor_store.py"} <= set(
        paths
    )
    assert not any(doc_tables._under("src/feedrate/doctor.py", p) for p in paths)
    commit = doc_tables.provenance(folder)[0]
    # 79a3a1d9 changed the tuning loader after it was measured: stale, and the file named
    stale = doc_tables.staleness(commit, paths)
    assert stale.startswith(f"; **stale since {commit[:7]}**: src/feedrate/") and "changed" in stale
    assert "src/feedrate/tuning/loader.py" in doc_tables.staleness(
        commit, ("src/feedrate/tuning/loader.py",)
    )
    assert doc_tables.staleness(commit, ("LICENSE",)) == "", "a file that did not change"
    # a folder whose command names no bench (measured before benches named their paths):
    # all the code
    assert doc_tables.depends_on("2026-11-30_cpu-2core-d") == doc_tables.MEASURED


def test_the_suites_time_is_stale_once_the_code_the_tests_or_their_set_up_changed():
    """The CI job's time (benchmarks/suite_time.py) depends on everything make test runs: a
    run is marked stale, naming the file, once any of it changed after the run's commit."""
    import doc_tables
    import suite_time
    from depends import SUITE

    last = "===== 1 failed, 529 passed, 3 skipped, 2 warnings in 606.28s (0:10:06) ====="
    assert suite_time.pytest_summary(["collected", last, ""]) == {
        "tests_s": 606.28,
        "passed": 529,
        "failed": 1,
        "skipped": 3,
    }
    assert suite_time.pytest_summary(["make: *** [Makefile:29: test] Error 2"])["tests_s"] is None
    assert {"tests", "src", "Makefile", "pyproject.toml", ".ci"} <= set(SUITE)
    folder, machine, run = doc_tables._clean_clones()[0]  # 2026-12-05, at af9d82e
    assert machine == "2-core AMD EPYC VM" and folder in doc_tables.suites()
    stale = doc_tables.staleness(run["code"], SUITE)
    assert stale.startswith(f"; **stale since {run['code'][:7]}**: ") and "changed" in stale
    assert doc_tables.staleness(run["code"], ("LICENSE",)) == ""
    assert "stale since" in doc_tables.suite_summary(ROOT / "README.md")


def readme_problems(folder) -> list[str]:
    """What a folder's README leaves out or gets wrong of what its data say: the command, the
    machine (its CPU, as the data record it), the commit (each, of a pooled bench; or that
    none was recorded) and the date (the folder's)."""
    import doc_tables

    text = (folder / "README.md").read_text()
    commit, machine = doc_tables.provenance(folder.name)
    problems = []
    if not re.search(r"command|python |run\.sh|bash ", text, re.I):
        problems.append("no command")
    if commit == "?":
        if "not recorded" not in text and not doc_tables.HASH.search(text):
            problems.append("no commit, and does not say none was recorded")
    else:
        problems += [
            f"commit {sha[:8]} not named"
            for sha in (c.removesuffix("+dirty") for c in commit.split(", "))
            if sha[:7] not in text
        ]
    cpu = machine.split(",")[0].strip()
    if cpu != "not recorded" and cpu.lower() not in text.lower():
        problems.append(f"the machine its data record, {cpu!r}, not named")
    if folder.name[:10] not in text:
        problems.append(f"its date, {folder.name[:10]}, not named")
    return problems


def test_each_result_folder_says_what_how_where_and_at_which_code():
    """A README in every folder names the command, the machine, the commit and the date, as
    the folder's own data record them."""
    folders = sorted({RESULTS / path.split("/")[2] for path in _tracked()})  # a running bench: no
    wrong = {}
    for folder in folders:
        assert (folder / "README.md").exists(), f"{folder.name}: no README.md"
        wrong[folder.name] = readme_problems(folder)
    wrong = {name: problems for name, problems in wrong.items() if problems}
    assert not wrong, f"{len(wrong)} folders: {wrong}"


def test_packing_refuses_a_name_the_archive_holds_and_a_symlink(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "bench.log").write_text("first\n")
    assert pack_results.pack(folder) == 1
    (folder / "bench.log").write_text("second\n")  # a second member of one name would hide one
    with pytest.raises(ValueError, match="holds \\['bench.log'\\] already"):
        pack_results.pack(folder)
    assert (folder / "bench.log").read_text() == "second\n"
    (folder / "bench.log").unlink()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"x")
    (folder / "runs").symlink_to(outside)  # its target would not be in the archive
    with pytest.raises(ValueError, match="symlinks"):
        pack_results.pack(folder)
    assert (folder / "runs").is_symlink() and (outside / "data.bin").exists()


def test_a_row_is_judged_on_its_exact_interval_not_its_two_printed_decimals():
    import rejudge_tables

    row = "| photos | tuned/best_grid | 1.01x [0.95, 1.08] tie within noise | >= 0.95 met |\n"
    figures = {"photos": {"ratios": {"tuned/best_grid": {"low": 0.947, "high": 1.08}}}}
    assert rejudge_tables.rejudge(row)[0].endswith(">= 0.95 met |\n")  # the printed 0.95
    assert rejudge_tables.rejudge(row, figures)[0].endswith(">= 0.95 not shown |\n")


def test_no_figure_is_typed_by_hand_in_the_readme_or_the_docs():
    """Outside the generated blocks, neither the README nor any page under docs/ carries a
    measured figure (a rate, a ratio, its interval, a range of ratios, a duration): each is
    written from its results by benchmarks/doc_tables.py, or lives in its folder's README as
    the story of its day. A value in code is a setting, not a measurement."""
    import doc_tables

    for doc in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        lines = doc_tables.typed_figures(doc.read_text())
        assert not lines, f"{doc.name}: {len(lines)} lines, such as {lines[:3]}"


def test_the_figure_check_catches_each_form_and_leaves_settings_alone():
    import doc_tables

    for typed in ("took 435 s", "0.90-0.95 of it", "1.02x [0.88, 1.19]", "1,569 samples/s",
                  "about 2 hours", "16x recipe"):  # fmt: skip
        assert doc_tables.typed_figures(f"a {typed} b\n"), typed
    for setting in ("`sweep.budget_s=120` s", "```\nmake bench  # 30 min\n```",
                    "<!-- generated: x -->\n435 s\n<!-- /generated -->", "within 5%"):  # fmt: skip
        assert not doc_tables.typed_figures(setting + "\n"), setting


def test_make_bench_names_a_new_folder_each_run_and_keeps_each_stages_presets(
    tmp_path, monkeypatch
):
    """A bench run again is a new folder (-b, -c), never a replacement; the stages are the
    headline's three, each on the workloads its presets are kept for."""
    import bench

    monkeypatch.setattr(bench, "RESULTS", tmp_path)
    first = bench.folder_for("bench-loader", "2026-12-07", "cpu-2core-epyc")
    assert first.name == "2026-12-07_cpu-2core-epyc-bench-loader"
    first.mkdir()
    second = bench.folder_for("bench-loader", "2026-12-07", "cpu-2core-epyc")
    assert second.name == "2026-12-07_cpu-2core-epyc-bench-loader-b"
    second.mkdir()
    assert bench.folder_for("bench-loader", "2026-12-07", "cpu-2core-epyc").name.endswith(
        "-loader-c"
    )
    stages = {s.name: s for s in bench.HEADLINE}
    assert list(stages) == ["loader", "autotune", "engine"]
    assert stages["loader"].workloads == ["synthetic_loader", "photos"]
    assert stages["autotune"].workloads == ["photos", "docs"]
    assert all((ROOT / "benchmarks" / s.script).exists() for s in (*bench.HEADLINE, *bench.FULL))


def test_the_readme_fits_a_few_screens():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
