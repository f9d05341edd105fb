#!/usr/bin/env bash
# Install feedrate on other Pythons and run the fast tests there (the classifiers' claim).
#
#   bash benchmarks/python_versions.sh OUT_DIR /path/to/python3.10 /path/to/python3.13 ...
#
# Each Python gets a fresh venv in $OUT_DIR/venv-<version> (deleted afterwards: several GB
# each, a CUDA build of torch), `pip install -e '.[test,cluster,dashboard,postgres]'` (as make setup) (the ranges of pyproject.toml, so
# each takes what resolves for it), then `pytest` (the fast tests). Writes
# $OUT_DIR/<version>.log and one line per Python to $OUT_DIR/summary.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?"a folder for the logs"}; shift
mkdir -p "$OUT"
for PY in "$@"; do
    V=$("$PY" -c 'import platform; print(platform.python_version())')
    VENV="$OUT/venv-$V"
    LOG="$OUT/$V.log"
    start=$(date +%s)
    {
        "$PY" -m venv "$VENV" && "$VENV/bin/python" -m pip install -q --upgrade pip &&
        "$VENV/bin/python" -m pip install -q -e '.[test,cluster,dashboard,postgres]' &&
        "$VENV/bin/python" -m pip freeze | grep -iE '^(torch|hydra-core|omegaconf|optuna|hydra-optuna-sweeper|sqlalchemy|numpy)==' &&
        "$VENV/bin/python" -m pytest -q -p no:cacheprovider
    } > "$LOG" 2>&1
    status=$?
    tail=$(grep -E "passed|failed|error" "$LOG" | tail -1)
    echo "| $V | $([[ $status == 0 ]] && echo pass || echo "FAIL ($status)") | $tail | $(( $(date +%s) - start )) s |" | tee -a "$OUT/summary.md"
    rm -rf "$VENV"
done
