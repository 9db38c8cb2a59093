"""Fixtures of the multi-NIC tests on the network-namespace test bed."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from fabric_lib.testing import netns as tb

from .multi_nic import PREFIX


@pytest.fixture
def multi_nic_requirements() -> Iterator[None]:
    """Skips where the test bed cannot be built or torch / hypothesis are missing; removes the
    leftovers of killed runs."""
    ok, why = tb.available()
    if not ok:
        pytest.skip(f"netns test bed unavailable: {why}")
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("hypothesis") is None:
        pytest.skip("torch and hypothesis are needed")
    tb.cleanup_stale(PREFIX)
    yield


@pytest.fixture(scope="session")
def bed3x2() -> Iterator[tb.TestBed]:
    """3 hosts x 2 NICs, shared by the tests that leave every link up."""
    ok, why = tb.available()
    if not ok:
        pytest.skip(f"netns test bed unavailable: {why}")
    with tb.TestBed(hosts=3, nics=2, prefix=PREFIX) as bed:
        yield bed
