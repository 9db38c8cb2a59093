"""Same-host reads where GPU memory is on either side (CUDA IPC; ``process_vm_readv`` for a peer's
host memory): single and paged, in one process and from another process, byte-exact.

Marked ``gpu``; every test skips with a reason where CUDA is missing.
"""

from __future__ import annotations

import random

import fabric_lib
import fabric_lib.cuda as fcuda
import pytest
import torch
from fabric_lib.errors import CudaUnavailableError, RegionNotReadableError
from fabric_lib.testing import spawn_ranks


def _num_gpus() -> int:
    if not torch.cuda.is_available():
        return 0
    try:
        return fcuda.device_count()
    except CudaUnavailableError:
        return 0


NGPU = _num_gpus()
needs_gpu = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU (none visible)")
needs_kernels = pytest.mark.skipif(
    not fcuda.kernels()[0], reason="this build carries no CUDA kernels (no nvcc)"
)

TIMEOUT = 30.0
PAGE, PAGES = 4096, 64
NBYTES = PAGE * PAGES


def _engine() -> fabric_lib.TransferEngine:
    return fabric_lib.TransferEngine("tcp", "lo", transfer_timeout=TIMEOUT)


def _rand_bytes(n: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def _expected_pages(src: torch.Tensor, src_pages: list[int], dst_pages: list[int]) -> torch.Tensor:
    out = torch.zeros(NBYTES, dtype=torch.uint8)
    s = src.cpu()
    for a, b in zip(src_pages, dst_pages):
        out[b * PAGE : (b + 1) * PAGE] = s[a * PAGE : (a + 1) * PAGE]
    return out


def _read_and_check(
    reader: fabric_lib.TransferEngine,
    name: str,
    src_desc: fabric_lib.MrDescriptor,
    src: torch.Tensor,
    dst_r: fabric_lib.MemoryRegion,
    dst: torch.Tensor,
    rng: random.Random,
) -> None:
    dst.zero_()
    torch.cuda.synchronize()
    n = PAGE * 3 + 5
    reader.submit_read(src_desc, dst_r, n, src_offset=7, dst_offset=11).result(TIMEOUT)
    torch.cuda.synchronize()
    got = dst.cpu()
    assert torch.equal(got[11 : 11 + n], src.cpu()[7 : 7 + n]), name
    assert got[:11].eq(0).all() and got[11 + n :].eq(0).all(), name
    dst.zero_()
    torch.cuda.synchronize()
    count = rng.randint(1, PAGES)
    dst_pages = rng.sample(range(PAGES), count)
    src_pages = [rng.randrange(PAGES) for _ in range(count)]
    reader.submit_paged_reads(PAGE, src_desc, src_pages, dst_r, dst_pages).result(TIMEOUT)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), _expected_pages(src, src_pages, dst_pages)), f"{name} (paged)"


@needs_gpu
@needs_kernels
@pytest.mark.gpu
def test_one_gpu_same_process_reads_in_every_direction() -> None:
    owner, reader = _engine(), _engine()
    try:
        src_gpu, src_host = _rand_bytes(NBYTES, "cuda:0", 1), _rand_bytes(NBYTES, "cpu", 2)
        dst_gpu = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda:0")
        dst_host = torch.zeros(NBYTES, dtype=torch.uint8)
        gpu_desc = owner.register_tensor(src_gpu, remote_read=True).descriptor
        host_desc = owner.register_tensor(src_host, remote_read=True).descriptor
        dst_gpu_r, dst_host_r = reader.register_tensor(dst_gpu), reader.register_tensor(dst_host)
        torch.cuda.synchronize()
        rng = random.Random(7)
        for name, desc, src, dst_r, dst in [
            ("gpu->gpu", gpu_desc, src_gpu, dst_gpu_r, dst_gpu),
            ("host->gpu", host_desc, src_host, dst_gpu_r, dst_gpu),
            ("gpu->host", gpu_desc, src_gpu, dst_host_r, dst_host),
        ]:
            _read_and_check(reader, name, desc, src, dst_r, dst, rng)
        write_only = owner.register_tensor(torch.zeros(64, dtype=torch.uint8, device="cuda:0"))
        with pytest.raises(RegionNotReadableError):
            reader.submit_read(write_only.descriptor, dst_gpu_r, 8)
    finally:
        owner.stop()
        reader.stop()


class _Owner:
    """The owning process's engine and readable source tensors (GPU and host)."""

    def __init__(self, device: int) -> None:
        torch.cuda.set_device(device)
        self.engine = _engine()
        self.src = {"gpu": _rand_bytes(NBYTES, f"cuda:{device}", 3), "host": _rand_bytes(NBYTES, "cpu", 4)}
        self.regions = {w: self.engine.register_tensor(t, remote_read=True) for w, t in self.src.items()}
        torch.cuda.synchronize()


def open_owner(device: int) -> _Owner:
    return _Owner(device)


def stop_owner(owner: _Owner) -> None:
    owner.engine.stop()


def owner_descriptors(owner: _Owner) -> tuple[bytes, bytes]:
    return owner.regions["gpu"].descriptor.to_bytes(), owner.regions["host"].descriptor.to_bytes()


@needs_gpu
@needs_kernels
@pytest.mark.gpu
def test_reads_from_another_process_on_this_host() -> None:
    """The owner process's GPU memory through CUDA IPC, its host memory through process_vm_readv."""
    device = 1 if NGPU > 1 else 0
    with spawn_ranks(
        1, setup=open_owner, setup_kwargs={"device": device}, teardown=stop_owner, timeout=120
    ) as (owner,):
        gpu_desc, host_desc = (fabric_lib.MrDescriptor.from_bytes(b) for b in owner.call(owner_descriptors))
        src_gpu = _rand_bytes(NBYTES, "cpu", 3)
        src_host = _rand_bytes(NBYTES, "cpu", 4)
        reader = _engine()
        try:
            dst_gpu = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda:0")
            dst_host = torch.zeros(NBYTES, dtype=torch.uint8)
            dst_gpu_r, dst_host_r = reader.register_tensor(dst_gpu), reader.register_tensor(dst_host)
            torch.cuda.synchronize()
            rng = random.Random(9)
            for _ in range(4):
                for name, desc, src, dst_r, dst in [
                    ("peer gpu->gpu", gpu_desc, src_gpu, dst_gpu_r, dst_gpu),
                    ("peer host->gpu", host_desc, src_host, dst_gpu_r, dst_gpu),
                    ("peer gpu->host", gpu_desc, src_gpu, dst_host_r, dst_host),
                ]:
                    _read_and_check(reader, name, desc, src, dst_r, dst, rng)
        finally:
            reader.stop()
