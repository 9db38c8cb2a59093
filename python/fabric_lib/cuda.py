"""CUDA helpers of fabric_lib. Importing this module needs no CUDA; the functions load it on
first use and raise ``CudaUnavailableError`` (saying what is missing) where it is absent.

- ``is_available()`` / ``device_count()`` / ``kernels()``: what this process and build can do.
- ``SignalStream(device)``: a stream with fabric_lib's signalling kernels: ``write_u64(addr, v)``
  (a release store, e.g. into a UVM watcher) and ``flag_poll(flag_ptr, expected, timeout, slot)``
  (a kernel waiting on a GPU flag; ``status(slot)`` says seen/timed out).
- ``word_tensor(ptr, device)``: a one-element int64 CUDA tensor aliasing a watcher or flag word,
  so torch kernels (also captured in CUDA graphs) can write or read it.
"""

from __future__ import annotations

from typing import Any

from . import _rust
from .errors import CudaUnavailableError

SignalStream = _rust.SignalStream

__all__ = ["SignalStream", "device_count", "is_available", "kernels", "memory_kind", "word_tensor"]


def device_count() -> int:
    """Visible CUDA devices; raises ``CudaUnavailableError`` when the driver is missing."""
    return _rust.cuda_device_count()


def is_available() -> bool:
    """Whether the CUDA driver loads and sees at least one device."""
    try:
        return device_count() > 0
    except CudaUnavailableError:
        return False


def kernels() -> tuple[bool, str]:
    """(whether this build embeds the CUDA kernels, their architectures e.g. "sm_90a,sm_100a")."""
    return _rust.cuda_kernels()


def memory_kind(ptr: int) -> str:
    """ "host" or "cuda:N" for an address (does not load CUDA if this process has not)."""
    return _rust.memory_kind(ptr)


class _CudaArray:
    """Minimal ``__cuda_array_interface__`` exporter for an address torch should alias."""

    def __init__(self, ptr: int, numel: int, typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": (numel,),
            "typestr": typestr,
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def word_tensor(ptr: int, device: int = 0, numel: int = 1) -> Any:
    """An int64 CUDA tensor of ``numel`` words at device address ``ptr`` (a watcher's or flag's
    ``ptr``). The tensor does not own the memory: keep the watcher/flag alive while using it."""
    import torch

    with torch.cuda.device(device):
        return torch.as_tensor(_CudaArray(ptr, numel, "<i8"), device=f"cuda:{device}")
