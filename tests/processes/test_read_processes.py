"""Reads between processes: a peer process opts a region in to remote reads, this process pulls
it (single and paged) over every loopback provider, byte-exact; a write-only region is refused
before anything is posted; a stopped owner makes reads time out and fences it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import fabric_lib
import numpy as np
import pytest
from fabric_lib.errors import FabricTimeoutError, PeerFencedError, RegionNotReadableError
from providers import provider_params

from .peer import Peer, PeerState, cached_pattern, peers

SIZE = 1 << 20


def expose(state: PeerState, seed: int, remote_read: bool) -> bytes:
    """In the peer: a second buffer of ``pattern(seed)``, registered (readable or not); returns
    its descriptor bytes."""
    buf = cached_pattern(seed, SIZE).copy()
    region = state.engine.register_memory(buf.ctypes.data, buf.nbytes, buf, remote_read=remote_read)
    state.extra.setdefault("exposed", []).append(region)
    return bytes(region.descriptor.to_bytes())


@pytest.fixture(scope="module", params=provider_params())
def owner(request: pytest.FixtureRequest) -> Iterator[Peer]:
    with peers(request.param, ["owner"]) as (peer,):
        yield peer


def test_reads_from_another_process_are_byte_exact(owner: Peer) -> None:
    desc = fabric_lib.MrDescriptor.from_bytes(owner.call(expose, seed=11, remote_read=True))
    expected = cached_pattern(11, SIZE)
    with fabric_lib.TransferEngine(owner.provider, poll_mode="adaptive", transfer_timeout=20.0) as e:
        local = np.zeros(SIZE, dtype=np.uint8)
        region = e.register_buffer(local)
        futures = [
            e.submit_read(desc, region, n, src_offset=s, dst_offset=d)
            for s, n, d in [(0, 1, 0), (5, 4095, 10), (65536, 300_000, 200_000), (SIZE - 7, 7, SIZE - 7)]
        ]
        for f in futures:
            f.result(timeout=30)
        assert np.array_equal(local[0:1], expected[0:1])
        assert np.array_equal(local[10:4105], expected[5:4100])
        assert np.array_equal(local[200_000:500_000], expected[65536:365_536])
        assert np.array_equal(local[SIZE - 7 :], expected[SIZE - 7 :])
        local[:] = 0
        pages = [9, 3, 200, 0, 77]
        e.submit_paged_reads(4096, desc, pages, region, [0, 1, 2, 3, 4], src_offset=1).result(timeout=30)
        for i, p in enumerate(pages):
            assert np.array_equal(
                local[i * 4096 : (i + 1) * 4096], expected[p * 4096 + 1 : (p + 1) * 4096 + 1]
            )
        assert not local[5 * 4096 :].any()

        write_only = fabric_lib.MrDescriptor.from_bytes(owner.call(expose, seed=12, remote_read=False))
        with pytest.raises(RegionNotReadableError):
            e.submit_read(write_only, region, 8)


def test_reads_from_a_stopped_owner_time_out_and_fence_it() -> None:
    with peers("tcp", ["owner"]) as (owner,):
        desc = fabric_lib.MrDescriptor.from_bytes(owner.call(expose, seed=3, remote_read=True))
        with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", transfer_timeout=2.0) as e:
            local = np.zeros(SIZE, dtype=np.uint8)
            region = e.register_buffer(local)
            e.submit_read(desc, region).result(timeout=10)
            os.kill(owner.pid, signal.SIGSTOP)
            try:
                with pytest.raises(FabricTimeoutError) as timed_out:
                    for _ in range(64):  # until the stopped owner's socket buffers no longer answer
                        e.submit_read(desc, region).result(timeout=10)
                assert not isinstance(timed_out.value, PeerFencedError)
                t = time.monotonic()
                with pytest.raises(PeerFencedError):
                    e.submit_read(desc, region).result(timeout=10)
                assert time.monotonic() - t < 1.0, "a fenced peer fails at once"
            finally:
                os.kill(owner.pid, signal.SIGCONT)
            assert e.readmit_peer(desc.owner).fenced
            local[:] = 0
            e.submit_read(desc, region).result(timeout=10)
            assert np.array_equal(local, cached_pattern(3, SIZE))
