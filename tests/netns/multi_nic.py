"""What the multi-NIC tests on the network-namespace test bed share: the hosts' ranks (ONE engine over
all of a host's NICs, ``TransferEngine("tcp", ["nic0", "nic1", ...])``, bootstrapped over gloo with
``fabric_lib.distributed.exchange``), deterministic data, exact checks, NIC byte counters, and
the driver's way to run a scenario on every host.

Checks in the ranks raise AssertionError with a message (``check``); a failure reaches the test
as a ``RankError`` with the rank's traceback, which fails it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fabric_lib
import pytest
import torch
import torch.distributed as dist
from fabric_lib.testing import RankError, Ranks, host_ranks, init_process_group, this_rank
from fabric_lib.testing.netns import ENV_NICS, TestBed

PREFIX = "flmnic"  # these tests' beds; never touches other tests' or the CLI's
# Environment of every rank: no interface pinning by the caller, one OpenMP thread (2 cores).
RANK_ENV = {"FI_TCP_IFACE": None, "OMP_NUM_THREADS": "1"}

WAIT = 30.0  # seconds for any single wait on a future or a counter
SETTLE = 0.05  # seconds to let stray immediates arrive before checking a counter is back at 0
BUF = 24 << 20  # bytes of each registered source/destination buffer

# Single-write sizes: tiny, around and across the 8 KiB shard alignment, and large non-multiples.
SIZES = [1, 4095, 8191, 8192, 8193, 16385, 3 * 8192 + 1, (1 << 20) + 3, (3 << 20) + 5]


def check(cond: Any, message: str) -> None:
    if not cond:
        raise AssertionError(message)


@functools.cache
def pattern(rank: int, n: int = BUF) -> torch.Tensor:
    """The deterministic random source bytes of ``rank`` (every rank can recompute any rank's).
    Cached: never modify the result."""
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1000 + rank)
    )


def nic_tx_rx(nics: list[str]) -> dict[str, dict[str, int]]:
    """This host's per-NIC byte counters (the same files TestBed.nic_counters reads)."""
    out = {}
    for nic in nics:
        base = Path("/sys/class/net") / nic / "statistics"
        out[nic] = {k: int((base / k).read_text()) for k in ("tx_bytes", "rx_bytes", "tx_packets")}
    return out


def delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {nic: {k: after[nic][k] - before[nic][k] for k in before[nic]} for nic in before}


def expect_exact(counter: fabric_lib.ImmCounter, n: int, what: str) -> None:
    """Waits for exactly ``n`` arrivals: ``n`` arrive within WAIT, and none more after SETTLE."""
    counter.wait(n, timeout=WAIT)
    time.sleep(SETTLE)
    extra = counter.value
    check(extra == 0, f"{what}: {extra} extra arrivals of immediate {counter.imm} after the expected {n}")


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    idx = (a != b).nonzero()
    if len(idx) == 0:
        return "equal"
    i = int(idx[0])
    return f"{len(idx)} bytes differ, first at {i}: got {int(a[i])}, expected {int(b[i])}"


def check_bytes(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    check(torch.equal(got, expected), f"{what}: {first_diff(got, expected)}")


def host_nics() -> list[str]:
    """The NICs of the test-bed host this rank runs on."""
    return os.environ[ENV_NICS].split(",")


class Ctx:
    """One rank: its engine over every NIC (of ``nics``), in the hosts' gloo process group."""

    def __init__(self, nics: list[str], **engine_kwargs: Any) -> None:
        me = this_rank()
        self.rank, self.world = me.rank, me.world_size
        self.nics = nics
        torch.set_num_threads(1)
        init_process_group("gloo", timeout=90)
        self.engine = fabric_lib.TransferEngine("tcp", nics, **engine_kwargs)
        check(self.engine.domain_names == nics, f"domains {self.engine.domain_names} != {nics}")
        check(self.engine.provider.startswith("tcp"), f"provider {self.engine.provider}")

    def close(self) -> float:
        t = time.monotonic()
        self.engine.stop()
        stop_s = time.monotonic() - t
        dist.destroy_process_group()
        return stop_s


@contextlib.contextmanager
def on_hosts(bed: TestBed, hosts: Sequence[int] | None = None) -> Iterator[Ranks[None]]:
    """A rank on each host (default: all) for the body; a rank's failure fails the test."""
    try:
        with host_ranks(bed, hosts=hosts, env=RANK_ENV, timeout=90) as ranks:
            yield ranks
    except RankError as e:
        pytest.fail(f"a host's rank failed: {e}", pytrace=False)
