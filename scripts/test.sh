#!/usr/bin/env bash
# Runs every test: set-up and build (with the test packages), lints, the Rust tests, then pytest
# (multi-process tests over the tcp, udp;ofi_rxd and shm providers, the examples; GPU and netns
# tests skip with a reason where unsupported).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
source scripts/python-env.sh
bash scripts/lint.sh
echo "== cargo test"
cargo test -q --release -p libfabric-sys -p fabric-lib -p fabric-debug -p cuda-lib -p p2p-all-to-all
echo "== pytest"
"$PY" -m pytest -q -p no:cacheprovider tests "$@"
