"""Shared fixtures: providers available here and engine factories that always clean up."""

from __future__ import annotations

import fabric_lib
import pytest

# Providers that implement RMA with remote CQ data on loopback (libfabric 1.17 software providers).
LOOPBACK_PROVIDERS = ["tcp", "udp;ofi_rxd", "shm"]


def provider_available(name: str) -> bool:
    prefix = name.split(";")[0]
    return any(p.split(";")[0] == prefix for p, _ in fabric_lib.list_providers())


@pytest.fixture(params=LOOPBACK_PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    if not provider_available(request.param):
        pytest.skip(f"libfabric provider {request.param!r} not available here")
    return request.param


@pytest.fixture
def engine_pair(provider: str):
    """Two engines on the same provider, in this process (adaptive polling: CI has 2 cores)."""
    a = fabric_lib.TransferEngine(provider, poll_mode="adaptive", transfer_timeout=20.0)
    b = fabric_lib.TransferEngine(provider, poll_mode="adaptive", transfer_timeout=20.0)
    yield a, b
    a.stop()
    b.stop()
