"""Exception hierarchy of fabric_lib. Every error the native core reports is one of these."""

from __future__ import annotations

__all__ = [
    "CallbackThreadError",
    "CudaError",
    "CudaUnavailableError",
    "EngineStoppedError",
    "FabricError",
    "FabricTimeoutError",
    "InvalidArgumentError",
    "InvalidDescriptorError",
    "PeerFencedError",
    "ProviderUnavailableError",
    "RegionNotReadableError",
    "TransferError",
]


class FabricError(Exception):
    """Base class of every fabric_lib error (also raised for failed libfabric calls)."""


class ProviderUnavailableError(FabricError):
    """No libfabric provider or domain matches what was asked for (or it cannot do what was asked)."""


class InvalidArgumentError(FabricError, ValueError):
    """A value is out of range or inconsistent (offsets, lengths, handles, tensors); nothing was posted."""


class InvalidDescriptorError(InvalidArgumentError):
    """Descriptor or address bytes are corrupt, or belong to an incompatible engine."""


class RegionNotReadableError(InvalidArgumentError):
    """A read of a peer region whose owner did not register it with ``remote_read=True``
    (regions are remotely writable only unless their owner opts in); nothing was posted."""


class TransferError(FabricError):
    """A posted operation failed (peer gone, connection reset, provider error)."""


class FabricTimeoutError(FabricError, TimeoutError):
    """A bounded wait ran out (unresponsive peer, full queue, count not reached)."""


class PeerFencedError(FabricTimeoutError):
    """An earlier request to this peer timed out, so the engine sends it nothing more until
    ``TransferEngine.readmit_peer(address)``. A timed-out request may or may not have landed (and
    been counted); ``readmit_peer`` reports what the peer counted and makes it drop the rest, so
    resending exactly the missing requests counts each immediate once."""


class EngineStoppedError(FabricError):
    """The engine was stopped before or while the operation ran."""


class CudaUnavailableError(FabricError):
    """A GPU feature was used where CUDA (driver, device or kernels) is missing; the message says
    what is missing and how to get it."""


class CudaError(FabricError):
    """A CUDA driver call failed (e.g. an IPC handle could not be opened: region freed, peer gone)."""


class CallbackThreadError(FabricError, RuntimeError):
    """A blocking wait was called on the engine's callback thread, which would wait on itself
    (e.g. ``future.result()`` inside an ``on_done`` callback)."""
