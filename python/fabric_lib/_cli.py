"""Console entry points installed with the package."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BINARY = Path(__file__).parent / "_bin" / "fabric-debug"


def fabric_debug() -> None:
    """`fabric-debug`: runs the benchmark/smoke-test binary shipped inside the wheel."""
    if not BINARY.is_file():
        sys.exit(
            f"fabric-debug: {BINARY} is missing; this fabric_lib was installed without the CLI "
            "(build the wheel with scripts/build_wheel.sh)"
        )
    os.execv(BINARY, [str(BINARY), *sys.argv[1:]])
