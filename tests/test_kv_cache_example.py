"""The KV-connector example runs (CPU, tcp) and checks its own pages."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "kv_connector_sketch.py"


@pytest.mark.timeout(90)
def test_kv_connector_sketch_runs() -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=80)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pages equal" in out.stdout
