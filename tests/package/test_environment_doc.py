"""Every environment variable the code reads under the project's prefixes is documented in
docs/environment.md (the one place users look)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\b(FABRIC_(?:LIB|A2A)_[A-Z0-9_]+)\b")


def _tracked_sources() -> list[Path]:
    out = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "*.rs", "*.py", "*.sh", "*.cu", "*.cuh", "*.c", ".ci/run"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return [REPO / line for line in out.stdout.splitlines() if not line.startswith("tests/")]


def test_every_setting_is_documented() -> None:
    documented = (REPO / "docs" / "environment.md").read_text()
    used: dict[str, str] = {}
    for path in _tracked_sources():
        for name in NAME.findall(path.read_text(errors="replace")):
            used.setdefault(name, str(path.relative_to(REPO)))
    assert used, "expected to find FABRIC_LIB_* settings in the sources"
    # The test bed's variables are documented as one family (FABRIC_LIB_TESTBED_NICS, `_ADDRS`, ...).
    missing = {
        name: where
        for name, where in used.items()
        if name not in documented
        and not (name.startswith("FABRIC_LIB_TESTBED_") and f"`_{name[19:]}`" in documented)
    }
    assert missing == {}, f"undocumented in docs/environment.md: {missing}"
