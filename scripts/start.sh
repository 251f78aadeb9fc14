#!/usr/bin/env bash
# Set up (if needed) and start mlxfleet on the bundled manifests/ folder, port 8000.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mlxfleet serve --manifests manifests "$@"
