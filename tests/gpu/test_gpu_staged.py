"""Staged transfers: GPU memory over tcp, which has no FI_HMEM, through host memory.

Two processes on one GPU talk through ``tcp`` as two hosts would (``force_network``): a GPU
source is copied into the writer's pinned bounce buffers, a GPU destination receives into the
receiver's landing area and is copied into place by its worker. Every check is byte-exact and
every immediate count exact. Needs a CUDA GPU (skips otherwise); any libfabric works.
"""

from __future__ import annotations

import random
import time

import fabric_lib
import fabric_lib.cuda as fcuda
import pytest
import torch
from fabric_lib.errors import (
    CudaUnavailableError,
    EngineStoppedError,
    FabricTimeoutError,
    ProviderUnavailableError,
    TransferError,
)
from fabric_lib.testing import spawn_ranks

TIMEOUT = 30.0
NBYTES = 32 << 20
# 1 MiB chunks: the sizes below cross several chunks, and end inside one.
CHUNK = 1 << 20


def _staged_engine(transfer_timeout: float = TIMEOUT, staging: bool = True) -> fabric_lib.TransferEngine:
    """A tcp engine that sends GPU transfers over the provider even on this host; staging on
    (small chunks) or off."""
    sizes = {"staging_chunk_bytes": CHUNK, "staging_slots": 8} if staging else {"staging": False}
    return fabric_lib.TransferEngine(
        "tcp",
        poll_mode="adaptive",
        force_network=True,
        transfer_timeout=transfer_timeout,
        **sizes,  # type: ignore[arg-type]
    )


def _skip_without_gpu() -> None:
    try:
        if torch.cuda.is_available() and fcuda.device_count() > 0:
            return
    except CudaUnavailableError:
        pass
    pytest.skip("needs a CUDA GPU")


class _Receiver:
    def __init__(self, nbytes: int, transfer_timeout: float) -> None:
        self.engine = _staged_engine(transfer_timeout)
        self.dst = {
            "gpu": torch.zeros(nbytes, dtype=torch.uint8, device="cuda"),
            "host": torch.zeros(nbytes, dtype=torch.uint8),
        }
        self.regions = {k: self.engine.register_tensor(t) for k, t in self.dst.items()}
        torch.cuda.synchronize()


def open_receiver(nbytes: int, transfer_timeout: float = TIMEOUT) -> _Receiver:
    return _Receiver(nbytes, transfer_timeout)


def stop_receiver(rx: _Receiver) -> None:
    rx.engine.stop()


def describe(rx: _Receiver) -> dict[str, bytes]:
    return {k: r.descriptor.to_bytes() for k, r in rx.regions.items()}


def staging_stats(rx: _Receiver) -> tuple[int, int, int, int]:
    s = rx.engine.staging_stats
    return (s.requests_sent, s.bounced_bytes, s.requests_landed, s.landed_bytes)


def take(rx: _Receiver, imm: int, n: int, which: str, start: int, length: int) -> bytes:
    """Waits for ``n`` arrivals of ``imm``, then checks none more came, returns
    ``[start, start+length)`` of a destination and zeroes it."""
    with rx.engine.imm_counter(imm) as c:
        c.wait(n, timeout=TIMEOUT)  # consumes the n arrivals
        time.sleep(0.05)
        assert c.value == 0, f"imm {imm} counted {n + c.value} times, expected {n}"
    # The immediate is counted after the staged copies completed: no synchronize needed for
    # the bytes; this one only orders the read and the zeroing below on torch's stream.
    t = rx.dst[which]
    data = t[start : start + length].cpu().numpy().tobytes()
    t.zero_()
    torch.cuda.synchronize()
    return data


def test_gpu_regions_say_they_are_reached_staged_and_staging_can_be_turned_off() -> None:
    _skip_without_gpu()
    with _staged_engine() as e:
        assert e.staging, "tcp has no FI_HMEM: staging is the default"
        region = e.register_tensor(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
        assert region.descriptor.staged_reachable
        assert not region.descriptor.network_reachable
        assert region.registration == "staged"
        host = e.register_tensor(torch.zeros(1 << 20, dtype=torch.uint8))
        assert not host.descriptor.staged_reachable, "host memory needs no landing area"
    with _staged_engine(staging=False) as e:
        assert not e.staging
        src = e.register_tensor(torch.ones(4096, dtype=torch.uint8, device="cuda"))
        assert not src.descriptor.staged_reachable
        assert src.registration == "same-host"
        dst = e.register_tensor(torch.zeros(4096, dtype=torch.uint8)).descriptor
        with pytest.raises(ProviderUnavailableError, match="FI_HMEM"):
            e.submit_write(src, dst)


def test_gpu_memory_crosses_tcp_staged_byte_exact() -> None:
    _skip_without_gpu()
    with spawn_ranks(
        1, setup=open_receiver, setup_kwargs={"nbytes": NBYTES}, teardown=stop_receiver, timeout=120
    ) as (rx,):
        remote = {k: fabric_lib.MrDescriptor.from_bytes(d) for k, d in rx.call(describe).items()}
        assert remote["gpu"].staged_reachable and not remote["gpu"].network_reachable
        with _staged_engine() as w:
            gen = torch.Generator().manual_seed(7)
            src_host = torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, generator=gen)
            src_gpu = src_host.to("cuda")
            regions = {"gpu": w.register_tensor(src_gpu), "host": w.register_tensor(src_host)}
            torch.cuda.synchronize()
            rng = random.Random(11)
            imm = 300
            sizes = [0, 1, 4095, CHUNK, CHUNK + 7, 5 * CHUNK + 123, 16 << 20]
            sizes += [rng.randrange(1, 12 << 20) for _ in range(6)]
            for src_kind, dst_kind in [("gpu", "gpu"), ("host", "gpu"), ("gpu", "host")]:
                for size in sizes:
                    src_off = rng.randrange(0, NBYTES - size + 1)
                    dst_off = rng.randrange(0, NBYTES - size + 1)
                    imm += 1
                    pending = rx.submit(take, imm, 1, dst_kind, dst_off, size)
                    w.submit_write(
                        regions[src_kind],
                        remote[dst_kind],
                        size,
                        src_offset=src_off,
                        dst_offset=dst_off,
                        imm=imm,
                    ).result(timeout=TIMEOUT)
                    got = pending.result(TIMEOUT + 10)
                    want = src_host[src_off : src_off + size].numpy().tobytes()
                    assert got == want, f"{src_kind}->{dst_kind}: {size} bytes at {src_off}->{dst_off}"
            sent = w.staging_stats
            assert sent.requests_sent > 0 and sent.bounced_bytes > 0, sent
            _, _, landed_requests, landed_bytes = rx.call(staging_stats)
            assert landed_requests > 0 and landed_bytes > 0

            # Paged GPU -> GPU: 64 KiB pages, then odd 3000-byte pages at odd strides and offsets.
            page, pages = 64 << 10, 256
            src_pages = [rng.randrange(pages) for _ in range(128)]
            dst_pages = rng.sample(range(pages), 128)
            pending = rx.submit(take, 900, 1, "gpu", 0, page * pages)
            w.submit_paged_writes(page, regions["gpu"], src_pages, remote["gpu"], dst_pages, imm=900).result(
                TIMEOUT
            )
            landed = torch.frombuffer(bytearray(pending.result(TIMEOUT + 10)), dtype=torch.uint8)
            for s, d in zip(src_pages, dst_pages, strict=True):
                assert torch.equal(landed[d * page : (d + 1) * page], src_host[s * page : (s + 1) * page]), (
                    f"64 KiB page {s} -> {d}"
                )
            page, stride, src_offset, dst_offset = 3000, 3001, 5, 11
            src_pages = [rng.randrange(2000) for _ in range(700)]
            dst_pages = rng.sample(range(2000), 700)
            span = dst_offset + 2000 * stride
            pending = rx.submit(take, 901, 1, "gpu", 0, span)
            w.submit_paged_writes(
                page,
                regions["gpu"],
                src_pages,
                remote["gpu"],
                dst_pages,
                src_stride=stride,
                src_offset=src_offset,
                dst_stride=stride,
                dst_offset=dst_offset,
                imm=901,
            ).result(TIMEOUT)
            landed = torch.frombuffer(bytearray(pending.result(TIMEOUT + 10)), dtype=torch.uint8)
            for s, d in zip(src_pages, dst_pages, strict=True):
                got_page = landed[dst_offset + d * stride : dst_offset + d * stride + page]
                want_page = src_host[src_offset + s * stride : src_offset + s * stride + page]
                assert torch.equal(got_page, want_page), f"3000-byte page {s} -> {d}"


def test_a_thousand_consecutive_staged_requests_are_counted_exactly() -> None:
    _skip_without_gpu()
    with spawn_ranks(
        1, setup=open_receiver, setup_kwargs={"nbytes": 1 << 20}, teardown=stop_receiver, timeout=120
    ) as (rx,):
        remote = fabric_lib.MrDescriptor.from_bytes(rx.call(describe)["gpu"])
        with _staged_engine() as w:
            src_host = torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8)
            region = w.register_tensor(src_host.to("cuda"))
            torch.cuda.synchronize()
            pending = rx.submit(take, 902, 1000, "gpu", 0, 8192)
            futures = [w.submit_write(region, remote, 8192, imm=902) for _ in range(1000)]
            for f in futures:
                f.result(TIMEOUT)
            assert pending.result(TIMEOUT + 10) == src_host[:8192].numpy().tobytes()


def test_a_killed_receiver_fails_staged_writes_with_typed_errors_and_no_hang() -> None:
    _skip_without_gpu()
    short = 5.0
    with spawn_ranks(
        1,
        setup=open_receiver,
        setup_kwargs={"nbytes": NBYTES, "transfer_timeout": short},
        teardown=stop_receiver,
        timeout=120,
    ) as (rx,):
        remote = fabric_lib.MrDescriptor.from_bytes(rx.call(describe)["gpu"])
        with _staged_engine(transfer_timeout=short) as w:
            region = w.register_tensor(torch.ones(NBYTES, dtype=torch.uint8, device="cuda"))
            torch.cuda.synchronize()
            # Many chunks in flight, then the receiver dies mid-transfer.
            futures = [w.submit_write(region, remote, NBYTES, imm=5) for _ in range(8)]
            rx.kill()
            started = time.monotonic()
            for f in futures:
                try:
                    f.result(timeout=short + 20)
                except (FabricTimeoutError, TransferError, EngineStoppedError):
                    pass  # typed errors: the point of the test
            assert time.monotonic() - started < short + 20, "staged writes to a dead receiver hung"
            assert any(f.exception() is not None for f in futures), "nothing failed after the receiver died"
            # Everything settled: the source region can be released.
            deadline = time.monotonic() + TIMEOUT
            while True:
                try:
                    w.unregister_memory(region)
                    break
                except fabric_lib.errors.InvalidArgumentError:
                    assert time.monotonic() < deadline, "the staged requests never released their source"
                    time.sleep(0.05)
