"""The decoder side: asks a prefill instance for a request's KV and waits on an immediate count.

``request`` allocates an immediate value and a context slot, sets the expected count (every
source rank produces ``layers * chunks`` immediates, the context carrier one more) and sends
each source rank one REQUEST. There is no "done" message: the request completes when the count
is reached (Future, callback, or a GPU flag set by the engine).

Blocks may be reused once ``RecvRequest.released`` is done: at completion, or after a cancel or
failure once every live source confirmed that nothing more will land (CANCELLED carries how
many writes it issued; the decoder waits until that many immediates arrived).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from ..engine import GpuFlag
from ..errors import FabricTimeoutError, InvalidArgumentError
from ..imm_counter import ImmCounter
from . import messages as m
from .endpoint import KvEndpoint, PeerInfo
from .errors import KvPeerLostError, KvRequestCancelledError
from .imm_pool import ImmPool
from .plan import sources


@dataclass
class RecvRequest:
    """A request in flight. ``future``: the context bytes, or the error; ``released``: done
    when the request's blocks may be reused (result: None).

    The request counts one immediate value, or with ``layerwise`` one per layer (``imm + layer``)
    and one for the context (``imm + num_layers``); ``parts`` lists them."""

    request_id: str
    imm: int
    expected: int
    sources: list[str]
    future: Future[bytes]
    released: Future[None]
    ctx_offset: int | None
    ctx_len: int
    deadline: float
    parts: list[_Part]
    layers: list[Future[None]] | None = None
    acks: dict[str, int] = field(default_factory=dict)
    waiting_acks: set[str] = field(default_factory=set)
    cancel_deadline: float | None = None
    issued_total: int | None = None

    def wait(self, timeout: float) -> bytes:
        """The context (b"" if none was asked for); raises the request's error."""
        return self.future.result(timeout=timeout)

    def wait_for_layer(self, layer: int, timeout: float) -> None:
        """Returns once ``layer``'s pages of every chunk landed (requests made with
        ``layerwise=True``); raises the request's error, or ``FabricTimeoutError``."""
        if self.layers is None:
            raise InvalidArgumentError("wait_for_layer needs a receiver created with layerwise=True")
        if not 0 <= layer < len(self.layers):
            raise InvalidArgumentError(f"layer must be in [0, {len(self.layers)}), got {layer}")
        try:
            self.layers[layer].result(timeout=timeout)
        except FutureTimeout:
            raise FabricTimeoutError(
                f"layer {layer} of request {self.request_id!r} not loaded within {timeout}s"
            ) from None

    def arrived(self) -> int:
        """Immediates counted so far (parts whose expectation fired count in full)."""
        return sum(p.expected if p.reached else p.counter.value for p in self.parts)


@dataclass
class _Part:
    """One immediate value of a request and the count it expects."""

    imm: int
    expected: int
    counter: ImmCounter
    reached: bool = False


class KvReceiver(KvEndpoint):
    """Decoder endpoint. Arguments as ``KvSender``'s, plus:

    imm_base, imm_count: the immediate values this endpoint owns on its engine: ``imm_count``
        requests in flight, each taking one value (``num_layers + 1`` consecutive ones with
        ``layerwise``) from ``imm_base`` on.
    layerwise: count each layer on its own immediate value, so a decoder can start a layer
        once it landed (``RecvRequest.wait_for_layer``, ``layer_flags``).
    request_timeout: a request not complete this long after ``request`` fails
        (``FabricTimeoutError``) and is cancelled.
    cancel_timeout: how long a cancel waits for a live source's confirmation before the source
        is treated as lost.
    """

    role = "decode"

    def __init__(
        self,
        engine: Any,
        layout: Any,
        caches: Sequence[Any],
        *,
        imm_base: int = 0x4B560000,
        imm_count: int = 4096,
        request_timeout: float = 60.0,
        cancel_timeout: float = 10.0,
        layerwise: bool = False,
        **kw: Any,
    ) -> None:
        self.layerwise = layerwise
        self.imm_pool = ImmPool(imm_base, imm_count, layout.num_layers + 1 if layerwise else 1)
        self.request_timeout, self.cancel_timeout = request_timeout, cancel_timeout
        self._requests: dict[str, RecvRequest] = {}
        self._done: dict[str, BaseException | None] = {}
        super().__init__(engine, layout, caches, **kw)

    def prefill_ranks(self, instance: str) -> dict[int, PeerInfo]:
        """The joined ranks of prefill instance ``instance``, by TP rank."""
        return {p.tp_rank: p for p in self.peers if p.role == "prefill" and p.instance == instance}

    def request(
        self,
        request_id: str,
        prefill_instance: str,
        block_ids: Sequence[int],
        num_tokens: int,
        *,
        context_bytes: int = 0,
        num_chunks: int | None = None,
        flag: GpuFlag | None = None,
        flag_value: int = 1,
        layer_flags: Sequence[GpuFlag] | None = None,
    ) -> RecvRequest:
        """Asks ``prefill_instance`` to write the KV of ``num_tokens`` prompt tokens into
        ``block_ids`` (and ``context_bytes`` of context). ``num_chunks`` defaults to the
        chunks the prefiller announced (``chunk_tokens``). With ``flag``, the engine sets it to
        ``flag_value`` when everything landed (a GPU kernel can wait on it). With a
        ``layerwise`` receiver, ``layer_flags`` (one per layer) are set to ``flag_value`` as
        each layer lands instead."""
        if self.layerwise and flag is not None:
            raise InvalidArgumentError("a layerwise receiver sets layer_flags, not one flag")
        if layer_flags is not None and (not self.layerwise or len(layer_flags) != self.layout.num_layers):
            raise InvalidArgumentError(
                f"layer_flags needs layerwise=True and one flag per layer ({self.layout.num_layers})"
            )
        blocks = [int(b) for b in block_ids]
        if num_tokens < 1 or len(blocks) != self.layout.blocks_for(num_tokens):
            raise InvalidArgumentError(
                f"{num_tokens} tokens need {self.layout.blocks_for(num_tokens)} blocks, got {len(blocks)}"
            )
        if any(not 0 <= b < self.num_blocks for b in blocks) or len(set(blocks)) != len(blocks):
            raise InvalidArgumentError(f"block ids must be distinct and in [0, {self.num_blocks})")
        ranks = self.prefill_ranks(prefill_instance)
        if not ranks:
            raise KvPeerLostError(f"no rank of prefill instance {prefill_instance!r} has joined")
        src_tp = next(iter(ranks.values())).tp_size
        needed = sources(self.layout, src_tp, self.tp_size, self.tp_rank)
        missing = [r for r in range(src_tp) if r not in ranks]
        if missing:
            raise KvPeerLostError(f"prefill instance {prefill_instance!r}: ranks {missing} have not joined")
        chunks = {}
        for r in needed:
            ct = ranks[r].chunk_tokens
            chunks[r] = num_chunks if num_chunks is not None else (1 if ct is None else -(-num_tokens // ct))
            if chunks[r] < 1:
                raise InvalidArgumentError(f"num_chunks must be at least 1, got {chunks[r]}")
        expected = sum(self.layout.num_layers * chunks[r] for r in needed) + (1 if context_bytes else 0)
        with self._lock:
            if request_id in self._requests:
                raise InvalidArgumentError(f"request {request_id!r} is already in flight")
            ctx_offset = self.context_pool.acquire(context_bytes) if context_bytes else None
            try:
                imm = self.imm_pool.acquire()
            except Exception:
                if ctx_offset is not None:
                    self.context_pool.release(ctx_offset)
                raise
            future: Future[bytes] = Future()
            released: Future[None] = Future()
            future.set_running_or_notify_cancel()
            released.set_running_or_notify_cancel()
            L = self.layout.num_layers
            if self.layerwise:
                per_layer = sum(chunks[r] for r in needed)
                counts = [per_layer] * L + ([1] if context_bytes else [])
            else:
                counts = [expected]
            parts = [_Part(imm + i, n, self.engine.imm_counter(imm + i)) for i, n in enumerate(counts)]
            req = RecvRequest(
                request_id,
                imm,
                expected,
                [ranks[r].peer for r in needed],
                future,
                released,
                ctx_offset,
                context_bytes,
                time.monotonic() + self.request_timeout,
                parts,
                [_running_future() for _ in range(L)] if self.layerwise else None,
            )
            self._requests[request_id] = req
            for i, part in enumerate(parts):
                layer_flag = (
                    flag if not self.layerwise else (layer_flags[i] if layer_flags and i < L else None)
                )
                self.engine.set_imm_count_expected(
                    part.imm,
                    part.expected,
                    lambda i=i: self._reached(req, i),  # type: ignore[misc]
                    flag=layer_flag,
                    flag_value=flag_value,
                )
            # Every rank of the instance hears of the request (those this rank reads nothing from
            # get an empty one), so each prefiller rank knows when all decoder ranks are served.
            for r in range(src_tp):
                self._send(
                    ranks[r],
                    m.encode(
                        m.REQUEST,
                        self.peer_id,
                        rid=request_id,
                        dst_tp=self.tp_size,
                        dst_rank=self.tp_rank,
                        blocks=blocks,
                        num_tokens=num_tokens,
                        num_chunks=chunks.get(r, 1),
                        imm=imm,
                        layerwise=self.layerwise,
                        ctx_offset=ctx_offset or 0,
                        ctx_len=context_bytes if r == needed[0] else 0,
                        empty=r not in needed,
                    ),
                )
        return req

    def cancel(self, request_id: str) -> Future[None]:
        """Cancels a request; the returned Future completes when its blocks may be reused
        (every live source confirmed). The request's Future fails with
        ``KvRequestCancelledError`` unless it had already completed."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                done: Future[None] = Future()
                done.set_result(None)
                return done
            self._abort(req, KvRequestCancelledError(f"request {request_id!r} cancelled by the decoder"))
            return req.released

    def finished(self) -> dict[str, BaseException | None]:
        """Requests whose blocks were released since the last call (None: complete)."""
        with self._lock:
            done, self._done = self._done, {}
            return done

    # -- completion and aborts ---------------------------------------------------------------
    def _reached(self, req: RecvRequest, index: int) -> None:
        """A part's expected count arrived (also when it raced a cancel); all parts: everything
        landed."""
        with self._lock:
            req.parts[index].reached = True
            if req.layers is not None and index < len(req.layers) and not req.layers[index].done():
                req.layers[index].set_result(None)
            if not all(p.reached for p in req.parts):
                if req.cancel_deadline is not None:
                    self._settle_cancel(req)
                return
            if not req.future.done():
                data = b""
                if req.ctx_offset is not None:
                    data = self.context_pool.view(req.ctx_offset, req.ctx_len).tobytes()
                req.future.set_result(data)
            self._release(req)

    def _abort(self, req: RecvRequest, error: BaseException) -> None:
        """Fails the request now; asks the live sources to stop and confirm."""
        if req.future.done() or req.cancel_deadline is not None:
            return
        req.future.set_exception(error)
        for layer in req.layers or []:
            if not layer.done():
                layer.set_exception(error)
        req.cancel_deadline = time.monotonic() + self.cancel_timeout
        for peer in req.sources:
            info = self._peers.get(peer)
            if info is None:
                req.acks[peer] = 0  # lost: a dead process writes nothing more
            else:
                req.waiting_acks.add(peer)
                self._send(info, m.encode(m.CANCEL, self.peer_id, rid=req.request_id))
        self._settle_cancel(req)

    def _settle_cancel(self, req: RecvRequest) -> None:
        """Releases an aborted request once every source confirmed and its writes arrived."""
        if req.waiting_acks or req.released.done():
            return
        issued = sum(req.acks.values())
        if issued >= req.expected:
            return  # everything was issued: the expectation fires (``_reached``)
        if req.arrived() >= issued:
            self._forget_counts(req)
            self._release(req)

    def _forget_counts(self, req: RecvRequest) -> None:
        for part in req.parts:
            if not part.reached:
                self.engine.remove_imm_count(part.imm)

    def _release(self, req: RecvRequest) -> None:
        if self._requests.get(req.request_id) is not req:
            return
        del self._requests[req.request_id]
        for part in req.parts:
            part.counter.close()
        self.imm_pool.release(req.imm)
        if req.ctx_offset is not None:
            self.context_pool.release(req.ctx_offset)
        err = req.future.exception() if req.future.done() else None
        self._done[req.request_id] = err
        req.released.set_result(None)

    # -- endpoint hooks ----------------------------------------------------------------------
    def _handle(self, kind: str, info: PeerInfo, msg: dict[str, Any]) -> None:
        if kind != m.CANCELLED:
            return
        with self._lock:
            req = self._requests.get(str(msg["rid"]))
            if req is None or info.peer not in req.sources:
                return
            if not req.future.done():  # the prefiller gave up on its own
                reason = str(msg.get("reason", ""))
                self._abort(
                    req, KvRequestCancelledError(f"prefiller {info.instance}/{info.tp_rank}: {reason}")
                )
            req.acks[info.peer] = int(msg["issued"])
            req.waiting_acks.discard(info.peer)
            self._settle_cancel(req)
            self._wake.set()

    def _on_peer_lost(self, info: PeerInfo, error: BaseException) -> None:
        with self._lock:
            for req in list(self._requests.values()):
                if info.peer not in req.sources:
                    continue
                if req.cancel_deadline is None:
                    self._abort(req, error)
                if info.peer in req.waiting_acks:
                    req.waiting_acks.discard(info.peer)
                    req.acks.setdefault(info.peer, 0)
                self._settle_cancel(req)

    def _tick(self, now: float) -> bool:
        busy = False
        with self._lock:
            for req in list(self._requests.values()):
                if req.cancel_deadline is None and now > req.deadline:
                    self._abort(
                        req,
                        FabricTimeoutError(
                            f"request {req.request_id!r} not complete within {self.request_timeout}s"
                        ),
                    )
                if req.cancel_deadline is not None:
                    if req.waiting_acks and now > req.cancel_deadline:
                        for peer in list(req.waiting_acks):
                            self._lose(
                                peer, KvPeerLostError(f"no cancel confirmation within {self.cancel_timeout}s")
                            )
                    self._settle_cancel(req)
                    busy = busy or not req.released.done()
        return busy

    def _on_close(self) -> None:
        with self._lock:
            for req in list(self._requests.values()):
                if not req.future.done():
                    req.future.set_exception(KvPeerLostError("the decode endpoint closed"))
                for layer in req.layers or []:
                    if not layer.done():
                        layer.set_exception(KvPeerLostError("the decode endpoint closed"))
                self._forget_counts(req)
                self._release(req)


def _running_future() -> Future[None]:
    f: Future[None] = Future()
    f.set_running_or_notify_cancel()
    return f
