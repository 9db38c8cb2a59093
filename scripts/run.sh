#!/usr/bin/env bash
# The main job: set-up and build, then a loopback transfer benchmark on the default provider,
# fabric-lib against a raw libfabric loop, printed as a table (JSON in bench-results/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
${PYTHON:-python3} -m benchmarks.bench_transfer "$@"
