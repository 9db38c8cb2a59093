"""The package imports without CUDA or RDMA hardware and exposes a typed error hierarchy."""

from __future__ import annotations

import subprocess
import sys

import fabric_lib
import pytest
from fabric_lib import errors


def test_import_needs_no_cuda_and_no_torch() -> None:
    code = (
        "import sys, fabric_lib; "
        "assert 'torch' not in sys.modules, 'importing fabric_lib must not import torch'; "
        "print(fabric_lib.__version__)"
    )
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == fabric_lib.__version__


def test_error_hierarchy() -> None:
    assert issubclass(errors.InvalidDescriptorError, errors.InvalidArgumentError)
    assert issubclass(errors.InvalidArgumentError, ValueError)
    assert issubclass(errors.FabricTimeoutError, TimeoutError)
    for cls in (
        errors.ProviderUnavailableError,
        errors.InvalidArgumentError,
        errors.TransferError,
        errors.FabricTimeoutError,
        errors.EngineStoppedError,
    ):
        assert issubclass(cls, errors.FabricError)


def test_unknown_provider_is_specific() -> None:
    with pytest.raises(fabric_lib.ProviderUnavailableError, match="no-such-provider"):
        fabric_lib.TransferEngine("no-such-provider")


def test_unknown_domain_is_specific() -> None:
    with pytest.raises(fabric_lib.ProviderUnavailableError, match="no domain"):
        fabric_lib.TransferEngine("tcp", "no-such-interface0")


def test_bad_poll_mode() -> None:
    with pytest.raises(ValueError, match="poll_mode"):
        fabric_lib.TransferEngine("tcp", poll_mode="sometimes")  # type: ignore[arg-type]
