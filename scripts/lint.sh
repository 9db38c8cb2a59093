#!/usr/bin/env bash
# Lints everything (configuration lives in Cargo.toml / pyproject.toml): clippy with warnings as
# errors, rustfmt, ruff (checks everywhere; the formatter over tests and benchmarks), and mypy on the
# package, the tests and the benchmarks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -c "import ruff, mypy" >/dev/null 2>&1 || $PY -m pip install -q --disable-pip-version-check ruff mypy
echo "== lint: cargo clippy"
cargo clippy -q --workspace --all-targets -- -D warnings
echo "== lint: rustfmt"
cargo fmt --all --check
echo "== lint: ruff"
$PY -m ruff check python tests benchmarks scripts
$PY -m ruff format --check tests benchmarks
echo "== lint: mypy"
$PY -m mypy python/fabric_lib tests benchmarks

