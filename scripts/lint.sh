#!/usr/bin/env bash
# Lints everything (configuration lives in Cargo.toml / pyproject.toml): clippy with warnings as
# errors, rustfmt, ruff (checks everywhere; the formatter over every Python tree), mypy on the
# package, the tests, the benchmarks and (strict) the examples, and stubtest of the native
# extension's stub against the installed extension (exceptions with reasons in
# scripts/stubtest-allowlist.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python-env.sh
"$PY" -c "import ruff, mypy" >/dev/null 2>&1 || "$PY" -m pip install -q --disable-pip-version-check ruff mypy
echo "== lint: cargo clippy"
cargo clippy -q --workspace --all-targets -- -D warnings
echo "== lint: rustfmt"
cargo fmt --all --check
echo "== lint: ruff"
"$PY" -m ruff check python tests benchmarks scripts examples
"$PY" -m ruff format --check python scripts examples tests benchmarks
echo "== lint: mypy"
"$PY" -m mypy python/fabric_lib tests benchmarks
"$PY" -m mypy --strict examples
echo "== lint: stubtest (python/fabric_lib/_rust.pyi against the built extension)"
# From outside the checkout, so the installed package (with its extension) is the one checked.
repo=$PWD
(cd "${TMPDIR:-/tmp}" && "$PY" -m mypy.stubtest fabric_lib._rust --allowlist "$repo/scripts/stubtest-allowlist.txt")
