"""Reads (``submit_read``, ``submit_paged_reads``) between two engines of this process over every
loopback provider: byte-exact under hypothesis, completion means the bytes are local, and bad
input (ranges, unregistered or write-only regions) is a typed error with nothing read."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import fabric_lib
import numpy as np
import pytest
from fabric_lib.errors import InvalidArgumentError, InvalidDescriptorError, RegionNotReadableError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from providers import provider_params

SIZE = 1 << 16
GUARD = 0x5A

Pair = tuple[fabric_lib.TransferEngine, fabric_lib.TransferEngine]


@pytest.fixture(scope="module", params=provider_params())
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    a = fabric_lib.TransferEngine(request.param, poll_mode="adaptive", transfer_timeout=20.0)
    b = fabric_lib.TransferEngine(request.param, poll_mode="adaptive", transfer_timeout=20.0)
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture(scope="module")
def regions(
    pair: Pair,
) -> Iterator[tuple[np.ndarray, fabric_lib.MemoryRegion, np.ndarray, fabric_lib.MemoryRegion]]:
    """The owner's readable region (random bytes) and the reader's local region."""
    a, b = pair
    remote = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    local = np.zeros(SIZE, dtype=np.uint8)
    r_remote = b.register_buffer(remote, remote_read=True)
    r_local = a.register_buffer(local)
    yield remote, r_remote, local, r_local
    a.unregister_memory(r_local)
    b.unregister_memory(r_remote)


_SETTINGS = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_SETTINGS
@given(
    length=st.integers(1, SIZE),
    src_frac=st.floats(0, 1),
    dst_frac=st.floats(0, 1),
)
def test_reads_are_byte_exact(pair: Pair, regions, length: int, src_frac: float, dst_frac: float) -> None:
    a, _ = pair
    remote, r_remote, local, r_local = regions
    src_offset = int((SIZE - length) * src_frac)
    dst_offset = int((SIZE - length) * dst_frac)
    local[:] = 0
    a.submit_read(r_remote.descriptor, r_local, length, src_offset=src_offset, dst_offset=dst_offset).result(
        timeout=30
    )
    assert np.array_equal(local[dst_offset : dst_offset + length], remote[src_offset : src_offset + length])
    assert not local[:dst_offset].any() and not local[dst_offset + length :].any(), "bytes outside the range"


@_SETTINGS
@given(
    page_len=st.sampled_from([1, 64, 1000, 4096]),
    pages=st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True),
    src_extra=st.integers(0, 50),
    dst_extra=st.integers(0, 50),
    order=st.randoms(use_true_random=False),
)
def test_paged_reads_are_byte_exact(
    pair: Pair, regions, page_len, pages, src_extra, dst_extra, order
) -> None:
    a, _ = pair
    remote, r_remote, local, r_local = regions
    src_stride, dst_stride = page_len + src_extra, page_len + dst_extra
    dst_pages = list(range(8))
    order.shuffle(dst_pages)
    dst_pages = dst_pages[: len(pages)]
    local[:] = 0
    a.submit_paged_reads(
        page_len,
        r_remote.descriptor.to_bytes(),  # any Destination form names the peer region
        pages,
        r_local,
        dst_pages,
        src_stride=src_stride,
        src_offset=3,
        dst_stride=dst_stride,
        dst_offset=2,
    ).result(timeout=30)
    expected = np.zeros_like(local)
    for s, d in zip(pages, dst_pages):
        so, do = s * src_stride + 3, d * dst_stride + 2
        expected[do : do + page_len] = remote[so : so + page_len]
    assert np.array_equal(local, expected)


def test_default_length_fills_the_local_region_and_callbacks_report(pair: Pair) -> None:
    a, b = pair
    remote = np.arange(4096, dtype=np.uint8)
    local = np.zeros(1000, dtype=np.uint8)
    r_remote, r_local = b.register_buffer(remote, remote_read=True), a.register_buffer(local)
    try:
        assert r_remote.descriptor.remote_readable
        got: list[BaseException | None] = []
        done = threading.Event()

        def on_done(e: BaseException | None) -> None:
            got.append(e)
            done.set()

        assert a.submit_read(r_remote.descriptor, r_local, src_offset=100, on_done=on_done) is None
        assert done.wait(30) and got == [None]
        assert np.array_equal(local, remote[100:1100])
    finally:
        a.unregister_memory(r_local)
        b.unregister_memory(r_remote)


def test_bad_reads_are_typed_errors_and_read_nothing(pair: Pair) -> None:
    a, b = pair
    # The peer region sits between guard bytes of one allocation; the reader's region too.
    peer = np.full(3 * 4096, GUARD, dtype=np.uint8)
    peer[4096:8192] = 7
    mine = np.zeros(3 * 4096, dtype=np.uint8)
    readable = b.register_memory(peer[4096:].ctypes.data, 4096, peer, remote_read=True)
    write_only = b.register_memory(peer[8192:].ctypes.data, 4096, peer)
    local = a.register_memory(mine[4096:].ctypes.data, 4096, mine)
    try:
        assert not write_only.descriptor.remote_readable
        with pytest.raises(RegionNotReadableError):
            a.submit_read(write_only.descriptor, local, 8)
        with pytest.raises(InvalidArgumentError):
            a.submit_read(readable.descriptor, local, 4096, src_offset=1)  # past the peer's end
        with pytest.raises(InvalidArgumentError):
            a.submit_read(readable.descriptor, local, 4096, dst_offset=1)  # past the local end
        with pytest.raises(InvalidArgumentError):
            a.submit_read(readable.descriptor, local, -1)
        with pytest.raises(InvalidArgumentError):
            a.submit_paged_reads(1024, readable.descriptor, [4], local, [0])
        with pytest.raises(InvalidArgumentError):
            a.submit_paged_reads(1024, readable.descriptor, [0], local, [4])
        with pytest.raises(InvalidArgumentError):  # a descriptor is not a local region
            a.submit_read(readable.descriptor, readable.descriptor, 8)  # type: ignore[call-overload]
        with pytest.raises(InvalidDescriptorError):
            a.submit_read(b"not a descriptor", local, 8)
        stale = b.register_memory(peer.ctypes.data, 4096, peer, remote_read=True)
        a.unregister_memory(local)
        with pytest.raises(InvalidArgumentError):  # unregistered local region
            a.submit_read(stale.descriptor, local, 8)
        b.unregister_memory(stale)
        assert not mine.any(), "a refused read brought bytes home"
    finally:
        b.unregister_memory(readable)
        b.unregister_memory(write_only)


def test_reads_shard_over_several_domains() -> None:
    """Two loopback "NICs": large reads are cut over both domains, pages spread over them,
    byte-exact."""
    a, b = (
        fabric_lib.TransferEngine("tcp", ["lo", "lo"], poll_mode="adaptive", shard_min_bytes=0) for _ in "ab"
    )
    try:
        remote = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
        local = np.zeros(1 << 20, dtype=np.uint8)
        r_remote, r_local = b.register_buffer(remote, remote_read=True), a.register_buffer(local)
        a.submit_read(r_remote, r_local, (1 << 20) - 10, src_offset=10).result(timeout=30)
        assert np.array_equal(local[: (1 << 20) - 10], remote[10:])
        local[:] = 0
        a.submit_paged_reads(4096, r_remote, list(range(0, 256, 2)), r_local, list(range(128))).result(
            timeout=30
        )
        for i in range(128):
            assert np.array_equal(local[i * 4096 : (i + 1) * 4096], remote[2 * i * 4096 : (2 * i + 1) * 4096])
    finally:
        a.stop()
        b.stop()
