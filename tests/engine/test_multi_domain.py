"""Engines with several domains (two loopback "NICs") in one process: sharding, paged writes,
scatter and barrier, with every byte and every immediate count checked."""

from __future__ import annotations

import time

import fabric_lib
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.fixture(scope="module")
def trio():
    engines = [
        fabric_lib.TransferEngine("tcp", ["lo", "lo"], poll_mode="adaptive", shard_min_bytes=0)
        for _ in range(3)
    ]
    yield engines
    for e in engines:
        e.stop()


def _settle_and_assert_no_extra(engine: fabric_lib.TransferEngine, imms: list[int]) -> None:
    time.sleep(0.05)
    for imm in imms:
        assert engine.imm_counter(imm).value == 0, f"extra arrivals of immediate {imm}"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    page_len=st.sampled_from([1, 64, 1000, 4096, 16384]),
    pages=st.lists(st.integers(0, 63), min_size=1, max_size=64, unique=True),
    src_extra=st.integers(0, 100),
    dst_extra=st.integers(0, 100),
    seed=st.integers(0, 2**31),
)
def test_paged_writes_property(trio, page_len, pages, src_extra, dst_extra, seed) -> None:
    a, b, _ = trio
    gen = torch.Generator().manual_seed(seed)
    src_stride, dst_stride = page_len + src_extra, page_len + dst_extra
    src = torch.randint(0, 256, (64 * src_stride + 7,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(64 * dst_stride + 5, dtype=torch.uint8)
    dst_pages = torch.randperm(64, generator=gen)[: len(pages)].tolist()
    rs, rd = a.register_tensor(src), b.register_tensor(dst)
    try:
        imm = seed & 0xFFFF
        with b.imm_counter(imm) as counter:
            a.submit_paged_writes(
                page_len,
                rs,
                pages,
                rd.descriptor,
                dst_pages,
                src_stride=src_stride,
                src_offset=3,
                dst_stride=dst_stride,
                dst_offset=2,
                imm=imm,
            ).result(timeout=30)
            counter.wait(1, timeout=30)
            _settle_and_assert_no_extra(b, [imm])
        expected = torch.zeros_like(dst)
        for s, d in zip(pages, dst_pages):
            expected[d * dst_stride + 2 : d * dst_stride + 2 + page_len] = src[
                s * src_stride + 3 : s * src_stride + 3 + page_len
            ]
        assert torch.equal(dst, expected)
    finally:
        a.unregister_memory(rs)
        b.unregister_memory(rd)


@pytest.mark.parametrize("length", [1, 8191, 16384, 1 << 20, (3 << 20) + 5])
@pytest.mark.parametrize("shard_domains", [1, 2])
def test_sharded_single_write(trio, length, shard_domains) -> None:
    a, b, _ = trio
    src = torch.randint(0, 256, (length + 9,), dtype=torch.uint8)
    dst = torch.zeros(length + 4, dtype=torch.uint8)
    rs, rd = a.register_tensor(src), b.register_tensor(dst)
    with b.imm_counter(500) as counter:
        a.submit_write(
            rs, rd.descriptor, length, src_offset=9, dst_offset=4, imm=500, shard_domains=shard_domains
        ).result(timeout=30)
        counter.wait(1, timeout=30)
        _settle_and_assert_no_extra(b, [500])
    assert torch.equal(dst[4:], src[9:])


def test_pinned_domain_and_out_of_range_domain(trio) -> None:
    a, b, _ = trio
    src, dst = torch.ones(1 << 20, dtype=torch.uint8), torch.zeros(1 << 20, dtype=torch.uint8)
    rs, rd = a.register_tensor(src), b.register_tensor(dst)
    with b.imm_counter(71) as counter:
        a.submit_write(rs, rd.descriptor, domain=1, imm=71).result(timeout=30)
        counter.wait(1, timeout=30)
    assert torch.equal(src, dst)
    with pytest.raises(fabric_lib.InvalidArgumentError, match="domain 2 out of range"):
        a.submit_write(rs, rd.descriptor, domain=2)


@pytest.mark.parametrize("shard_by", ["peer", "bytes"])
def test_scatter_and_barrier(trio, shard_by) -> None:
    a, b, c = trio
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    db, dc = torch.zeros(2 << 20, dtype=torch.uint8), torch.zeros(2 << 20, dtype=torch.uint8)
    rs, rb, rc = a.register_tensor(src), b.register_tensor(db), c.register_tensor(dc)
    group = a.add_peer_group([b.main_address, c.main_address])
    counters = [e.imm_counter(imm) for e in (b, c) for imm in (61, 62)]
    targets = [(1 << 20, 5, rb.descriptor, 100), ((1 << 20) + 77, 1 << 20, rc.descriptor, 0)]
    a.submit_scatter(rs, targets, imm=61, group=group, shard_by=shard_by).result(timeout=30)
    a.submit_barrier(62, group).result(timeout=30)
    for counter in counters:
        counter.wait(1, timeout=30)
    for e in (b, c):
        _settle_and_assert_no_extra(e, [61, 62])
    assert torch.equal(db[100 : 100 + (1 << 20)], src[5 : 5 + (1 << 20)])
    assert torch.equal(dc[: (1 << 20) + 77], src[1 << 20 : (2 << 20) + 77])
    for counter in counters:
        counter.close()


def test_multi_domain_bad_input(trio) -> None:
    a, b, _ = trio
    src, dst = torch.zeros(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
    rs, rd = a.register_tensor(src), b.register_tensor(dst)
    with pytest.raises(fabric_lib.InvalidArgumentError, match="page index 4"):
        a.submit_paged_writes(1024, rs, [0, 4], rd.descriptor, [0, 1])
    with pytest.raises(fabric_lib.InvalidArgumentError, match="destination page index 9"):
        a.submit_paged_writes(1024, rs, [0, 1], rd.descriptor, [9, 1])
    with pytest.raises(fabric_lib.InvalidArgumentError, match="empty page list"):
        a.submit_paged_writes(1024, rs, [], rd.descriptor, [])
    with pytest.raises(fabric_lib.InvalidArgumentError, match="2 source pages but 1"):
        a.submit_paged_writes(1024, rs, [0, 1], rd.descriptor, [0])
    with fabric_lib.TransferEngine("tcp", "lo", poll_mode="adaptive") as single:
        other = single.register_tensor(torch.zeros(4096, dtype=torch.uint8))
        with pytest.raises(fabric_lib.InvalidDescriptorError, match="same number"):
            a.submit_write(rs, other.descriptor, 16)
        with pytest.raises(fabric_lib.InvalidDescriptorError, match="same number"):
            a.add_peer_group([single.main_address])
    with pytest.raises(fabric_lib.InvalidArgumentError, match="does not exist"):
        a.submit_barrier(1, 987654)


def test_detect_topology_and_auto_pin() -> None:
    topo = fabric_lib.TransferEngine.detect_topology({"host": ["lo"]})
    host = topo.device("host")
    assert host.nics == ["lo"] and host.cpus, topo
    with fabric_lib.TransferEngine("tcp", "lo", poll_mode="adaptive", worker_cpu="auto") as e:
        assert e.num_domains == 1
