"""Multi-host test beds for fabric_lib without RDMA hardware (see ``netns``)."""

from __future__ import annotations

from .netns import (
    ADDRESS_RANGE,
    DEFAULT_PORT,
    ENV_ADDRS,
    ENV_BOOTSTRAP,
    ENV_HOST,
    ENV_NICS,
    ENV_NS,
    ENV_WORLD,
    ProcResult,
    RunError,
    TestBed,
    TestBedError,
    available,
    cleanup_stale,
    list_namespaces,
)

__all__ = [
    "ADDRESS_RANGE",
    "DEFAULT_PORT",
    "ENV_ADDRS",
    "ENV_BOOTSTRAP",
    "ENV_HOST",
    "ENV_NICS",
    "ENV_NS",
    "ENV_WORLD",
    "ProcResult",
    "RunError",
    "TestBed",
    "TestBedError",
    "available",
    "cleanup_stale",
    "list_namespaces",
]
