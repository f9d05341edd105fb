"""The package's shape: what importing a part of it loads, and which way its imports go."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "feedrate"
HEAVY = ("hydra", "omegaconf", "torch", "feedrate.launch", "feedrate.sweep")


def _loaded_after(statement: str) -> list[str]:
    """Which of :data:`HEAVY` a fresh interpreter has loaded after ``statement``."""
    code = f"import sys\n{statement}\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout)  # noqa: S307 - the list the line above printed


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function: ``from feedrate import
    sweep`` counts as ``feedrate.sweep``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_the_pure_policy_loads_neither_torch_nor_hydra_nor_the_launcher():
    """The tuners' decisions (the policy, the model of the pipeline, the decision rule) import
    alone; the package's face gives its names, each loading its module when first used."""
    assert _loaded_after("import feedrate.tuning.policy, feedrate.tuning.model") == []
    assert _loaded_after("import feedrate") == []
    assert _loaded_after("import feedrate; feedrate.autotune_loader") == []
    loaded = _loaded_after("import feedrate; feedrate.compose")
    assert "feedrate.launch" in loaded and "hydra" in loaded


def test_the_run_imports_nothing_from_the_sweep():
    """The sweep runs trials of the run; the run knows nothing of the sweep."""
    for path in sorted(SRC.rglob("*.py")):
        if "sweep" in path.relative_to(SRC).parts:
            continue
        upward = sorted(m for m in _imports(path) if m.split(".")[:2] == ["feedrate", "sweep"])
        assert not upward, f"{path.relative_to(SRC)} imports {upward}"


def test_the_loop_the_meter_and_the_tuning_take_values_not_the_config():
    """Below the door (launch, workload, autotune), the config is plain typed values: the loop,
    the meter, the monitor, the thread engine and tuning/ import no omegaconf or Hydra."""
    below = [
        SRC / f"{name}.py" for name in ("trainer", "meter", "monitor", "threads", "drift")
    ] + sorted((SRC / "tuning").glob("*.py"))
    for path in below:
        config = sorted(m for m in _imports(path) if m.split(".")[0] in ("omegaconf", "hydra"))
        assert not config, f"{path.relative_to(SRC)} imports {config}"
        assert "DictConfig" not in path.read_text(), f"{path.relative_to(SRC)} names DictConfig"


def _private_reaches(path: Path) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` or ``cls``: one object reading another's
    private attributes (a module's private name, ``module._name``, counts too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue  # dunders are public protocol
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_the_tuning_loaders_parts_read_none_of_each_others_private_state():
    """The batch plan, the session and the engine factory each keep their state; the tuning
    loader runs them through what each offers."""
    tuning = SRC / "tuning"
    parts = [tuning / n for n in ("loader.py", "plan.py", "session.py", "candidates.py")]
    reaches = [r for part in parts for r in _private_reaches(part)]
    assert not reaches, reaches
    candidates = (tuning / "candidates.py").read_text()
    assert "_Loader" not in candidates, "a setting's loader comes from loader.engine_loader"
