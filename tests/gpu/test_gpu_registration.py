"""How GPU memory is registered with the NIC on FI_HMEM providers: DMA-BUF (``FI_MR_DMABUF``,
libfabric 1.20 or newer) or by address with the CUDA interface, forced with ``gpu_registration``.

The option checks run everywhere. The transfers need a GPU and a libfabric whose ``shm`` has
FI_HMEM for CUDA (``scripts/build_libfabric.sh``; point ``LD_LIBRARY_PATH`` at it) and skip with
the reason otherwise. The byte-exact transfers in each mode are in ``test_gpu_network.py``;
here: the option, and a refused DMA-BUF export (typed error; "auto" falls back).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager

import fabric_lib
import pytest
import torch
from fabric_lib.errors import InvalidArgumentError, ProviderUnavailableError

from .test_gpu_network import _net_engine, skip_unless_gpu_network


def test_gpu_registration_option_is_checked() -> None:
    assert fabric_lib.engine_defaults()["gpu_registration"] == "auto"
    with pytest.raises(InvalidArgumentError, match="gpu_registration"):
        fabric_lib.TransferEngine("tcp", gpu_registration="peermem")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="gpu_network=False"):
        fabric_lib.TransferEngine("tcp", gpu_registration="dmabuf", gpu_network=False)
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", gpu_registration="cuda") as e:
        region = e.register_buffer(bytearray(4096))
        assert region.registration == "host"


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
    skip_unless_gpu_network("dmabuf")
    with _packed_allocation() as ptr:
        with _net_engine("dmabuf") as e:
            with pytest.raises(ProviderUnavailableError, match="DMA-BUF") as refused:
                e.register_memory(ptr, 1000, device=0)
            assert "4096-byte pages" in str(refused.value), "the error names the cause"
        with _net_engine("auto") as e:
            region = e.register_memory(ptr, 1000, device=0)
            assert region.registration == "cuda", "auto falls back to the CUDA interface"
            assert region.descriptor.network_reachable
            e.unregister_memory(region)
        with _net_engine("auto") as e:
            region = e.register_tensor(torch.zeros(1 << 20, dtype=torch.uint8, device="cuda"))
            assert region.registration == "dmabuf", "auto prefers DMA-BUF where it works"
