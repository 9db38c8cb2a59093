"""fabric_lib: portable RDMA point-to-point transfers for LLM systems.

Importing this package needs neither CUDA nor an RDMA device.
"""

from __future__ import annotations

from ._loader import load_native

load_native()  # first: a missing libfabric gets an ImportError saying what to install

from ._rust import ENCODING_VERSION, engine_defaults, list_providers
from .engine import EngineAddress, MemoryRegion, MrDescriptor, Readmission, TransferEngine
from .errors import (
    CallbackThreadError,
    CudaError,
    CudaUnavailableError,
    EngineStoppedError,
    FabricError,
    FabricTimeoutError,
    InvalidArgumentError,
    InvalidDescriptorError,
    PeerFencedError,
    ProviderUnavailableError,
    TransferError,
)
from .imm_counter import ImmCounter

__all__ = [
    "ENCODING_VERSION",
    "CallbackThreadError",
    "CudaError",
    "CudaUnavailableError",
    "EngineAddress",
    "EngineStoppedError",
    "FabricError",
    "FabricTimeoutError",
    "ImmCounter",
    "InvalidArgumentError",
    "InvalidDescriptorError",
    "PeerFencedError",
    "MemoryRegion",
    "MrDescriptor",
    "ProviderUnavailableError",
    "Readmission",
    "TransferEngine",
    "TransferError",
    "engine_defaults",
    "list_providers",
]

__version__ = "0.1.0"
