# make train | test | test-fast | sweep | bench | bench-full | bench-check | doctor | lock | lint | format
# Each target sets up .venv from nothing on first use (pip, Python 3.10+).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Python compiles a module's bytecode the first time it is imported, and keeps it (__pycache__):
# only what runs is compiled, about a third of the 14,751 files pip would compile, on one
# core. Where PYTHONDONTWRITEBYTECODE is set nothing is kept, and every process of the suite
# would compile torch again, so make's commands keep it (see docs/install.md).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup train test test-fast sweep bench bench-full clean-tree bench-check doctor lock lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install --no-compile -e '.[test,cluster,dashboard,postgres,integrations]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) train.py

# Every test, the slow ones too (plain pytest leaves them out: see pyproject.toml), two at a
# time (pytest-xdist; each test starts processes of its own, and they are sized for 2 cores)
test: $(STAMP)
	$(PY) -m pytest -m "" -n 2 --dist worksteal --durations=25

test-fast: $(STAMP)
	$(PY) -m pytest -n 2 --dist worksteal

sweep: $(STAMP)
	$(PY) train.py -m sweep=loader

# The headline benches (about 33 minutes here), from a clean tree: each result folder records
# the commit, the machine and the date, and a figure of uncommitted code would name a commit it
# was not measured at. bench-full: every workload of each bench (hours).
bench: $(STAMP) clean-tree
	$(PY) benchmarks/bench.py

bench-full: $(STAMP) clean-tree
	$(PY) benchmarks/bench.py --full

clean-tree:
	@git diff --quiet HEAD -- src conf benchmarks train.py examples || { \
	  echo "make bench: src/, conf/, benchmarks/, examples/ or train.py has uncommitted changes:"\
	       "commit them (or git stash) first, so the results name the code they measured" >&2; \
	  exit 2; }

# The figures in the README and docs/benchmarks.md against the results they cite (nothing is
# measured): the generated tables, stale marks included, every table under the one rule, and
# result folders that stay small. After a bench: python benchmarks/doc_tables.py --write
bench-check: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests/test_results.py

doctor: $(STAMP)
	$(PY) -m feedrate.doctor

# The exact versions of .venv, where the suite passes: pip install -r requirements.lock
lock: $(STAMP)
	{ echo "# The tested set: pip install -r requirements.lock && pip install --no-deps -e ."; \
	  echo "# Python $$($(PY) -c 'import platform; print(platform.python_version(), platform.machine())'),"\
	       "made by make lock from .venv (make test passes with it)."; \
	  $(PY) -m pip freeze --exclude-editable --disable-pip-version-check | sort -f; \
	} > requirements.lock.tmp && mv requirements.lock.tmp requirements.lock

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples train.py
	$(PY) -m ruff format --check src tests benchmarks examples train.py

format: $(STAMP)
	$(PY) -m ruff format src tests benchmarks examples train.py
	$(PY) -m ruff check --fix src tests benchmarks examples train.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
