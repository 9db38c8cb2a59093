"""Shared fixtures: providers available here and engine factories that always clean up."""

from __future__ import annotations

from collections.abc import Iterator

import fabric_lib
import pytest
from providers import LOOPBACK_PROVIDERS, provider_available


@pytest.fixture(params=LOOPBACK_PROVIDERS)
def provider(request: pytest.FixtureRequest) -> str:
    if not provider_available(request.param):
        pytest.skip(f"libfabric provider {request.param!r} not available here")
    return str(request.param)


EnginePair = tuple[fabric_lib.TransferEngine, fabric_lib.TransferEngine]


def _pair(provider: str) -> Iterator[EnginePair]:
    """Two engines on one provider, in this process (adaptive polling: CI has 2 cores)."""
    a = fabric_lib.TransferEngine(provider, poll_mode="adaptive", transfer_timeout=20.0)
    b = fabric_lib.TransferEngine(provider, poll_mode="adaptive", transfer_timeout=20.0)
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture
def engine_pair(provider: str) -> Iterator[EnginePair]:
    """Two engines on each loopback provider."""
    yield from _pair(provider)


@pytest.fixture
def tcp_pair() -> Iterator[EnginePair]:
    """Two tcp engines."""
    yield from _pair("tcp")
