#!/usr/bin/env bash
# Runs every test: set-up and build (with the test packages), lints, the Rust tests and smoke runs
# of the Rust benchmarks, then pytest
# (multi-process tests over the tcp, udp;ofi_rxd and shm providers, the examples; GPU and netns
# tests skip with a reason where unsupported).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
source scripts/python-env.sh
bash scripts/lint.sh
echo "== cargo test"
cargo test -q --release -p libfabric-sys -p fabric-lib -p fabric-debug -p cuda-lib -p p2p-all-to-all
# With the CUDA-enabled libfabric (scripts/build_libfabric.sh) in place, the DMA-BUF registration
# path also runs against it (libfabric >= 1.20; the system's 1.17 has no FI_MR_DMABUF).
if [ -e .libfabric-cuda/lib/libfabric.so.1 ]; then
    echo "== cargo test (DMA-BUF registration against .libfabric-cuda)"
    LD_LIBRARY_PATH="$PWD/.libfabric-cuda/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        cargo test -q --release -p fabric-lib --lib provider::libfabric::dmabuf
fi
echo "== Rust benchmarks, smoke runs (each checks what it moves)"
bench_out=$(mktemp -d)
cargo bench -q -p fabric-lib --bench submit_cost -- --calls 2000 --targets 1,8 --json-out "$bench_out/submit_cost.json"
cargo bench -q -p fabric-lib --bench imm_wake -- --iters 2000 --rounds 1 --json-out "$bench_out/imm_wake.json"
cargo bench -q -p p2p-all-to-all --bench proxy_costs -- --worlds 3 --calls 30 --runner worker,thread --posted --json-out "$bench_out/proxy_costs.json"
rm -rf "$bench_out"
echo "== pytest"
"$PY" -m pytest -q -p no:cacheprovider tests "$@"
