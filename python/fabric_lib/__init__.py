"""fabric_lib: portable RDMA point-to-point transfers for LLM systems.

Importing this package needs neither CUDA nor an RDMA device.
"""

from __future__ import annotations

from ._rust import ENCODING_VERSION, engine_defaults, list_providers
from .engine import EngineAddress, MemoryRegion, MrDescriptor, TransferEngine
from .errors import (
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
    "TransferEngine",
    "TransferError",
    "engine_defaults",
    "list_providers",
]

__version__ = "0.1.0"
