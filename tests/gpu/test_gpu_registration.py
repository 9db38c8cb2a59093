"""How GPU memory is registered with the NIC on FI_HMEM providers: DMA-BUF (``FI_MR_DMABUF``,
libfabric 1.20 or newer) or by address with the CUDA interface, forced with ``gpu_registration``.

The option checks run everywhere. The transfers need a GPU and a libfabric whose ``shm`` has
FI_HMEM for CUDA (``scripts/build_libfabric.sh``; point ``LD_LIBRARY_PATH`` at it) and skip with
the reason otherwise. Two processes on one GPU talk through ``shm`` as two hosts would
(``force_network``): every byte goes through the provider and the registrations under test.
"""

from __future__ import annotations

import ctypes
import random
from collections.abc import Iterator
from contextlib import contextmanager

import fabric_lib
import fabric_lib.cuda as fcuda
import pytest
import torch
from fabric_lib.errors import CudaUnavailableError, InvalidArgumentError, ProviderUnavailableError
from fabric_lib.testing import spawn_ranks

TIMEOUT = 30.0
MODES = ["dmabuf", "cuda"]


def _engine(mode: str) -> fabric_lib.TransferEngine:
    return fabric_lib.TransferEngine(
        "shm",
        poll_mode="adaptive",
        gpu_network=True,
        force_network=True,
        gpu_registration=mode,  # type: ignore[arg-type]
        transfer_timeout=TIMEOUT,
    )


def _has_gpu() -> bool:
    try:
        return torch.cuda.is_available() and fcuda.device_count() > 0
    except CudaUnavailableError:
        return False


def test_gpu_registration_option_is_checked() -> None:
    assert fabric_lib.engine_defaults()["gpu_registration"] == "auto"
    with pytest.raises(InvalidArgumentError, match="gpu_registration"):
        fabric_lib.TransferEngine("tcp", gpu_registration="peermem")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="gpu_network=False"):
        fabric_lib.TransferEngine("tcp", gpu_registration="dmabuf", gpu_network=False)
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", gpu_registration="cuda") as e:
        region = e.register_buffer(bytearray(4096))
        assert region.registration == "host"


def _skip_unless_mode_works(mode: str) -> None:
    """Skips where the machine lacks what ``mode`` needs; any other refusal fails the test."""
    if not _has_gpu():
        pytest.skip("needs a CUDA GPU")
    with _engine("auto") as probe:
        if not probe.gpu_network:
            pytest.skip("this libfabric's shm has no FI_HMEM (build one with scripts/build_libfabric.sh)")
        region = probe.register_tensor(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
        if region.registration == "same-host":
            pytest.skip(
                "this libfabric's shm offers FI_HMEM but cannot register CUDA memory (built without CUDA)"
            )
    if mode != "dmabuf":
        return
    with _engine("dmabuf") as probe:
        try:
            region = probe.register_tensor(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
        except ProviderUnavailableError as e:
            if "1.20" in str(e) or "cannot export DMA-BUF" in str(e):
                pytest.skip(f"no DMA-BUF here: {e}")
            raise
        assert region.registration == "dmabuf"
        assert region.descriptor.network_reachable


class _Receiver:
    def __init__(self, mode: str, nbytes: int) -> None:
        self.engine = _engine(mode)
        self.dst = {
            "gpu": torch.zeros(nbytes, dtype=torch.uint8, device="cuda"),
            "host": torch.zeros(nbytes, dtype=torch.uint8),
        }
        self.regions = {k: self.engine.register_tensor(t) for k, t in self.dst.items()}
        torch.cuda.synchronize()


def open_receiver(mode: str, nbytes: int) -> _Receiver:
    return _Receiver(mode, nbytes)


def stop_receiver(rx: _Receiver) -> None:
    rx.engine.stop()


def describe(rx: _Receiver) -> dict[str, tuple[bytes, str]]:
    return {k: (r.descriptor.to_bytes(), r.registration) for k, r in rx.regions.items()}


def take(rx: _Receiver, imm: int, n: int, which: str, start: int, length: int) -> bytes:
    """Waits for ``n`` arrivals of ``imm``, returns ``[start, start+length)`` of a destination
    and zeroes it."""
    with rx.engine.imm_counter(imm) as c:
        c.wait(n, timeout=TIMEOUT)
    torch.cuda.synchronize()  # shm's CUDA IPC copies run on the legacy stream (docs/gpu.md)
    t = rx.dst[which]
    data = t[start : start + length].cpu().numpy().tobytes()
    t.zero_()
    torch.cuda.synchronize()
    return data


@pytest.mark.parametrize("mode", MODES)
def test_each_registration_mode_moves_gpu_memory_byte_exact(mode: str) -> None:
    _skip_unless_mode_works(mode)
    nbytes = 16 << 20
    with spawn_ranks(
        1,
        setup=open_receiver,
        setup_kwargs={"mode": mode, "nbytes": nbytes},
        teardown=stop_receiver,
        timeout=120,
    ) as (rx,):
        described = rx.call(describe)
        remote = {k: fabric_lib.MrDescriptor.from_bytes(d) for k, (d, _) in described.items()}
        assert described["gpu"][1] == mode and described["host"][1] == "host"
        with _engine(mode) as w:
            gen = torch.Generator().manual_seed(13)
            src_host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            src_gpu = src_host.to("cuda")
            regions = {"gpu": w.register_tensor(src_gpu), "host": w.register_tensor(src_host)}
            assert regions["gpu"].registration == mode
            torch.cuda.synchronize()
            rng = random.Random(17)
            imm = 400
            for src_kind, dst_kind in [("gpu", "gpu"), ("host", "gpu"), ("gpu", "host")]:
                for size in [1, 4095, 65537, 1 << 20, (4 << 20) + 123]:
                    src_off = rng.randrange(0, nbytes - size + 1)
                    dst_off = rng.randrange(0, nbytes - size + 1)
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
                    assert got == want, f"{mode}: {src_kind}->{dst_kind} {size} bytes at {src_off}->{dst_off}"
            # Paged 64 KiB GPU -> GPU, counted exactly.
            page, pages = 64 << 10, nbytes // (64 << 10)
            src_pages = [rng.randrange(pages) for _ in range(64)]
            dst_pages = rng.sample(range(pages), 64)
            pending = rx.submit(take, 900, 1, "gpu", 0, nbytes)
            w.submit_paged_writes(page, regions["gpu"], src_pages, remote["gpu"], dst_pages, imm=900).result(
                TIMEOUT
            )
            landed = torch.frombuffer(bytearray(pending.result(TIMEOUT + 10)), dtype=torch.uint8)
            for s, d in zip(src_pages, dst_pages, strict=True):
                assert torch.equal(landed[d * page : (d + 1) * page], src_host[s * page : (s + 1) * page])


@contextmanager
def _packed_allocation() -> Iterator[int]:
    """A raw ``cuMemAlloc`` of 1000 bytes whose allocation does not cover whole 4 KiB pages (the
    driver packs small allocations): DMA-BUF cannot export it."""
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    cuda = ctypes.CDLL("libcuda.so.1")
    ptrs: list[int] = []
    try:
        for _ in range(32):
            out = ctypes.c_uint64()
            assert cuda.cuMemAlloc_v2(ctypes.byref(out), ctypes.c_size_t(1000)) == 0
            ptrs.append(out.value)
        packed = []
        for p in ptrs:
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            assert (
                cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(p)) == 0
            )
            if base.value % 4096 or (base.value + size.value) % 4096:
                packed.append(p)  # the driver's allocation itself does not cover whole pages
        if not packed:
            pytest.skip("this driver gives every small allocation its own pages")
        yield packed[0]
    finally:
        for p in ptrs:
            cuda.cuMemFree_v2(ctypes.c_uint64(p))


def test_dmabuf_refusal_is_a_typed_error_and_auto_falls_back() -> None:
    _skip_unless_mode_works("dmabuf")
    with _packed_allocation() as ptr:
        with _engine("dmabuf") as e:
            with pytest.raises(ProviderUnavailableError, match="DMA-BUF") as refused:
                e.register_memory(ptr, 1000, device=0)
            assert "4096-byte pages" in str(refused.value), "the error names the cause"
        with _engine("auto") as e:
            region = e.register_memory(ptr, 1000, device=0)
            assert region.registration == "cuda", "auto falls back to the CUDA interface"
            assert region.descriptor.network_reachable
            e.unregister_memory(region)
        with _engine("auto") as e:
            region = e.register_tensor(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
            assert region.registration == "dmabuf", "auto prefers DMA-BUF where it works"
