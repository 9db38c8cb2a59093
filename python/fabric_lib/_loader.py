"""Loads the native extension, turning a missing libfabric into an ImportError that says what to
install (instead of the dynamic loader's bare message)."""

from __future__ import annotations

import importlib

LIBFABRIC = "libfabric.so.1"
INSTALL_HINT = (
    "install libfabric 1.17 or newer: on Debian/Ubuntu `sudo apt-get install libfabric1` "
    "(package libfabric1; libfabric-bin adds fi_info), or put a libfabric build on LD_LIBRARY_PATH"
)


def load_native() -> None:
    """Imports ``fabric_lib._rust``; raises ImportError naming libfabric if it cannot be loaded."""
    try:
        importlib.import_module("fabric_lib._rust")
    except ImportError as e:
        if "libfabric" not in str(e):
            raise
        raise ImportError(
            f"fabric_lib needs the shared library {LIBFABRIC}, which the dynamic loader could not "
            f"load ({e}); {INSTALL_HINT}.",
            name="fabric_lib._rust",
        ) from e
