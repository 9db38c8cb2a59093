"""KV-cache transfer for disaggregated prefill/decode, on the TransferEngine's public API.

A decoder (``KvReceiver``) asks a prefill instance for a request's KV: it owns the destination
blocks and a context slot and sends each prefiller rank it reads from one small REQUEST. The
prefiller (``KvSender``) writes each layer's pages by paged writes as soon as the layer is in its
cache (``ForwardPass.layer_ready`` or a GPU kernel through ``LayerTrigger``), then the context by
one write. The decoder counts immediates; there is no "done" message. See docs/kv_cache.md.
"""

from __future__ import annotations

from .endpoint import KvEndpoint, PeerInfo
from .errors import KvCacheError, KvCapacityError, KvPeerLostError, KvRequestCancelledError
from .layer_trigger import LayerTrigger
from .layout import DTYPE_SIZES, KvLayout
from .plan import PairPlan, chunk_blocks, destinations, plan_pair, sources
from .receiver import KvReceiver, RecvRequest
from .sender import ForwardPass, KvSender

__all__ = [
    "DTYPE_SIZES",
    "ForwardPass",
    "KvCacheError",
    "KvCapacityError",
    "KvEndpoint",
    "KvLayout",
    "KvPeerLostError",
    "KvReceiver",
    "KvRequestCancelledError",
    "KvSender",
    "LayerTrigger",
    "PairPlan",
    "PeerInfo",
    "RecvRequest",
    "chunk_blocks",
    "destinations",
    "plan_pair",
    "sources",
]
