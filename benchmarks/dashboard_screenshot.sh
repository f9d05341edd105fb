#!/usr/bin/env bash
# A loader study as optuna-dashboard shows it, in a real headless browser: screenshots of the
# study's history, its trials, the trials table and the study's note (the sweep's decision).
#
#   bash benchmarks/dashboard_screenshot.sh sqlite:///outputs/sweeps/<study>.db OUT_DIR
#
# Needs optuna-dashboard (`make setup` installs it) and Chromium (Debian: apt-get install
# chromium). The suite tests the same pages' data through the dashboard's HTTP API
# (tests/test_dashboard.py); this is the check that a browser renders them.
set -euo pipefail
STORAGE=${1:?"a study's storage URL, e.g. sqlite:///outputs/sweeps/loader-x.db"}
OUT=${2:?"a folder for the screenshots"}
PY=${PYTHON:-.venv/bin/python}
BROWSER=${BROWSER:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}
[[ -n "$BROWSER" ]] || { echo "no Chromium found: apt-get install chromium" >&2; exit 2; }
mkdir -p "$OUT"
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$(dirname "$PY")/optuna-dashboard" "$STORAGE" --host 127.0.0.1 --port "$PORT" \
    > "$OUT/dashboard.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 60); do
    curl -sf "http://127.0.0.1:$PORT/api/studies" > "$OUT/studies.json" && break
    sleep 0.5
done
ID=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["study_summaries"][0]["study_id"])' "$OUT/studies.json")
shot() {  # page, file: the page after its scripts ran
    "$BROWSER" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1100 \
        --virtual-time-budget=15000 --screenshot="$OUT/$2" \
        "http://127.0.0.1:$PORT/dashboard/studies/$ID$1" > /dev/null 2>&1
    echo "$OUT/$2"
}
shot "" study.png
shot "/trials" trials.png
shot "/trialTable" trial_table.png
shot "/note" note.png
