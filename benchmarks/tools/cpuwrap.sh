#!/usr/bin/env bash
# cpuwrap CMD...: wall and whole-machine CPU (from /proc/stat) of CMD
c0=$(awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat); t0=$(date +%s.%N)
"$@"; rc=$?
c1=$(awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat); t1=$(date +%s.%N)
python3 -c "import os;print('rc=%s wall %.1f s, machine CPU %.1f s' % ($rc, $t1-$t0, ($c1-$c0)/os.sysconf('SC_CLK_TCK')))" >&2
exit $rc
