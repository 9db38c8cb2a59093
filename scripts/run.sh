#!/usr/bin/env bash
# The main job: set-up and build, then a loopback transfer benchmark on the default provider,
# fabric-lib against a raw libfabric loop, printed as a table (JSON and a plot in bench-results/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python-env.sh
"$PY" -m benchmarks.bench_transfer "$@"
