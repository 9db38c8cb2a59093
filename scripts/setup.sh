#!/usr/bin/env bash
# Installs what fabric-lib needs on a fresh Debian/Ubuntu machine, then builds it:
# system packages (libfabric, libclang for bindgen), Python packages, the wheel (installed into
# this Python) and the fabric-debug CLI. Idempotent: steps already done are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
APT_PACKAGES=(libfabric-dev libfabric-bin libclang-dev clang pkg-config iproute2 gcc)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "setup: installing system packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! $PY -c "import maturin, pytest, pytest_timeout, hypothesis, numpy, torch, transformers" >/dev/null 2>&1; then
    echo "setup: installing Python packages (torch is large; first run takes a few minutes)"
    $PY -m pip install -q --disable-pip-version-check "maturin>=1.5,<2" "pytest>=8" pytest-timeout hypothesis numpy torch transformers
fi

if ! command -v cargo >/dev/null; then
    echo "setup: cargo (Rust toolchain) is required and not on PATH" >&2
    exit 1
fi

# nvcc 13.0.x compiles the CUDA kernels embedded in the wheel (rust/cuda-lib/build.rs). Without
# one in NVCC, CUDA_HOME or PATH, install NVIDIA's PyPI toolchain into a private prefix (not this
# Python's site-packages, where torch pins other nvidia-* versions); build.rs also finds it there.
NVCC_VERSION=13.0.88
if [ -z "${NVCC:-}" ] && ! [ -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ] && ! command -v nvcc >/dev/null; then
    NVCC_PREFIX="${XDG_CACHE_HOME:-$HOME/.cache}/fabric-lib/nvcc-$NVCC_VERSION"
    if ! "$NVCC_PREFIX/nvidia/cu13/bin/nvcc" --version >/dev/null 2>&1; then
        echo "setup: installing nvcc $NVCC_VERSION (PyPI) into $NVCC_PREFIX"
        $PY -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade \
            --target "$NVCC_PREFIX" "nvidia-cuda-nvcc==$NVCC_VERSION" "nvidia-cuda-crt==$NVCC_VERSION" \
            "nvidia-nvvm==$NVCC_VERSION" "nvidia-cuda-runtime==$NVCC_VERSION" "nvidia-cuda-cccl==13.0.85"
    fi
    export NVCC="$NVCC_PREFIX/nvidia/cu13/bin/nvcc"
fi

echo "setup: building the wheel and fabric-debug (release)"
rm -rf dist
$PY -m maturin build --release -q -o dist --compatibility linux --auditwheel skip
$PY -m pip install -q --disable-pip-version-check --force-reinstall --no-deps dist/*.whl
cargo build --release -q -p fabric-debug
