"""The core's log events reach Python ``logging`` under the ``fabric_lib`` logger hierarchy, with
no colour codes, and ``FABRIC_LIB_LOG`` bounds what is handed over (default: warnings)."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import logging, sys
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s|%(levelname)s|%(message)s")
import fabric_lib
engine = fabric_lib.TransferEngine("tcp", poll_mode="adaptive", worker_cpu=1000)  # no CPU 1000: warns
engine.stop()
"""


def _run(level: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FABRIC_LIB_LOG"}
    if level is not None:
        env["FABRIC_LIB_LOG"] = level
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )


def test_warnings_reach_python_logging_by_default() -> None:
    out = _run(None)
    assert out.returncode == 0, out.stderr
    assert "fabric_lib.worker|WARNING|could not pin the worker to CPU 1000" in out.stdout
    assert "DEBUG" not in out.stdout
    assert "\x1b[" not in out.stdout + out.stderr
    assert "could not pin" not in out.stderr  # not printed around Python logging


def test_fabric_lib_log_raises_the_level() -> None:
    out = _run("debug")
    assert out.returncode == 0, out.stderr
    assert "fabric_lib.provider.libfabric.domain|DEBUG|opened libfabric domain" in out.stdout
    assert "\x1b[" not in out.stdout + out.stderr


def test_fabric_lib_log_off_silences_the_core() -> None:
    out = _run("off")
    assert out.returncode == 0, out.stderr
    assert "fabric_lib." not in out.stdout
