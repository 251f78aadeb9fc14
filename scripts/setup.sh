#!/usr/bin/env bash
# Create .venv and install mlxfleet (with test extras when given "test").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".${extra}"
