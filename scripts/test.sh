#!/usr/bin/env bash
# Set up (if needed) and run the linter and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/ruff check mlxfleet tests benchmarks scripts examples
.venv/bin/python -m pytest -q "$@"
