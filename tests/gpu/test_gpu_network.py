"""GPU memory on the network path: FI_HMEM registration and the forced network path.

The option checks run everywhere; the transfers need a GPU and a libfabric whose ``shm`` has
FI_HMEM for CUDA (``scripts/build_libfabric.sh``; point ``LD_LIBRARY_PATH`` at it), and skip
with a reason otherwise. Two processes on one GPU talk through ``shm`` as two hosts would
(``force_network``), so every byte goes through the provider, not through CUDA IPC.
"""

from __future__ import annotations

import random

import fabric_lib
import fabric_lib.cuda as fcuda
import pytest
import torch
from fabric_lib.errors import CudaUnavailableError, ProviderUnavailableError
from fabric_lib.testing import spawn_ranks

TIMEOUT = 30.0


def _net_engine(mode: str = "auto") -> fabric_lib.TransferEngine:
    """An shm engine that registers GPU memory with the provider (``gpu_registration=mode``)
    and never takes CUDA IPC."""
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


def test_gpu_network_option_reaches_the_provider() -> None:
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", gpu_network=True) as e:
        assert not e.gpu_network, "tcp has no FI_HMEM"
    with fabric_lib.TransferEngine("shm", poll_mode="adaptive") as e:
        assert not e.gpu_network, "software providers use FI_HMEM only when asked"
    # Host memory still moves between engines that asked for FI_HMEM.
    with (
        fabric_lib.TransferEngine("shm", poll_mode="adaptive", gpu_network=True) as a,
        fabric_lib.TransferEngine("shm", poll_mode="adaptive", gpu_network=True) as b,
    ):
        src = torch.arange(4096, dtype=torch.int32)
        dst = torch.zeros(4096, dtype=torch.int32)
        region, remote = a.register_tensor(src), b.register_tensor(dst).descriptor
        with b.imm_counter(5) as counter:
            a.submit_write(region, remote, imm=5).result(timeout=TIMEOUT)
            counter.wait(1, timeout=TIMEOUT)
        assert torch.equal(src, dst)


def test_forced_network_path_refuses_unregistered_gpu_memory_with_a_reason() -> None:
    if not _has_gpu():
        pytest.skip("needs a CUDA GPU")
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", force_network=True) as a:
        src = a.register_tensor(torch.ones(4096, dtype=torch.uint8, device="cuda"))
        dst = a.register_tensor(torch.zeros(4096, dtype=torch.uint8)).descriptor
        with pytest.raises(ProviderUnavailableError, match="FI_HMEM"):
            a.submit_write(src, dst)


def skip_unless_gpu_network(mode: str = "auto") -> None:
    """Skips where the machine lacks what GPU memory on shm needs (with ``mode``); any other
    refusal fails the test."""
    if not _has_gpu():
        pytest.skip("needs a CUDA GPU")
    with _net_engine() as probe:
        if not probe.gpu_network:
            pytest.skip("this libfabric's shm has no FI_HMEM (build one with scripts/build_libfabric.sh)")
        region = probe.register_tensor(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
        if region.registration == "same-host":
            pytest.skip(
                "this libfabric's shm offers FI_HMEM but cannot register CUDA memory (built without CUDA)"
            )
    if mode != "dmabuf":
        return
    with _net_engine("dmabuf") as probe:
        try:
            region = probe.register_tensor(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
        except ProviderUnavailableError as e:
            if "1.20" in str(e) or "cannot export DMA-BUF" in str(e):
                pytest.skip(f"no DMA-BUF here: {e}")
            raise
        assert region.registration == "dmabuf"
        assert region.descriptor.network_reachable


class _Receiver:
    def __init__(self, nbytes: int, mode: str) -> None:
        self.engine = _net_engine(mode)
        self.dst = {
            "gpu": torch.zeros(nbytes, dtype=torch.uint8, device="cuda"),
            "host": torch.zeros(nbytes, dtype=torch.uint8),
        }
        self.regions = {k: self.engine.register_tensor(t) for k, t in self.dst.items()}
        torch.cuda.synchronize()


def open_receiver(nbytes: int, mode: str = "auto") -> _Receiver:
    return _Receiver(nbytes, mode)


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


@pytest.mark.parametrize("mode", ["dmabuf", "cuda"])
def test_gpu_memory_over_the_network_path(mode: str) -> None:
    """Every registration mode (``gpu_registration``) moves GPU memory byte-exact."""
    skip_unless_gpu_network(mode)
    nbytes = 32 << 20
    with spawn_ranks(
        1,
        setup=open_receiver,
        setup_kwargs={"nbytes": nbytes, "mode": mode},
        teardown=stop_receiver,
        timeout=120,
    ) as (rx,):
        described = rx.call(describe)
        remote = {k: fabric_lib.MrDescriptor.from_bytes(d) for k, (d, _) in described.items()}
        assert described["gpu"][1] == mode and described["host"][1] == "host"
        assert remote["gpu"].network_reachable, "the receiver's GPU region is registered with the NIC"
        with _net_engine(mode) as w:
            gen = torch.Generator().manual_seed(7)
            src_host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            src_gpu = src_host.to("cuda")
            regions = {"gpu": w.register_tensor(src_gpu), "host": w.register_tensor(src_host)}
            assert regions["gpu"].registration == mode
            torch.cuda.synchronize()
            rng = random.Random(11)
            imm = 300
            for src_kind, dst_kind in [("gpu", "gpu"), ("host", "gpu"), ("gpu", "host")]:
                for size in [0, 1, 4095, 1 << 20, 16 << 20]:
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
            # Paged 64 KiB GPU -> GPU, and 1000 consecutive requests counted exactly.
            page, pages = 64 << 10, 256
            src_pages = [rng.randrange(pages) for _ in range(128)]
            dst_pages = rng.sample(range(pages), 128)
            pending = rx.submit(take, 900, 1, "gpu", 0, page * pages)
            w.submit_paged_writes(page, regions["gpu"], src_pages, remote["gpu"], dst_pages, imm=900).result(
                TIMEOUT
            )
            landed = torch.frombuffer(bytearray(pending.result(TIMEOUT + 10)), dtype=torch.uint8)
            for s, d in zip(src_pages, dst_pages, strict=True):
                assert torch.equal(landed[d * page : (d + 1) * page], src_host[s * page : (s + 1) * page])
            pending = rx.submit(take, 901, 1000, "gpu", 0, 4096)
            futures = [
                w.submit_write(regions["gpu"], remote["gpu"], 4096, dst_offset=0, imm=901)
                for _ in range(1000)
            ]
            for f in futures:
                f.result(TIMEOUT)
            assert pending.result(TIMEOUT + 10) == src_host[:4096].numpy().tobytes()
