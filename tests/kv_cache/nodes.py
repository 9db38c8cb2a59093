"""Processes for the KV-cache tests: ``spawn_node`` starts one process ("spawn" context) hosting
named KV endpoints (one engine each, tcp, adaptive polling) and runs commands sent over a Pipe.

Cache contents are deterministic: ``global_pages(layout, seed, layer, n)`` is a model-wide
(all heads) cache; each prefill rank holds its TP shard of it, so a decoder knows the exact bytes
it must receive from the plan, the block ids and the seeds alone.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
from fabric_lib.errors import InvalidArgumentError
from fabric_lib.testing import spawn_ranks

R = TypeVar("R")
P_BLOCKS, D_BLOCKS = 48, 64


def global_pages(layout: Any, seed: int, layer: int, n: int) -> np.ndarray:
    """``n`` model-wide pages of one layer as bytes: ``[n, *block_shape(tp=1)[:-1], head_dim * itemsize]``."""
    shape = layout.block_shape(1)
    rng = np.random.default_rng([seed, layer])
    return rng.integers(0, 256, (n, *shape[:-1], shape[-1] * layout.itemsize), dtype=np.uint8)


def shard(layout: Any, pages: np.ndarray, tp: int, rank: int) -> np.ndarray:
    if layout.kind == "mla":
        return pages.copy()
    lo, hi = layout.head_range(tp, rank)
    return np.ascontiguousarray(np.take(pages, range(lo, hi), axis=3 if layout.kind == "nhd" else 2))


def context_bytes(rid: str, n: int) -> bytes:
    return np.random.default_rng(zlib.crc32(rid.encode())).integers(0, 256, n, dtype=np.uint8).tobytes()


class Node:
    """The test's handle on a node: one rank of ``fabric_lib.testing`` whose state is a
    ``NodeState``; ``call(NodeState.method, **kw)`` runs a method there."""

    def __init__(self, name: str, endpoints: list[dict[str, Any]]) -> None:
        self.name = name
        self._ranks = spawn_ranks(
            1,
            setup=open_node,
            setup_kwargs={"specs": endpoints},
            teardown=close_node,
            names=[name],
            timeout=90,
        )
        (self.rank,) = self._ranks
        self.addresses: dict[str, bytes] = self.rank.call(endpoint_addresses)

    def call(self, fn: Callable[..., R], /, timeout: float = 60.0, **kw: Any) -> R:
        return self.rank.submit(fn, **kw).result(timeout)

    def kill(self) -> None:
        self.rank.kill()

    def close(self) -> None:
        self._ranks.close()


def spawn_node(name: str, endpoints: list[dict[str, Any]]) -> Node:
    """Starts a node hosting ``endpoints``: dicts with ``name``, ``role`` ("prefill" or
    "decode"), ``instance``, ``tp_size``, ``tp_rank``, ``layout`` (a KvLayout dict), ``seed``
    (prefill: cache contents) and optional endpoint keyword arguments ``kw``."""
    return Node(name, endpoints)


# -- the child ----------------------------------------------------------------------------
def open_node(specs: list[dict[str, Any]]) -> NodeState:
    """The node rank's setup."""
    import logging

    import torch

    logging.basicConfig(level=os.environ.get("KV_TEST_LOG", "WARNING"))
    torch.set_num_threads(1)
    return NodeState(specs)


def close_node(node: NodeState) -> None:
    node.close()


def endpoint_addresses(node: NodeState) -> dict[str, bytes]:
    return {n: e.engine.main_address.to_bytes() for n, e in node.endpoints.items()}


class NodeState:
    def __init__(self, specs: list[dict[str, Any]]) -> None:
        import fabric_lib
        import torch
        from fabric_lib.kv_cache import KvLayout, KvReceiver, KvSender

        self.endpoints: dict[str, Any] = {}
        self.specs = {s["name"]: s for s in specs}
        self.requests: dict[str, Any] = {}
        self.send_futures: dict[str, Any] = {}
        self.caches: dict[str, list[Any]] = {}
        for s in specs:
            layout = KvLayout.from_dict(s["layout"])
            engine = fabric_lib.TransferEngine("tcp", poll_mode="adaptive", transfer_timeout=10.0)
            nb = P_BLOCKS if s["role"] == "prefill" else D_BLOCKS
            caches = []
            for layer in range(layout.num_layers):
                t = torch.zeros(layout.layer_shape(nb, s["tp_size"]), dtype=getattr(torch, layout.dtype))
                if s["role"] == "prefill":
                    raw = shard(
                        layout, global_pages(layout, s["seed"], layer, nb), s["tp_size"], s["tp_rank"]
                    )
                    t.view(torch.uint8).view(-1).copy_(torch.from_numpy(raw.reshape(-1)))
                caches.append(t)
            self.caches[s["name"]] = caches
            cls = KvSender if s["role"] == "prefill" else KvReceiver
            kw = {"heartbeat_interval": 0.2, "peer_timeout": 2.0, **s.get("kw", {})}
            self.endpoints[s["name"]] = cls(
                engine,
                layout,
                caches,
                instance=s["instance"],
                tp_size=s["tp_size"],
                tp_rank=s["tp_rank"],
                **kw,
            )

    def close(self) -> None:
        for e in self.endpoints.values():
            e.close()
            e.engine.stop()

    # -- commands ---------------------------------------------------------------------------
    def connect(self, name: str, addresses: list[bytes]) -> int:
        for a in addresses:
            self.endpoints[name].connect(a)
        return len(self.endpoints[name].peers)

    def request(
        self,
        name: str,
        rid: str,
        instance: str,
        blocks: list[int],
        num_tokens: int,
        ctx: int = 0,
        num_chunks: int | None = None,
    ) -> None:
        self.requests[f"{name}/{rid}"] = self.endpoints[name].request(
            rid, instance, blocks, num_tokens, context_bytes=ctx, num_chunks=num_chunks
        )

    def fill(self, name: str, value: int) -> None:
        for c in self.caches[name]:
            c.view(-1).view(__import__("torch").uint8).fill_(value)

    def outcome(self, name: str, rid: str, timeout: float = 30.0) -> tuple[str | None, float]:
        """(error class name or None, seconds waited) once the request settled."""
        req = self.requests[f"{name}/{rid}"]
        t0 = time.monotonic()
        try:
            req.wait(timeout)
            err = None
        except Exception as e:  # noqa: BLE001 - reported by name
            err = type(e).__name__
        req.released.result(timeout)
        return err, time.monotonic() - t0

    def cancel(self, name: str, rid: str, timeout: float = 20.0) -> None:
        self.endpoints[name].cancel(rid).result(timeout)

    def snapshot(self, name: str) -> list[bytes]:
        return [bytes(c.view(-1).view(__import__("torch").uint8).numpy()) for c in self.caches[name]]

    def check(
        self, name: str, rid: str, p_seed: int, p_blocks: list[int], d_blocks: list[int], ctx: int = 0
    ) -> list[str]:
        """Mismatches between the received pages (and context) and the expected shard."""
        ep, spec = self.endpoints[name], self.specs[name]
        req = self.requests[f"{name}/{rid}"]
        got_ctx = req.wait(30)
        errors = []
        if ctx and got_ctx != context_bytes(rid, ctx):
            errors.append(f"{rid}: context differs")
        for layer, cache in enumerate(self.caches[name]):
            want = shard(
                ep.layout, global_pages(ep.layout, p_seed, layer, P_BLOCKS), spec["tp_size"], spec["tp_rank"]
            )
            got = cache.view(-1).view(__import__("torch").uint8).numpy().reshape(D_BLOCKS, -1)
            if not np.array_equal(got[d_blocks], want[p_blocks].reshape(len(p_blocks), -1)):
                errors.append(f"{rid}: layer {layer} pages differ")
        return errors

    def untouched(self, name: str, blocks: list[int], value: int) -> bool:
        import torch

        return all(
            bool((c.view(-1).view(torch.uint8).reshape(D_BLOCKS, -1)[blocks] == value).all())
            for c in self.caches[name]
        )

    def serve(
        self,
        rids: list[tuple[str, str, list[int], int, list[int], int]],
        wait: bool = True,
        cancel_after: dict[str, int] | None = None,
        stop_after: int | None = None,
        start_at: int = 0,
    ) -> dict[str, str | None]:
        """Prefill: ``(rid, endpoint, blocks, num_tokens, chunk_ends, ctx)`` requests, run as
        lock-step forward passes (pass k computes every request's k-th chunk, all layers);
        ``cancel_after[rid] = k`` cancels after pass k; ``stop_after`` stops (no more passes)
        after that many passes without waiting; ``start_at`` resumes earlier requests."""
        for rid, name, blocks, n, _, _ in rids:
            if not start_at:
                self.send_futures[f"{name}/{rid}"] = self.endpoints[name].add_request(rid, blocks, n)
        passes = max(len(r[4]) for r in rids)
        for k in range(start_at, passes):
            if stop_after is not None and k >= stop_after:
                return {}
            by_ep: dict[str, dict[str, int]] = {}
            for rid, name, _, _, ends, _ in rids:
                if k < len(ends) and (start_at or not self.send_futures[f"{name}/{rid}"].done()):
                    by_ep.setdefault(name, {})[rid] = ends[k]
            for name, progress in by_ep.items():
                ep = self.endpoints[name]
                fwd = ep.begin_forward(progress)
                for layer in range(ep.layout.num_layers):
                    fwd.layer_ready(layer)
                fwd.wait(30)
            for rid, name, _, _, ends, ctx in rids:
                if k == len(ends) - 1 and ctx:
                    finished = self.send_futures[f"{name}/{rid}"].done()
                    try:
                        self.endpoints[name].send_context(rid, context_bytes(rid, ctx))
                    except InvalidArgumentError:
                        if not finished:  # only a finished (cancelled) request may refuse it
                            raise
                if cancel_after and cancel_after.get(rid) == k:
                    self.endpoints[name].cancel(rid)
        if not wait:
            return {}
        return self.send_outcomes([r[0] for r in rids])

    def send_outcomes(self, rids: list[str], timeout: float = 30.0) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for key, future in self.send_futures.items():
            rid = key.split("/", 1)[1]
            if rid not in rids:
                continue
            try:
                future.result(timeout)
                out.setdefault(rid, None)
            except Exception as e:  # noqa: BLE001 - reported by name
                out[rid] = out.get(rid) or type(e).__name__
        return out

    def pending(self) -> dict[str, tuple[bool, int, int]]:
        """Decoder requests: (done, expected immediates, immediates counted so far)."""
        return {k: (r.future.done(), r.expected, r.arrived()) for k, r in self.requests.items()}

    def begin_pass(self, name: str, rid: str, blocks: list[int], num_tokens: int) -> None:
        """Prefill: one forward pass over the whole prompt of ``rid``; layers are released one
        by one with ``release_layer``."""
        ep = self.endpoints[name]
        self.send_futures[f"{name}/{rid}"] = ep.add_request(rid, blocks, num_tokens)
        self.passes = getattr(self, "passes", {})
        self.passes[name] = ep.begin_forward({rid: num_tokens})

    def send_context(self, name: str, rid: str, n: int) -> None:
        self.endpoints[name].send_context(rid, context_bytes(rid, n))

    def release_layer(self, name: str, layer: int) -> None:
        self.passes[name].layer_ready(layer)

    def layer_loaded(self, name: str, rid: str, layer: int, within: float) -> str | None:
        """Decoder: None once ``layer`` landed, else the error's class name."""
        try:
            self.requests[f"{name}/{rid}"].wait_for_layer(layer, within)
            return None
        except Exception as e:  # noqa: BLE001 - reported by name
            return type(e).__name__

    def layer_matches(
        self, name: str, layer: int, p_seed: int, p_blocks: list[int], d_blocks: list[int]
    ) -> bool:
        """Whether ``layer``'s pages in ``d_blocks`` hold the prefiller's shard."""
        ep, spec = self.endpoints[name], self.specs[name]
        want = shard(
            ep.layout, global_pages(ep.layout, p_seed, layer, P_BLOCKS), spec["tp_size"], spec["tp_rank"]
        )
        got = self.caches[name][layer].view(-1).view(__import__("torch").uint8).numpy().reshape(D_BLOCKS, -1)
        return bool(np.array_equal(got[d_blocks], want[p_blocks].reshape(len(p_blocks), -1)))

    def pause(self, seconds: float) -> None:
        threading.Event().wait(seconds)


# -- a real model (transformers, random weights from a config) ------------------------------
def tiny_llama(config: dict[str, Any], seed: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(config)
    dtype = getattr(torch, config.pop("dtype", "float32"))
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config)).to(dtype).eval()


def layer_kv(cache: Any, layer: int) -> tuple[Any, Any]:
    """One layer's K/V tensors of a DynamicCache (``layers`` in newer transformers)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def pages_from_kv(layout: Any, cache: Any, blocks: Any, k: Any, v: Any, lo: int, hi: int) -> None:
    """Writes tokens ``[lo, hi)`` of one layer's K/V (``[1, heads, tokens, head_dim]``) into
    the paged ``cache`` (index kernels only, so it can run inside a CUDA graph capture;
    ``blocks`` may be a list or a tensor on the cache's device)."""
    import torch

    blocks = torch.as_tensor(blocks, device=cache.device)
    t = torch.arange(lo, hi, device=cache.device)
    b, o = blocks[t // layout.block_size], t % layout.block_size
    for kv, src in ((0, k), (1, v)):
        rows = src[0, :, lo:hi].transpose(0, 1)  # [tokens, heads, head_dim]
        if layout.kind == "nhd":
            cache[b, kv, o] = rows
        else:
            cache[b, kv, :, o] = rows


def kv_from_pages(layout: Any, cache: Any, blocks: list[int], n: int) -> tuple[Any, Any]:
    """One layer's K/V ``[1, heads, n, head_dim]`` gathered from the paged ``cache``."""
    pages = cache[blocks]  # [nb, 2, ...]
    if layout.kind == "nhd":  # [nb, 2, bs, H, D] -> [2, H, nb*bs, D]
        kv = pages.permute(1, 3, 0, 2, 4).reshape(2, pages.shape[3], -1, pages.shape[4])
    else:  # [nb, 2, H, bs, D] -> [2, H, nb*bs, D]
        kv = pages.permute(1, 2, 0, 3, 4).reshape(2, pages.shape[2], -1, pages.shape[4])
    return kv[0, :, :n].unsqueeze(0).contiguous(), kv[1, :, :n].unsqueeze(0).contiguous()


def _raw(t: Any) -> bytes:
    """A tensor's bytes (any dtype, bf16 included)."""
    import torch

    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _greedy_steps(model: Any, cache: Any, first_logits: Any, steps: int) -> list[Any]:
    import torch

    out, logits = [], first_logits
    with torch.no_grad():
        for _ in range(steps):
            token = logits.argmax(-1).reshape(1, 1)
            logits = model(token, past_key_values=cache, use_cache=True).logits[0, -1]
            out.append(logits.clone())
    return out


def prefill_model(
    self: Any,
    name: str,
    rid: str,
    config: dict[str, Any],
    seed: int,
    prompt: list[int],
    chunk: int,
    blocks: list[int],
    steps: int,
) -> dict[str, Any]:
    """Chunked prefill with per-layer streaming (a forward hook per decoder layer pages the
    chunk's K/V and reports the layer), the last logits as the context, then the reference:
    greedy decoding from this process's own cache (no disaggregation)."""
    import torch
    from transformers import DynamicCache

    model, ep, caches = tiny_llama(config, seed), self.endpoints[name], self.caches[name]
    cache, n = DynamicCache(), len(prompt)
    done = ep.add_request(rid, blocks, n)
    state: dict[str, Any] = {}

    def hook(layer: int) -> Any:
        def after(module: Any, args: Any, output: Any) -> None:
            keys, values = layer_kv(cache, layer)
            pages_from_kv(ep.layout, caches[layer], blocks, keys, values, state["lo"], state["hi"])
            state["fwd"].layer_ready(layer)

        return after

    handles = [blk.register_forward_hook(hook(i)) for i, blk in enumerate(model.model.layers)]
    with torch.no_grad():
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            state.update(lo=lo, hi=hi, fwd=ep.begin_forward({rid: hi}))
            logits = model(torch.tensor([prompt[lo:hi]]), past_key_values=cache, use_cache=True).logits[0, -1]
            state["fwd"].wait(30)
    for h in handles:
        h.remove()
    ep.send_context(rid, logits.contiguous())
    done.result(30)
    ref = _greedy_steps(model, cache, logits, steps)
    return {"first": _raw(logits), "steps": [_raw(x) for x in ref]}


def decode_model(
    self: Any, name: str, rid: str, config: dict[str, Any], seed: int, n: int, blocks: list[int], steps: int
) -> dict[str, Any]:
    """Waits for the request, rebuilds a DynamicCache from the received pages, decodes."""
    import torch
    from transformers import DynamicCache

    model, ep, caches = tiny_llama(config, seed), self.endpoints[name], self.caches[name]
    ctx = self.requests[f"{name}/{rid}"].wait(60)
    first = torch.frombuffer(bytearray(ctx), dtype=getattr(torch, ep.layout.dtype))
    cache = DynamicCache()
    for layer in range(ep.layout.num_layers):
        k, v = kv_from_pages(ep.layout, caches[layer], blocks, n)
        cache.update(k, v, layer)
    got = _greedy_steps(model, cache, first, steps)
    return {"first": _raw(first), "steps": [_raw(x) for x in got]}
