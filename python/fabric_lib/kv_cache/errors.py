"""Errors of the KV-cache transfer module (all ``fabric_lib.errors.FabricError`` subclasses)."""

from __future__ import annotations

from ..errors import FabricError, TransferError


class KvCacheError(FabricError):
    """Base class of the errors this module adds to the engine's."""


class KvPeerLostError(KvCacheError, TransferError):
    """The peer of a request died (no heartbeat within ``peer_timeout``, or its engine refused
    our messages) or left; the request failed and its blocks are released."""


class KvRequestCancelledError(KvCacheError):
    """The request was cancelled (by this side, or by the peer, whose reason the message gives)."""


class KvCapacityError(KvCacheError):
    """A fixed pool (immediate values, context slots) is exhausted; retry once requests finish."""
