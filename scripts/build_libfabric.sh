#!/usr/bin/env bash
# Builds libfabric 2.1.0 with CUDA (FI_HMEM) support, and its fabtests (fi_rma_bw, ...), into a
# project-local prefix. Everything comes from the package registries: the upstream tarball from
# Debian's source archive (trixie), CUDA and NVML headers plus libcudart from PyPI, the toolchain
# from apt. Idempotent: when the prefix already holds this build, nothing is done.
#
#   scripts/build_libfabric.sh [--prefix DIR] [--force]
#
# Prefix: --prefix, else $LIBFABRIC_PREFIX, else .libfabric-cuda/ in the repository. Downloads and
# the generated source tree are cached under ${XDG_CACHE_HOME:-~/.cache}/fabric-lib/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

LIBFABRIC_VERSION=2.1.0
DEBIAN_SUITE=trixie
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CUDA_RUNTIME_VERSION=13.0.88 # cuda.h, cuda_runtime.h, libcudart.so.13 (nvidia-cuda-runtime)
CUDA_CRT_VERSION=13.0.88     # crt/host_config.h, included by cuda_runtime.h
NVML_DEV_VERSION=13.0.87     # nvml.h
# Lean provider set: the socket and shared-memory providers, plus verbs and efa (the production
# RDMA providers, whose headers come from rdma-core's libibverbs-dev).
PROVIDERS=(tcp udp rxm rxd shm sockets verbs efa)
# Any change to what gets built must change this line, so that existing prefixes are rebuilt.
RECIPE="libfabric $LIBFABRIC_VERSION from $DEBIAN_SUITE; providers: ${PROVIDERS[*]}; cuda-runtime $CUDA_RUNTIME_VERSION; nvml-dev $NVML_DEV_VERSION; recipe 1"

usage() {
    sed -n '2,10s/^# \{0,1\}//p' "$0"
}

PREFIX=${LIBFABRIC_PREFIX:-$ROOT/.libfabric-cuda}
FORCE=0
while (($#)); do
    case $1 in
    --prefix) [ $# -ge 2 ] || { usage >&2; exit 2; }; PREFIX=$2; shift 2 ;;
    --prefix=*) PREFIX=${1#--prefix=}; shift ;;
    --force) FORCE=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "build_libfabric: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done
mkdir -p "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)
STAMP=$PREFIX/.fabric-lib-libfabric-build
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/fabric-lib/libfabric-$LIBFABRIC_VERSION
PY=${PYTHON:-python3}
JOBS=$(nproc)

say() { echo "build_libfabric: $*"; }

print_usage_hint() {
    cat <<EOF
build_libfabric: libfabric $LIBFABRIC_VERSION with CUDA support is in $PREFIX
  use it:      export LD_LIBRARY_PATH=$PREFIX/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
  providers:   LD_LIBRARY_PATH=$PREFIX/lib $PREFIX/bin/fi_info -l
  fabtests:    $PREFIX/bin/fi_rma_bw, fi_rdm_pingpong, ... (same LD_LIBRARY_PATH)
EOF
}

installed() {
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ] && [ -x "$PREFIX/bin/fi_rma_bw" ] &&
        [ -e "$PREFIX/lib/libcudart.so" ] &&
        [[ $(LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/bin/fi_info" --version 2>/dev/null) == *"libfabric: $LIBFABRIC_VERSION"* ]]
}

if [ "$FORCE" = 0 ] && installed; then
    say "already built, nothing to do (--force rebuilds)"
    print_usage_hint
    exit 0
fi
# The prefix is wiped before installing: never do that to a directory this script did not make.
if [ -n "$(ls -A "$PREFIX")" ] && ! [ -f "$STAMP" ]; then
    echo "build_libfabric: $PREFIX is not empty and was not made by this script; choose another --prefix" >&2
    exit 1
fi

# --- toolchain (apt) -------------------------------------------------------------------------
# autoconf/automake/libtool: the upstream tarball is a git snapshot without a configure script.
APT_PACKAGES=(autoconf automake libtool make gcc binutils xz-utils libibverbs-dev librdmacm-dev
    debian-archive-keyring)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
    say "installing system packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# --- upstream tarball (Debian source archive) ------------------------------------------------
# A private deb-src list, lists and cache directory: the machine's own apt set-up is not touched.
# Only the orig tarball is fetched (Debian's packaging is not applied), checked against the
# SHA-256 from the signed Sources index.
SRC=$CACHE/src
mkdir -p "$SRC"
ORIG=$(find "$SRC" -maxdepth 1 -name "libfabric_$LIBFABRIC_VERSION.orig.tar.*" -print -quit)
if [ -z "$ORIG" ]; then
    APT_DIR=$CACHE/apt
    mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $DEBIAN_MIRROR $DEBIAN_SUITE main" \
        >"$APT_DIR/sources.list"
    # As root, apt's unprivileged download user could not write into this cache: download as root.
    SANDBOX_OPTS=(); [ "$(id -u)" -ne 0 ] || SANDBOX_OPTS=(-o APT::Sandbox::User=root)
    APT_OPTS=("${SANDBOX_OPTS[@]}" -o "Dir::Etc::SourceList=$APT_DIR/sources.list"
        -o Dir::Etc::SourceParts=/dev/null -o "Dir::State::Lists=$APT_DIR/lists" -o "Dir::Cache=$APT_DIR/cache")
    say "fetching the $DEBIAN_SUITE source index"
    apt-get "${APT_OPTS[@]}" update -qq
    uri_line=$(apt-get "${APT_OPTS[@]}" source --print-uris --download-only libfabric 2>/dev/null |
        grep -E "^'[^']+' libfabric_${LIBFABRIC_VERSION//./\\.}\.orig\.tar\.[a-z0-9]+ " || true)
    if [ -z "$uri_line" ]; then
        echo "build_libfabric: $DEBIAN_SUITE has no libfabric $LIBFABRIC_VERSION orig tarball" >&2
        exit 1
    fi
    read -r uri name _size hash <<<"$uri_line"
    uri=${uri//\'/}
    say "downloading $name"
    /usr/lib/apt/apt-helper "${SANDBOX_OPTS[@]}" download-file "$uri" "$SRC/$name.part" "$hash" >/dev/null
    mv "$SRC/$name.part" "$SRC/$name"
    ORIG=$SRC/$name
fi

# --- CUDA and NVML headers, libcudart (PyPI) -------------------------------------------------
# A private prefix, not this Python's site-packages (where torch pins other nvidia-* versions).
CUDA_DIR=$CACHE/cuda
CUDA=$CUDA_DIR/nvidia/cu13
if ! [ -f "$CUDA/include/cuda.h" ] || ! [ -f "$CUDA/include/crt/host_config.h" ] ||
    ! [ -f "$CUDA/include/nvml.h" ] || ! [ -f "$CUDA/lib/libcudart.so.13" ]; then
    say "installing CUDA $CUDA_RUNTIME_VERSION runtime and NVML headers (PyPI) into $CUDA_DIR"
    "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-deps --upgrade \
        --target "$CUDA_DIR" "nvidia-cuda-runtime==$CUDA_RUNTIME_VERSION" \
        "nvidia-cuda-crt==$CUDA_CRT_VERSION" "nvidia-nvml-dev==$NVML_DEV_VERSION"
fi

# --- generated source tree (autogen), cached -------------------------------------------------
TREE=$SRC/libfabric-$LIBFABRIC_VERSION
if ! [ -f "$TREE/.autogen-done" ]; then
    say "unpacking and running autogen.sh (libfabric and fabtests)"
    rm -rf "$TREE"
    tar -xf "$ORIG" -C "$SRC"
    (cd "$TREE" && ./autogen.sh >/dev/null 2>&1) || { echo "build_libfabric: autogen.sh failed" >&2; exit 1; }
    (cd "$TREE/fabtests" && ./autogen.sh >/dev/null 2>&1) ||
        { echo "build_libfabric: fabtests/autogen.sh failed" >&2; exit 1; }
    touch "$TREE/.autogen-done"
fi

# --- build and install -----------------------------------------------------------------------
BUILD=$CACHE/build
LOG=$CACHE/build.log
rm -rf "$BUILD" && mkdir -p "$BUILD/libfabric" "$BUILD/fabtests"
: >"$LOG"
run_logged() { # run a build step; on failure show the end of its log
    if ! "$@" >>"$LOG" 2>&1; then
        echo "build_libfabric: failed: $* (full log: $LOG)" >&2
        tail -n 30 "$LOG" >&2
        exit 1
    fi
}
provider_flags=()
for p in "${PROVIDERS[@]}"; do provider_flags+=("--enable-$p=yes"); done

find "$PREFIX" -mindepth 1 -delete
echo "incomplete: a build is running or failed" >"$STAMP" # marks the prefix as this script's
say "configuring libfabric (providers: ${PROVIDERS[*]}; CUDA through dlopen)"
cd "$BUILD/libfabric"
run_logged "$TREE/configure" --prefix="$PREFIX" --disable-static --with-cuda="$CUDA" \
    --enable-cuda-dlopen --enable-only "${provider_flags[@]}"
say "building libfabric ($JOBS jobs; log: $LOG)"
run_logged make -j"$JOBS"
run_logged make install-strip
say "building fabtests"
cd "$BUILD/fabtests"
run_logged "$TREE/fabtests/configure" --prefix="$PREFIX" --with-libfabric="$PREFIX" --with-cuda="$CUDA"
run_logged make -j"$JOBS"
run_logged make install-strip
cd "$ROOT"

# libfabric and fabtests dlopen "libcudart.so" by that exact name (libcuda.so.1 comes with the
# GPU driver). NVIDIA's redistributable runtime goes next to libfabric so the prefix is complete.
install -m 0755 "$CUDA/lib/libcudart.so.13" "$PREFIX/lib/"
ln -sf libcudart.so.13 "$PREFIX/lib/libcudart.so"
rm -f "$PREFIX"/lib/*.la
rm -rf "$BUILD"

providers_listed=$(LD_LIBRARY_PATH="$PREFIX/lib" "$PREFIX/bin/fi_info" -l)
for p in tcp shm; do
    grep -qx "$p:" <<<"$providers_listed" ||
        { echo "build_libfabric: the new libfabric does not list provider $p" >&2; exit 1; }
done
echo "$RECIPE" >"$STAMP"
say "done in $SECONDS s"
print_usage_hint
