"""The libfabric providers the tests run over on loopback, and pytest params that skip the absent."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import fabric_lib
import pytest

# Providers that implement RMA with remote CQ data on loopback (libfabric 1.17 software providers).
LOOPBACK_PROVIDERS = ["tcp", "udp;ofi_rxd", "shm"]


def provider_available(name: str) -> bool:
    prefix = name.split(";")[0]
    return any(p.split(";")[0] == prefix for p, _ in fabric_lib.list_providers())


def provider_params(names: Sequence[str] = LOOPBACK_PROVIDERS) -> list[Any]:
    """pytest params for providers, each skipped with a reason where libfabric lacks it."""
    return [
        pytest.param(
            n,
            id=n.replace(";", "-"),
            marks=pytest.mark.skipif(
                not provider_available(n), reason=f"libfabric provider {n!r} not available"
            ),
        )
        for n in names
    ]
