"""fabric_lib.kv_cache across processes over tcp: byte-exact pages for many concurrent requests
(all layouts, TP 1->2 and 2->1, chunking that matches the decoder's count or not), cancellation
from both sides, killed prefillers and decoders, a prefiller joining late."""

from __future__ import annotations

import itertools
import random
import time
from contextlib import closing
from typing import Any

import pytest
from fabric_lib.kv_cache import KvLayout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .nodes import D_BLOCKS, P_BLOCKS, Node, NodeState, spawn_node

LAYOUTS = {
    "nhd-bf16": KvLayout("nhd", 3, 4, 4, 8, "bfloat16"),
    "hnd-fp8": KvLayout("hnd", 2, 3, 4, 8, "float8_e4m3fn"),
    "mla-bf16": KvLayout("mla", 2, 16, 1, 24, "bfloat16"),
}
SEEDS = {"p1": 11, "p2": 22, "p3": 33}
SENTINEL = 0xAB
_rids = itertools.count()


def endpoint_specs(role: str, layout: KvLayout, instance: str, tp: int, kw: dict, **extra) -> list[dict]:
    """The ``tp`` ranks of one instance, as ``spawn_node`` takes them."""
    return [
        {
            "name": f"{instance}r{r}",
            "role": role,
            "instance": instance,
            "tp_size": tp,
            "tp_rank": r,
            "layout": layout.to_dict(),
            "kw": kw,
            **extra,
        }
        for r in range(tp)
    ]


def prefill_specs(layout: KvLayout, instance: str, tp: int, **kw) -> list[dict]:
    return endpoint_specs("prefill", layout, instance, tp, kw, seed=SEEDS[instance])


def decode_specs(layout: KvLayout, instance: str, tp: int, **kw) -> list[dict]:
    return endpoint_specs("decode", layout, instance, tp, kw)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def cluster(request):
    layout = LAYOUTS[request.param]
    p_specs = prefill_specs(layout, "p1", 1, chunk_tokens=8) + prefill_specs(layout, "p2", 2)
    d_specs = decode_specs(layout, "d1", 1) + decode_specs(layout, "d2", 2)
    with closing(spawn_node("prefill", p_specs)) as p, closing(spawn_node("decode", d_specs)) as d:
        for name in d.addresses:
            assert d.call(NodeState.connect, name=name, addresses=list(p.addresses.values())) == 3
        yield layout, p, d


request_st = st.tuples(
    st.sampled_from(["p1", "p2"]),
    st.sampled_from(["d1", "d2"]),
    st.integers(1, 40),  # prompt tokens
    st.integers(1, 5),  # chunks the prefiller runs
    st.sampled_from([0, 8, 40]),  # context bytes
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(request_st, min_size=1, max_size=5), seed=st.integers(0, 2**16))
@pytest.mark.timeout(120)
def test_concurrent_requests_are_byte_exact(cluster, batch, seed) -> None:
    layout, p, d = cluster
    rng = random.Random(seed)
    d_free = {i: rng.sample(range(D_BLOCKS), D_BLOCKS) for i in ("d1", "d2")}
    p_free = {i: rng.sample(range(P_BLOCKS), P_BLOCKS) for i in ("p1", "p2")}
    serve, checks = [], []
    for d_name in d.addresses:
        d.call(NodeState.fill, name=d_name, value=SENTINEL)
    for pi, di, n, chunks, ctx in batch:
        rid = f"r{next(_rids)}"
        nb = layout.blocks_for(n)
        if len(d_free[di]) < nb or len(p_free[pi]) < nb:
            continue
        d_blocks = [d_free[di].pop() for _ in range(nb)]
        p_blocks = [p_free[pi].pop() for _ in range(nb)]
        ends = sorted(set(rng.sample(range(1, n + 1), min(chunks, n)) + [n]))
        for r in range(2 if di == "d2" else 1):
            d.call(
                NodeState.request,
                name=f"{di}r{r}",
                rid=rid,
                instance=pi,
                blocks=d_blocks,
                num_tokens=n,
                ctx=ctx,
            )
            checks.append((f"{di}r{r}", rid, SEEDS[pi], p_blocks, d_blocks, ctx))
        for r in range(2 if pi == "p2" else 1):
            serve.append((rid, f"{pi}r{r}", p_blocks, n, ends, ctx))
    assert all(v is None for v in p.call(NodeState.serve, rids=serve).values())
    used: dict[str, set[int]] = {}
    for name, rid, p_seed, p_blocks, d_blocks, ctx in checks:
        assert (
            d.call(
                NodeState.check,
                name=name,
                rid=rid,
                p_seed=p_seed,
                p_blocks=p_blocks,
                d_blocks=d_blocks,
                ctx=ctx,
            )
            == []
        )
        used.setdefault(name, set()).update(d_blocks)
    for name in d.addresses:
        rest = [b for b in range(D_BLOCKS) if b not in used.get(name, set())]
        assert d.call(NodeState.untouched, name=name, blocks=rest, value=SENTINEL), (
            "pages written outside the requests"
        )


# -- failures and membership (one layout, fresh processes) ------------------------------------
LAYOUT = LAYOUTS["nhd-bf16"]
N_TOKENS = 37  # 10 blocks, 5 chunks of 8
ENDS = [8, 16, 24, 32, 37]
P_BL, D_BL = list(range(10)), list(range(20, 30))


def request_pages(
    d: Node, rid: str, instance: str, blocks: list[int] = D_BL, ctx: int = 0, name: str = "d1r0"
) -> None:
    """Decoder endpoint ``name`` asks prefill ``instance`` for the N_TOKENS-token request ``rid``
    (and ``ctx`` context bytes), its pages to land in ``blocks``."""
    d.call(
        NodeState.request, name=name, rid=rid, instance=instance, blocks=blocks, num_tokens=N_TOKENS, ctx=ctx
    )


def serve_pages(
    p: Node, rid: str, instance: str, ctx: int = 0, ends: list[int] = ENDS, **kw: Any
) -> dict[str, str | None]:
    """Prefill ``instance`` (its rank 0) sends ``rid`` from its blocks P_BL in chunks ending at
    ``ends``; ``kw`` as ``NodeState.serve`` (stop_after, cancel_after, start_at, wait)."""
    return p.call(NodeState.serve, rids=[(rid, f"{instance}r0", P_BL, N_TOKENS, ends, ctx)], **kw)


def mismatches(d: Node, rid: str, instance: str, d_blocks: list[int] = D_BL, ctx: int = 0) -> list[str]:
    """How what decoder d1r0 holds for ``rid`` in ``d_blocks`` differs from ``instance``'s P_BL."""
    return d.call(
        NodeState.check,
        name="d1r0",
        rid=rid,
        p_seed=SEEDS[instance],
        p_blocks=P_BL,
        d_blocks=d_blocks,
        ctx=ctx,
    )


def layer_matches(d: Node, layer: int) -> bool:
    """Whether ``layer`` of decoder d1r0's blocks D_BL holds prefill p1's pages P_BL."""
    return d.call(
        NodeState.layer_matches, name="d1r0", layer=layer, p_seed=SEEDS["p1"], p_blocks=P_BL, d_blocks=D_BL
    )


@pytest.fixture
def pair():
    p_specs = prefill_specs(LAYOUT, "p1", 1, chunk_tokens=8) + prefill_specs(LAYOUT, "p3", 1, chunk_tokens=8)
    with (
        closing(spawn_node("prefill", p_specs)) as p,
        closing(spawn_node("decode", decode_specs(LAYOUT, "d1", 1))) as d,
    ):
        d.call(NodeState.connect, name="d1r0", addresses=list(p.addresses.values()))
        yield p, d


@pytest.mark.timeout(120)
@pytest.mark.parametrize("side", ["decoder", "prefiller"])
def test_cancel_is_confirmed_and_nothing_lands_after(pair, side) -> None:
    p, d = pair
    d.call(NodeState.fill, name="d1r0", value=SENTINEL)
    request_pages(d, "c", "p1", ctx=8)
    if side == "decoder":
        serve_pages(p, "c", "p1", ctx=8, stop_after=2)  # 2 of 5 chunks
        d.call(NodeState.cancel, name="d1r0", rid="c")  # returns once the prefiller confirmed
    else:
        serve_pages(p, "c", "p1", ctx=8, cancel_after={"c": 1}, wait=False)
    err, _ = d.call(NodeState.outcome, name="d1r0", rid="c")
    assert err == "KvRequestCancelledError"
    frozen = d.call(NodeState.snapshot, name="d1r0")
    assert p.call(NodeState.send_outcomes, rids=["c"]) == {"c": "KvRequestCancelledError"}
    # the prefill engine runs the request's remaining chunks anyway: nothing may land any more
    serve_pages(p, "c", "p1", ctx=8, start_at=2, wait=False)
    time.sleep(0.5)
    assert d.call(NodeState.snapshot, name="d1r0") == frozen, "bytes landed after the confirmed cancel"
    # the decoder's blocks and immediate are free again: a new request into them completes
    request_pages(d, "c3", "p3")
    assert serve_pages(p, "c3", "p3") == {"c3": None}
    assert mismatches(d, "c3", "p3") == []


@pytest.mark.timeout(120)
def test_killed_prefiller_fails_its_requests_only(pair) -> None:
    p, d = pair
    with closing(spawn_node("prefill-b", prefill_specs(LAYOUT, "p2", 1, chunk_tokens=8))) as other:
        d.call(NodeState.connect, name="d1r0", addresses=list(other.addresses.values()))
        request_pages(d, "dead", "p1")
        request_pages(d, "live", "p2", blocks=list(range(40, 50)))
        serve_pages(p, "dead", "p1", stop_after=2)
        t0 = time.monotonic()
        p.kill()
        err, _ = d.call(NodeState.outcome, name="d1r0", rid="dead", timeout=30)
        assert err == "KvPeerLostError"
        assert time.monotonic() - t0 < 2.0 + 3.0  # peer_timeout + slack
        assert serve_pages(other, "live", "p2") == {"live": None}
        assert mismatches(d, "live", "p2", d_blocks=list(range(40, 50))) == []


@pytest.mark.timeout(120)
def test_killed_decoder_fails_its_requests_only(pair) -> None:
    p, d = pair
    with closing(spawn_node("decode-b", decode_specs(LAYOUT, "d2", 1))) as d2:
        d2.call(NodeState.connect, name="d2r0", addresses=list(p.addresses.values()))
        request_pages(d, "live", "p1")
        request_pages(d2, "dead", "p3", name="d2r0")
        serve_pages(p, "dead", "p3", stop_after=2)
        deadline = time.monotonic() + 10  # the prefiller has its request: pages are arriving
        while d2.call(NodeState.pending)["d2r0/dead"][2] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        d2.kill()
        t0 = time.monotonic()
        assert serve_pages(p, "live", "p1") == {"live": None}
        # the dead decoder's writes fail (TransferError) or its heartbeats stop (KvPeerLostError)
        assert p.call(NodeState.send_outcomes, rids=["dead"])["dead"] in ("TransferError", "KvPeerLostError")
        assert time.monotonic() - t0 < 2.0 + 5.0
        assert mismatches(d, "live", "p1") == []


@pytest.mark.timeout(120)
def test_prefiller_joining_after_the_decoders_started(pair) -> None:
    p, d = pair
    with closing(spawn_node("prefill-late", prefill_specs(LAYOUT, "p2", 1))) as late:
        # the newcomer joins with the decoder's address only; the decoder learns it from HELLO
        late.call(NodeState.connect, name="p2r0", addresses=list(d.addresses.values()))
        request_pages(d, "new", "p2", ctx=40)
        assert serve_pages(late, "new", "p2", ctx=40, ends=[N_TOKENS]) == {"new": None}
        assert mismatches(d, "new", "p2", ctx=40) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layerwise", [False, True])
def test_immediates_are_reused_after_completion_and_cancel(layerwise) -> None:
    """A decoder owning two immediate slots serves many requests in turn (a cancelled one
    included); a third concurrent request is refused with KvCapacityError."""
    d_specs = decode_specs(LAYOUT, "d1", 1, imm_count=2, layerwise=layerwise)
    with (
        closing(spawn_node("prefill", prefill_specs(LAYOUT, "p1", 1, chunk_tokens=8))) as p,
        closing(spawn_node("decode", d_specs)) as d,
    ):
        d.call(NodeState.connect, name="d1r0", addresses=list(p.addresses.values()))
        for i in range(6):
            rid = f"seq{i}"
            d.call(NodeState.fill, name="d1r0", value=SENTINEL)  # each request must write its pages anew
            request_pages(d, rid, "p1", ctx=8)
            if i == 2:  # cancelled half way: its immediate comes back only after the confirmation
                serve_pages(p, rid, "p1", ctx=8, stop_after=2)
                d.call(NodeState.cancel, name="d1r0", rid=rid)
                continue
            assert serve_pages(p, rid, "p1", ctx=8) == {rid: None}
            assert mismatches(d, rid, "p1", ctx=8) == []
        request_pages(d, "x1", "p1")
        request_pages(d, "x2", "p1", blocks=list(range(40, 50)))
        with pytest.raises(RuntimeError, match="KvCapacityError"):
            request_pages(d, "x3", "p1", blocks=list(range(50, 60)))


@pytest.mark.timeout(120)
def test_layerwise_loading_releases_each_layer_as_it_lands() -> None:
    """With ``layerwise=True`` a decoder learns of each layer on its own: a layer the prefiller
    released is loaded (and byte-exact) while later layers still time out and hold no bytes;
    a cancel after some layers settles with the layers that landed."""
    with (
        closing(spawn_node("prefill", prefill_specs(LAYOUT, "p1", 1))) as p,
        closing(spawn_node("decode", decode_specs(LAYOUT, "d1", 1, layerwise=True))) as d,
    ):
        d.call(NodeState.connect, name="d1r0", addresses=list(p.addresses.values()))
        d.call(NodeState.fill, name="d1r0", value=SENTINEL)
        request_pages(d, "lw", "p1", ctx=8)
        p.call(NodeState.begin_pass, name="p1r0", rid="lw", blocks=P_BL, num_tokens=N_TOKENS)
        for layer in range(LAYOUT.num_layers):
            p.call(NodeState.release_layer, name="p1r0", layer=layer)
            assert d.call(NodeState.layer_loaded, name="d1r0", rid="lw", layer=layer, within=10) is None
            assert layer_matches(d, layer)
            for later in range(layer + 1, LAYOUT.num_layers):
                assert (
                    d.call(NodeState.layer_loaded, name="d1r0", rid="lw", layer=later, within=0.2)
                    == "FabricTimeoutError"
                )
                assert not layer_matches(d, later)
        assert d.call(NodeState.pending)["d1r0/lw"][0] is False  # the context is still missing
        p.call(NodeState.send_context, name="p1r0", rid="lw", n=8)
        assert mismatches(d, "lw", "p1", ctx=8) == []
        # cancelled after one of three layers: the layer landed, the others fail with the cancel
        d.call(NodeState.fill, name="d1r0", value=SENTINEL)
        request_pages(d, "lw2", "p1")
        p.call(NodeState.begin_pass, name="p1r0", rid="lw2", blocks=P_BL, num_tokens=N_TOKENS)
        p.call(NodeState.release_layer, name="p1r0", layer=0)
        assert d.call(NodeState.layer_loaded, name="d1r0", rid="lw2", layer=0, within=10) is None
        d.call(NodeState.cancel, name="d1r0", rid="lw2")
        assert (
            d.call(NodeState.layer_loaded, name="d1r0", rid="lw2", layer=1, within=1)
            == "KvRequestCancelledError"
        )
        assert d.call(NodeState.outcome, name="d1r0", rid="lw2")[0] == "KvRequestCancelledError"
