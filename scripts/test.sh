#!/usr/bin/env bash
# Set up (if needed), lint, and run the tests.
#   bash scripts/test.sh        the fast tier, then everything else two at a time (CI)
#   bash scripts/test.sh fast   the fast tier alone (under 90 s): run it on every change
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Bytecode is written (to the ignored __pycache__ folders) even where the environment says
# not to, as CI's does: every test process and every worker and server the tests start
# would otherwise compile mlxfleet, and pytest rewrite the test modules, again (12.5 s
# -> 7.5 s to collect the suite, per test process).
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check mlxfleet tests benchmarks scripts examples
# Two test processes (pytest-xdist): most tests wait on worker processes and sockets, so
# two share these cores well (the fast tier: 34 -> 21 s). One file stays in one process
# (its shared servers too).
# (Not --dist loadgroup: under pytest 9.2, pytest-xdist 3.8 no longer groups the tests.)
par=(-n "${MLXFLEET_TEST_PROCESSES:-2}" --dist loadfile)
if [ "${1:-}" = "fast" ]; then
  shift
  exec .venv/bin/python -m pytest -q -m fast "${par[@]}" "$@"
fi
.venv/bin/python -m pytest -q -m fast "${par[@]}" "$@"
.venv/bin/python -m pytest -q -m "not fast" "${par[@]}" "$@"
