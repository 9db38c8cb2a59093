"""The prefiller side: streams each layer's pages to the decoders that asked, as layers finish.

Per request the prefiller learns its own blocks from its scheduler (``add_request``) and, by
message, one *destination* per decoder rank that reads from this rank (blocks, immediate,
context slot, number of chunks). Progress comes per forward pass: ``begin_forward`` says how
many prompt tokens of each request the pass computes, ``layer_ready(layer)`` (CPU call) or a UVM
watcher bumped by a kernel (``LayerTrigger``) says a layer's KV is in the cache.

Each (destination, layer, chunk) produces exactly one immediate, so the decoder's expected count
is ``layers * chunks`` per source rank (+1 for the context): a chunk sends the blocks it
completed (one paged write; a bare immediate if it completed none), the last chunk also sends
the partial tail block. Each block is written exactly once per layer, so no two writes of a
request ever overlap. Chunks beyond the decoder's count defer their blocks to the last chunk;
fewer chunks are padded with bare immediates.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import FabricTimeoutError, InvalidArgumentError
from . import messages as m
from .endpoint import KvEndpoint, PeerInfo, _log
from .errors import KvPeerLostError, KvRequestCancelledError
from .plan import PairPlan, chunk_blocks, plan_pair


@dataclass
class _Destination:
    info: PeerInfo
    plan: PairPlan
    blocks: list[int]
    num_chunks: int
    imm: int
    ctx_offset: int
    ctx_len: int
    processed: list[int]  # per layer: entries of the request's ready list handled
    calls: list[int]  # per layer: immediates produced
    sent_blocks: list[int]  # per layer: blocks written
    layerwise: bool = False  # layer l counts on imm + l, the context on imm + num_layers
    issued: int = 0
    settled: int = 0
    ctx_sent: bool = False
    error: BaseException | None = None
    stopped: bool = False  # cancelled or failed: nothing more is issued
    confirmed: bool = False  # CANCELLED sent (or peer lost)

    def layer_imm(self, layer: int) -> int:
        return self.imm + layer if self.layerwise else self.imm

    def context_imm(self) -> int:
        return self.imm + len(self.calls) if self.layerwise else self.imm

    def complete(self) -> bool:
        layers = all(c == self.num_chunks for c in self.calls)
        return layers and (self.ctx_sent or not self.ctx_len) and self.settled == self.issued


@dataclass
class _SendRequest:
    rid: str
    blocks: list[int] | None
    num_tokens: int
    ready: list[list[int]]  # per layer: prompt tokens done after each chunk
    deadline: float
    future: Future[None]
    context: bytes | None = None
    stage_offset: int | None = None
    dests: dict[str, _Destination] = field(default_factory=dict)
    expected_dests: int | None = None
    finished_dests: int = 0
    error: BaseException | None = None


class ForwardPass:
    """One forward pass over a batch: which prompt tokens of which request it computes.

    ``layer_ready(layer)`` after a layer's KV is in the cache; ``wait`` until every write this
    pass issued has completed at the source (the cache rows may then be reused)."""

    def __init__(self, sender: KvSender, progress: dict[str, int]) -> None:
        self._sender = sender
        self.progress = progress
        self.layers_done = 0
        self._outstanding = 0
        self._cond = threading.Condition()

    def layer_ready(self, layer: int) -> None:
        self._sender._layer_ready(self, layer)

    def _issued(self) -> None:
        with self._cond:
            self._outstanding += 1

    def _settled(self) -> None:
        with self._cond:
            self._outstanding -= 1
            self._cond.notify_all()

    def wait(self, timeout: float) -> None:
        """Blocks until this pass's writes completed or failed (failures go to the requests)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._outstanding == 0, timeout):
                raise FabricTimeoutError(
                    f"{self._outstanding} writes of the forward pass still pending after {timeout}s"
                )


class KvSender(KvEndpoint):
    """Prefiller endpoint.

    Args:
        engine: the TransferEngine (its receive callback is taken over; other messages go to
            ``on_other_message``).
        layout: the model's cache layout; ``caches``: one tensor per layer,
            ``layout.layer_shape(num_blocks, tp_size)``.
        instance, tp_size, tp_rank: this prefill instance's name and this rank's place in it.
        chunk_tokens: the chunked-prefill chunk size decoders assume (None: whole prompts).
        request_timeout: a request not finished this long after ``add_request`` fails.
        context_slots, context_bytes: staging slots for contexts.
        heartbeat_interval, peer_timeout: see ``KvEndpoint``.
    """

    role = "prefill"

    def __init__(
        self, engine: Any, layout: Any, caches: Sequence[Any], *, request_timeout: float = 60.0, **kw: Any
    ) -> None:
        self.request_timeout = request_timeout
        self._requests: dict[str, _SendRequest] = {}
        self._early: dict[str, list[tuple[PeerInfo, dict[str, Any]]]] = {}
        self._done: dict[str, BaseException | None] = {}
        # finished ids (with why) that a forward pass or a late REQUEST may still name
        self._retired: OrderedDict[str, str] = OrderedDict()
        super().__init__(engine, layout, caches, **kw)

    # -- the prefill engine's calls ---------------------------------------------------------
    def add_request(self, request_id: str, block_ids: Sequence[int], num_tokens: int) -> Future[None]:
        """This rank's blocks for a request's prompt of ``num_tokens`` tokens. The Future
        completes when every decoder rank reading from this rank has all its pages (and context);
        it fails with the first destination's error."""
        blocks = [int(b) for b in block_ids]
        if num_tokens < 1 or len(blocks) != self.layout.blocks_for(num_tokens):
            raise InvalidArgumentError(
                f"{num_tokens} tokens need {self.layout.blocks_for(num_tokens)} blocks, got {len(blocks)}"
            )
        if any(not 0 <= b < self.num_blocks for b in blocks):
            raise InvalidArgumentError(f"block ids must be in [0, {self.num_blocks})")
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            if request_id in self._requests:
                raise InvalidArgumentError(f"request {request_id!r} already added")
            req = _SendRequest(
                request_id,
                blocks,
                num_tokens,
                [[] for _ in range(self.layout.num_layers)],
                time.monotonic() + self.request_timeout,
                future,
            )
            self._requests[request_id] = req
            for info, msg in self._early.pop(request_id, []):
                self._add_destination(req, info, msg)
        return future

    def begin_forward(self, progress: Mapping[str, int]) -> ForwardPass:
        """A forward pass computing each listed request's prompt up to ``progress[rid]`` tokens.
        Requests already finished (e.g. cancelled) are skipped."""
        with self._lock:
            for rid, tokens in progress.items():
                req = self._requests.get(rid)
                if req is None and rid in self._retired:
                    continue
                if req is None:
                    raise InvalidArgumentError(f"unknown request {rid!r} (add_request first)")
                last = req.ready[0][-1] if req.ready[0] else 0
                if not last < tokens <= req.num_tokens:
                    raise InvalidArgumentError(
                        f"request {rid!r}: progress must go from {last} up to at most {req.num_tokens}, got {tokens}"
                    )
        return ForwardPass(self, dict(progress))

    def send_context(self, request_id: str, data: Any) -> None:
        """The request's context (last hidden state / logits; bytes or a CPU tensor), written
        once by one single write to each decoder rank that expects it."""
        raw = _as_bytes(data)
        with self._lock:
            req = self._get(request_id)
            if req.context is not None:
                raise InvalidArgumentError(f"request {request_id!r}: context already sent")
            offset = self.context_pool.acquire(len(raw))
            self.context_pool.view(offset, len(raw))[:] = np.frombuffer(raw, dtype=np.uint8)
            req.context, req.stage_offset = raw, offset
            for dest in list(req.dests.values()):
                self._pump(req, dest)

    def cancel(self, request_id: str, reason: str = "cancelled by the prefiller") -> None:
        """Stops sending; each decoder is told (with the number of writes issued) once nothing
        more can land. The request's Future fails with ``KvRequestCancelledError``."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None:
                return
            req.error = req.error or KvRequestCancelledError(reason)
            for dest in list(req.dests.values()):
                self._stop(req, dest, KvRequestCancelledError(reason))
            self._check_finished(req)

    def finished(self) -> dict[str, BaseException | None]:
        """Requests finished since the last call (None: every page delivered), for the engine
        to free their blocks."""
        with self._lock:
            done, self._done = self._done, {}
            return done

    # -- progress ------------------------------------------------------------------------
    def _layer_ready(self, fwd: ForwardPass, layer: int) -> None:
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidArgumentError(f"layer must be in [0, {self.layout.num_layers}), got {layer}")
        with self._lock:
            fwd.layers_done = max(fwd.layers_done, layer + 1)
            for rid, tokens in fwd.progress.items():
                req = self._requests.get(rid)
                if req is None:
                    continue  # finished or cancelled meanwhile
                ready = req.ready[layer]
                if ready and ready[-1] >= tokens:
                    raise InvalidArgumentError(
                        f"layer {layer} of request {rid!r} reported twice for {tokens} tokens"
                    )
                ready.append(tokens)
                for dest in list(req.dests.values()):
                    self._pump(req, dest, fwd)

    def _pump(self, req: _SendRequest, dest: _Destination, fwd: ForwardPass | None = None) -> None:
        """Issues every write ``dest`` may have now (called under the lock)."""
        if dest.stopped:
            return
        assert req.blocks is not None
        for layer in range(self.layout.num_layers):
            ready = req.ready[layer]
            while dest.processed[layer] < len(ready) and not dest.stopped:
                tokens = ready[dest.processed[layer]]
                dest.processed[layer] += 1
                final = tokens >= req.num_tokens
                if not final and dest.calls[layer] >= dest.num_chunks - 1:
                    continue  # more chunks than the decoder counts: defer to the last one
                lo, hi = chunk_blocks(self.layout.block_size, req.num_tokens, dest.sent_blocks[layer], tokens)
                self._write_pages(req, dest, layer, lo, hi, fwd)
                dest.sent_blocks[layer] = hi
                dest.calls[layer] += 1
                while final and dest.calls[layer] < dest.num_chunks and not dest.stopped:
                    self._bare_imm(req, dest, layer, fwd)
                    dest.calls[layer] += 1
        if req.context is not None and dest.ctx_len and not dest.ctx_sent and not dest.stopped:
            if len(req.context) != dest.ctx_len:
                self._stop(
                    req,
                    dest,
                    InvalidArgumentError(
                        f"context is {len(req.context)} bytes, the decoder expects {dest.ctx_len}"
                    ),
                )
                return
            dest.ctx_sent = True
            stage = req.stage_offset
            assert stage is not None
            self._issue(
                req,
                dest,
                fwd,
                lambda cb: self.engine.submit_write(
                    self.context_pool.region,
                    dest.info.context,
                    dest.ctx_len,
                    src_offset=stage,
                    dst_offset=dest.ctx_offset,
                    imm=dest.context_imm(),
                    on_done=cb,
                ),
            )
        self._check_finished(req)

    def _write_pages(
        self, req: _SendRequest, dest: _Destination, layer: int, lo: int, hi: int, fwd: ForwardPass | None
    ) -> None:
        if lo == hi:
            self._bare_imm(req, dest, layer, fwd)
            return
        assert req.blocks is not None
        plan = dest.plan
        src_units, dst_units = plan.units(req.blocks[lo:hi]), plan.units(dest.blocks[lo:hi])
        self._issue(
            req,
            dest,
            fwd,
            lambda cb: self.engine.submit_paged_writes(
                plan.length,
                self.cache_regions[layer],
                src_units,
                dest.info.caches[layer],
                dst_units,
                src_stride=plan.src_unit_stride,
                src_offset=plan.src_offset,
                dst_stride=plan.dst_unit_stride,
                dst_offset=plan.dst_offset,
                imm=dest.layer_imm(layer),
                on_done=cb,
            ),
        )

    def _bare_imm(self, req: _SendRequest, dest: _Destination, layer: int, fwd: ForwardPass | None) -> None:
        imm = dest.layer_imm(layer)
        self._issue(req, dest, fwd, lambda cb: self.engine.submit_imm(imm, dest.info.address, on_done=cb))

    def _issue(
        self, req: _SendRequest, dest: _Destination, fwd: ForwardPass | None, submit: Callable[[Any], Any]
    ) -> None:
        dest.issued += 1
        if fwd is not None:
            fwd._issued()

        def done(err: BaseException | None) -> None:
            _log.debug("request %s -> %s: settled %r", req.rid, dest.info.peer, err)
            with self._lock:
                dest.settled += 1
                if err is not None:
                    self._stop(req, dest, err)
                self._check_finished(req)
            if fwd is not None:
                fwd._settled()

        try:
            submit(done)
        except Exception as e:  # noqa: BLE001 - refused at submission: settles as a failure
            done(e)

    # -- destinations ----------------------------------------------------------------------
    def _add_destination(self, req: _SendRequest, info: PeerInfo, msg: dict[str, Any]) -> None:
        dst_tp, dst_rank = int(msg["dst_tp"]), int(msg["dst_rank"])
        plan = plan_pair(self.layout, self.tp_size, self.tp_rank, dst_tp, dst_rank)
        num_chunks = int(msg["num_chunks"])
        blocks = [int(b) for b in msg["blocks"]]
        L = self.layout.num_layers
        dest = _Destination(
            info,
            plan or plan_pair(self.layout, 1, 0, 1, 0),  # type: ignore[arg-type]
            blocks,
            num_chunks,
            int(msg["imm"]),
            int(msg["ctx_offset"]),
            int(msg["ctx_len"]),
            [0] * L,
            [0] * L,
            [0] * L,
            bool(msg.get("layerwise", False)),
        )
        req.dests[info.peer] = dest
        if req.expected_dests is None:
            req.expected_dests = dst_tp  # every decoder rank sends each prefiller rank a REQUEST
        if msg.get("empty") and plan is None:
            dest.stopped = dest.confirmed = True  # this decoder rank reads nothing from this rank
            req.finished_dests += 1
            self._check_finished(req)
        elif plan is None:
            self._stop(
                req,
                dest,
                InvalidArgumentError(
                    f"decoder rank {dst_rank}/{dst_tp} reads nothing from rank {self.tp_rank}"
                ),
            )
        elif int(msg["num_tokens"]) != req.num_tokens or len(blocks) != len(req.blocks or []):
            self._stop(
                req,
                dest,
                InvalidArgumentError(
                    f"decoder expects {msg['num_tokens']} tokens in {len(blocks)} blocks; "
                    f"the prefiller has {req.num_tokens} in {len(req.blocks or [])}"
                ),
            )
        elif num_chunks < 1 or any(
            not 0 <= b < info.caches[0].length // self.layout.page_bytes(dst_tp) for b in blocks
        ):
            self._stop(req, dest, InvalidArgumentError("decoder block ids or chunk count out of range"))
        else:
            self._pump(req, dest)

    def _stop(self, req: _SendRequest, dest: _Destination, error: BaseException) -> None:
        """Issues nothing more to ``dest``; it is confirmed once its writes settled."""
        if not dest.stopped:
            dest.stopped, dest.error = True, error
        self._check_finished(req)

    def _check_finished(self, req: _SendRequest) -> None:
        for dest in req.dests.values():
            if dest.confirmed or dest.settled != dest.issued:
                continue
            if dest.stopped:
                dest.confirmed = True
                if self._peers.get(dest.info.peer) is not None:
                    self._send(
                        dest.info,
                        m.encode(
                            m.CANCELLED,
                            self.peer_id,
                            rid=req.rid,
                            issued=dest.issued,
                            reason=f"{type(dest.error).__name__}: {dest.error}",
                        ),
                    )
                req.finished_dests += 1
                req.error = req.error or dest.error
            elif dest.complete():
                dest.confirmed = True
                req.finished_dests += 1
        cancelled_early = req.error is not None and req.expected_dests is None
        if (req.expected_dests is not None and req.finished_dests >= req.expected_dests) or cancelled_early:
            self._finish(req, req.error)

    def _finish(self, req: _SendRequest, error: BaseException | None) -> None:
        if self._requests.pop(req.rid, None) is None:
            return
        if req.stage_offset is not None:
            self.context_pool.release(req.stage_offset)
        self._done[req.rid] = error
        self._retired[req.rid] = "finished" if error is None else f"{type(error).__name__}: {error}"
        while len(self._retired) > 4096:
            self._retired.popitem(last=False)
        if error is None:
            req.future.set_result(None)
        else:
            req.future.set_exception(error)

    def _get(self, rid: str) -> _SendRequest:
        req = self._requests.get(rid)
        if req is None:
            raise InvalidArgumentError(f"unknown request {rid!r}")
        return req

    # -- endpoint hooks ----------------------------------------------------------------------
    def _handle(self, kind: str, info: PeerInfo, msg: dict[str, Any]) -> None:
        rid = str(msg["rid"])
        with self._lock:
            req = self._requests.get(rid)
            if kind == m.REQUEST:
                if req is None and rid in self._retired:  # cancelled before this decoder asked
                    self._send(
                        info,
                        m.encode(m.CANCELLED, self.peer_id, rid=rid, issued=0, reason=self._retired[rid]),
                    )
                elif req is None:
                    msg["arrived"] = time.monotonic()
                    self._early.setdefault(rid, []).append((info, msg))
                elif info.peer in req.dests:
                    raise InvalidArgumentError(f"duplicate request {rid!r} from {info.peer}")
                else:
                    self._add_destination(req, info, msg)
            elif kind == m.CANCEL:
                early = self._early.get(rid, [])
                if any(i.peer == info.peer for i, _ in early):
                    self._early[rid] = [(i, x) for i, x in early if i.peer != info.peer]
                if req is None or info.peer not in req.dests:
                    self._send(
                        info, m.encode(m.CANCELLED, self.peer_id, rid=rid, issued=0, reason="cancelled")
                    )
                    return
                self._stop(req, req.dests[info.peer], KvRequestCancelledError("cancelled by the decoder"))

    def _on_peer_lost(self, info: PeerInfo, error: BaseException) -> None:
        with self._lock:
            for rid in list(self._early):
                self._early[rid] = [(i, x) for i, x in self._early[rid] if i.peer != info.peer]
            for req in list(self._requests.values()):
                dest = req.dests.get(info.peer)
                if dest is not None:
                    self._stop(req, dest, error)

    def _tick(self, now: float) -> bool:
        with self._lock:
            for rid, early in list(self._early.items()):  # asked for, never added here
                stale = [(i, x) for i, x in early if now - x["arrived"] > self.request_timeout]
                for info, _ in stale:
                    reason = f"the prefiller was not given request {rid!r} within {self.request_timeout}s"
                    self._send(info, m.encode(m.CANCELLED, self.peer_id, rid=rid, issued=0, reason=reason))
                if stale:
                    self._early[rid] = [e for e in early if e not in stale]
                if not self._early[rid]:
                    del self._early[rid]
            for req in list(self._requests.values()):
                if now > req.deadline:
                    err = FabricTimeoutError(
                        f"request {req.rid!r} not finished within {self.request_timeout}s"
                    )
                    req.error = req.error or err
                    for dest in list(req.dests.values()):
                        self._stop(req, dest, err)
                    if req.expected_dests is None or all(d.confirmed for d in req.dests.values()):
                        self._finish(req, req.error)
        return False

    def _on_close(self) -> None:
        with self._lock:
            for req in list(self._requests.values()):
                self._finish(req, KvPeerLostError("the prefill endpoint closed"))


def _as_bytes(data: Any) -> bytes:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    if hasattr(data, "detach"):  # a torch tensor: its raw bytes
        t = data.detach().cpu().contiguous()
        return t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).tobytes()
    raise InvalidArgumentError(f"context must be bytes, a numpy array or a tensor, not {type(data).__name__}")
