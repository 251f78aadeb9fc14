#!/usr/bin/env bash
# Set up (if needed) and run the linter and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check mlxfleet tests benchmarks scripts examples
# Two test files at a time (xdist): the tests wait on worker processes a third of the
# time, so two of them keep two cores busy (1353 s -> 786 s here). One file's tests stay
# together, in order, sharing their module's server.
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
