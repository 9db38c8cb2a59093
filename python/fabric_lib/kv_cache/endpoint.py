"""What prefillers and decoders share: registered caches, peers that join by address, control
messages and heartbeats.

Membership is dynamic: ``connect(address)`` sends HELLO (this side's role, instance, TP rank,
layout and descriptors); the other side records the peer and answers WELCOME with its own. No
global world: any endpoint may join or leave at any time. Every known peer gets a heartbeat each
``heartbeat_interval``; one not heard from for ``peer_timeout`` seconds, or whose engine refuses
a message, is *lost*: it is forgotten and the subclass fails what was pending with it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..engine import EngineAddress, MemoryRegion, MrDescriptor, TransferEngine
from ..errors import FabricError, FabricTimeoutError, InvalidArgumentError
from . import messages as m
from .context_pool import ContextPool
from .errors import KvPeerLostError
from .layout import KvLayout, check_tp

_log = logging.getLogger("fabric_lib.kv_cache")

Role = Literal["prefill", "decode"]


@dataclass
class PeerInfo:
    """A remote endpoint as its HELLO/WELCOME described it."""

    peer: str
    role: Role
    instance: str
    tp_size: int
    tp_rank: int
    address: EngineAddress
    layout: KvLayout
    caches: list[MrDescriptor]
    context: MrDescriptor
    chunk_tokens: int | None
    last_seen: float = field(default_factory=time.monotonic)


class KvEndpoint:
    """Base of ``KvSender`` and ``KvReceiver``; see their docs for the arguments."""

    role: Role

    def __init__(
        self,
        engine: TransferEngine,
        layout: KvLayout,
        caches: Sequence[Any],
        *,
        instance: str,
        tp_size: int = 1,
        tp_rank: int = 0,
        context_slots: int = 64,
        context_bytes: int = 1 << 16,
        chunk_tokens: int | None = None,
        heartbeat_interval: float = 0.5,
        peer_timeout: float = 5.0,
        on_other_message: Callable[[bytes], None] | None = None,
    ) -> None:
        check_tp(tp_size, tp_rank)
        layout.heads_per_rank(tp_size)  # heads must divide evenly
        if len(caches) != layout.num_layers:
            raise InvalidArgumentError(f"expected {layout.num_layers} layer caches, got {len(caches)}")
        if not 0 < heartbeat_interval < peer_timeout:
            raise InvalidArgumentError("need 0 < heartbeat_interval < peer_timeout")
        if chunk_tokens is not None and chunk_tokens < 1:
            raise InvalidArgumentError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
        self.engine = engine
        self.layout = layout
        self.instance = instance
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.chunk_tokens = chunk_tokens
        self.heartbeat_interval, self.peer_timeout = heartbeat_interval, peer_timeout
        self.peer_id = uuid.uuid4().hex[:16]
        self._other = on_other_message
        self._lock = threading.RLock()
        self._peers: dict[str, PeerInfo] = {}
        self._welcomes: dict[bytes, tuple[threading.Event, list[PeerInfo]]] = {}
        self.num_blocks = self._check_caches(caches)
        self.cache_regions: list[MemoryRegion] = [self._register(c) for c in caches]
        self.context_pool = ContextPool(engine, context_slots, context_bytes)
        self._closed = threading.Event()
        self._wake = threading.Event()
        engine.set_recv_callback(self._on_message)
        self._ticker = threading.Thread(
            target=self._tick_loop, name=f"kv-{self.role}-{instance}", daemon=True
        )
        self._ticker.start()

    # -- caches ----------------------------------------------------------------------------
    def _check_caches(self, caches: Sequence[Any]) -> int:
        num_blocks = None
        block_shape = self.layout.block_shape(self.tp_size)
        for i, c in enumerate(caches):
            shape = tuple(getattr(c, "shape", ()))
            dtype = str(getattr(c, "dtype", "")).removeprefix("torch.")
            if shape[1:] != block_shape or dtype != self.layout.dtype:
                raise InvalidArgumentError(
                    f"layer {i} cache is {dtype}{list(shape)}; the layout needs "
                    f"{self.layout.dtype}[num_blocks, {', '.join(map(str, block_shape))}]"
                )
            if num_blocks is None:
                num_blocks = shape[0]
            elif shape[0] != num_blocks:
                raise InvalidArgumentError(f"layer {i} has {shape[0]} blocks, layer 0 has {num_blocks}")
        assert num_blocks is not None
        return int(num_blocks)

    def _register(self, cache: Any) -> MemoryRegion:
        return self.engine.register_tensor(cache)

    # -- membership ------------------------------------------------------------------------
    def _hello_fields(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "instance": self.instance,
            "tp_size": self.tp_size,
            "tp_rank": self.tp_rank,
            "address": m.b64(self.engine.main_address.to_bytes()),
            "layout": self.layout.to_dict(),
            "caches": [m.b64(r.descriptor.to_bytes()) for r in self.cache_regions],
            "context": m.b64(self.context_pool.region.descriptor.to_bytes()),
            "chunk_tokens": self.chunk_tokens,
        }

    def connect(self, address: EngineAddress | bytes, timeout: float = 10.0) -> PeerInfo:
        """Joins the endpoint at ``address`` (its engine's ``main_address``); returns it once it
        answered. Raises ``FabricTimeoutError`` if it does not answer within ``timeout``."""
        addr = address if isinstance(address, EngineAddress) else EngineAddress.from_bytes(bytes(address))
        key = addr.to_bytes()
        event, box = threading.Event(), list[PeerInfo]()
        with self._lock:
            self._welcomes[key] = (event, box)
        try:
            sent = self.engine.submit_send(addr, m.encode(m.HELLO, self.peer_id, **self._hello_fields()))
            assert sent is not None
            sent.result(timeout=timeout)
            if not event.wait(timeout):
                raise FabricTimeoutError(f"no answer to HELLO from {addr.to_hex()[:24]}... within {timeout}s")
        finally:
            with self._lock:
                self._welcomes.pop(key, None)
        return box[0]

    def disconnect(self, peer: str) -> None:
        """Leaves ``peer``: tells it, then fails what is pending with it here."""
        info = self._peers.get(peer)
        if info is None:
            return
        self._send(info, m.encode(m.BYE, self.peer_id))
        self._lose(peer, KvPeerLostError(f"disconnected from {info.role} {info.instance}/{info.tp_rank}"))

    @property
    def peers(self) -> list[PeerInfo]:
        with self._lock:
            return list(self._peers.values())

    def _parse_peer(self, msg: dict[str, Any]) -> PeerInfo:
        layout = KvLayout.from_dict(msg["layout"])
        if layout != self.layout:
            raise InvalidArgumentError(f"peer layout {layout} differs from ours {self.layout}")
        return PeerInfo(
            peer=msg["peer"],
            role=msg["role"],
            instance=str(msg["instance"]),
            tp_size=int(msg["tp_size"]),
            tp_rank=int(msg["tp_rank"]),
            address=EngineAddress.from_bytes(m.unb64(msg["address"])),
            layout=layout,
            caches=[MrDescriptor.from_bytes(m.unb64(d)) for d in msg["caches"]],
            context=MrDescriptor.from_bytes(m.unb64(msg["context"])),
            chunk_tokens=msg.get("chunk_tokens"),
        )

    # -- messages --------------------------------------------------------------------------
    def _send(self, info: PeerInfo, data: bytes) -> None:
        """Sends a control message; a refusal (dead or fenced peer) loses the peer."""

        def done(err: BaseException | None) -> None:
            if err is not None and not self._closed.is_set():
                self._lose(
                    info.peer,
                    KvPeerLostError(f"{info.role} {info.instance}/{info.tp_rank} unreachable: {err}"),
                )

        try:
            self.engine.submit_send(info.address, data, on_done=done)
        except FabricError as e:
            done(e)

    def _on_message(self, data: bytes) -> None:
        msg = m.decode(data)
        if msg is None:
            if self._other is not None:
                self._other(data)
            return
        kind, peer = msg["kind"], msg["peer"]
        try:
            if kind in (m.HELLO, m.WELCOME):
                info = self._parse_peer(msg)
                with self._lock:
                    self._peers[peer] = info
                    waiting = self._welcomes.get(info.address.to_bytes())
                if kind == m.HELLO:
                    self._send(info, m.encode(m.WELCOME, self.peer_id, **self._hello_fields()))
                    self._on_peer_joined(info)
                elif waiting is not None:
                    waiting[1].append(info)
                    waiting[0].set()
                return
            with self._lock:
                info_or_none = self._peers.get(peer)
                if info_or_none is not None:
                    info_or_none.last_seen = time.monotonic()
            if info_or_none is None or kind == m.HEARTBEAT:
                return  # unknown (lost or never joined) peers are ignored
            if kind == m.BYE:
                self._lose(
                    peer,
                    KvPeerLostError(
                        f"{info_or_none.role} {info_or_none.instance}/{info_or_none.tp_rank} left"
                    ),
                )
                return
            self._handle(kind, info_or_none, msg)
        except (FabricError, KeyError, ValueError, TypeError) as e:
            _log.warning("dropping bad %s message from %s: %r", kind, peer, e)

    def _lose(self, peer: str, error: BaseException) -> None:
        with self._lock:
            info = self._peers.pop(peer, None)
        if info is not None:
            _log.info("kv peer %s lost: %s", peer, error)
            self._on_peer_lost(info, error)

    # -- heartbeats and timers ---------------------------------------------------------------
    def _tick_loop(self) -> None:
        next_beat = 0.0
        while not self._closed.is_set():
            busy = False
            try:  # a bug in one round must not stop heartbeats and timers
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.heartbeat_interval
                    self._beat(now)
                busy = self._tick(now)
            except Exception:  # noqa: BLE001 - logged, the loop goes on
                _log.exception("kv timer round failed")
            self._wake.wait(0.005 if busy else min(0.05, self.heartbeat_interval))
            self._wake.clear()

    def _beat(self, now: float) -> None:
        """Heartbeats to every peer; peers silent for ``peer_timeout`` are lost."""
        beat = m.encode(m.HEARTBEAT, self.peer_id)
        for info in self.peers:
            if now - info.last_seen > self.peer_timeout:
                self._lose(
                    info.peer,
                    KvPeerLostError(
                        f"{info.role} {info.instance}/{info.tp_rank}: no heartbeat for {self.peer_timeout}s"
                    ),
                )
            else:
                self._send(info, beat)

    def close(self) -> None:
        """Leaves every peer and stops the heartbeat thread (the engine stays the caller's)."""
        if self._closed.is_set():
            return
        for info in self.peers:
            self._send(info, m.encode(m.BYE, self.peer_id))
        self._closed.set()
        self._wake.set()
        self._ticker.join(5)
        self._on_close()

    def __enter__(self) -> KvEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- subclass hooks ----------------------------------------------------------------------
    def _on_peer_joined(self, info: PeerInfo) -> None:
        pass

    def _handle(self, kind: str, info: PeerInfo, msg: dict[str, Any]) -> None:
        raise NotImplementedError

    def _on_peer_lost(self, info: PeerInfo, error: BaseException) -> None:
        raise NotImplementedError

    def _tick(self, now: float) -> bool:
        """Periodic work; returns True while something needs fast polling."""
        return False

    def _on_close(self) -> None:
        pass
