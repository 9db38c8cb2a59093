"""The TP planning of fabric_lib.kv_cache: applying every rank pair's paged-write plan to sharded
pages reproduces exactly each decoder rank's shard (all layouts, TP pairs, block lists)."""

from __future__ import annotations

import numpy as np
import pytest
from fabric_lib.errors import InvalidArgumentError
from fabric_lib.kv_cache import KvLayout, chunk_blocks, destinations, plan_pair, sources
from hypothesis import given, settings
from hypothesis import strategies as st


def shard(layout: KvLayout, pages: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s pages (``[blocks, *block_shape]`` as bytes) of the global ``pages``."""
    if layout.kind == "mla":
        return pages.copy()
    lo, hi = layout.head_range(tp, rank)
    head_axis = 3 if layout.kind == "nhd" else 2
    return np.ascontiguousarray(np.take(pages, range(lo, hi), axis=head_axis))


def apply(plan, src: np.ndarray, src_blocks, dst: np.ndarray, dst_blocks) -> None:
    """What the engine's paged write does, on flat byte views."""
    s, d = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    for su, du in zip(plan.units(src_blocks), plan.units(dst_blocks), strict=True):
        a = su * plan.src_unit_stride + plan.src_offset
        b = du * plan.dst_unit_stride + plan.dst_offset
        d[b : b + plan.length] = s[a : a + plan.length]


TP_PAIRS = [(1, 1), (2, 2), (4, 8), (8, 4), (1, 4), (4, 1), (2, 8), (8, 2)]


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["nhd", "hnd", "mla"]),
    tp=st.sampled_from(TP_PAIRS),
    block_size=st.sampled_from([1, 2, 3, 16]),
    head_dim=st.sampled_from([1, 4, 6]),
    heads_mult=st.sampled_from([1, 2]),
    itemsize=st.sampled_from(["bfloat16", "float8_e4m3fn", "float32"]),
    data=st.data(),
)
def test_every_decoder_rank_gets_exactly_its_shard(
    kind, tp, block_size, head_dim, heads_mult, itemsize, data
) -> None:
    src_tp, dst_tp = tp
    heads = 1 if kind == "mla" else max(src_tp, dst_tp) * heads_mult
    layout = KvLayout(kind, 1, block_size, heads, head_dim, itemsize)
    n = data.draw(st.integers(1, 6))
    src_blocks = data.draw(st.lists(st.integers(0, 7), min_size=n, max_size=n, unique=True))
    dst_blocks = data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n, unique=True))
    rng = np.random.default_rng(n)
    gshape = layout.block_shape(1)
    global_src = rng.integers(0, 256, (8, *gshape[:-1], gshape[-1] * layout.itemsize), dtype=np.uint8)
    for d in range(dst_tp):
        dst = np.zeros((10, *shard(layout, global_src, dst_tp, d).shape[1:]), dtype=np.uint8)
        srcs = sources(layout, src_tp, dst_tp, d)
        assert srcs, "every decoder rank reads from someone"
        for p in range(src_tp):
            plan = plan_pair(layout, src_tp, p, dst_tp, d)
            assert (plan is not None) == (p in srcs)
            assert (d in destinations(layout, src_tp, p, dst_tp)) == (p in srcs)
            if plan is not None:
                apply(plan, shard(layout, global_src, src_tp, p), src_blocks, dst, dst_blocks)
        want = shard(layout, global_src, dst_tp, d)[src_blocks]
        assert np.array_equal(dst[dst_blocks], want)
        untouched = [b for b in range(10) if b not in dst_blocks]
        assert not dst[untouched].any(), "a plan wrote outside the destination blocks"


def test_hnd_same_tp_is_one_write_per_page_and_tp_change_one_run_per_half() -> None:
    layout = KvLayout("hnd", 2, 16, 8, 128, "bfloat16")
    same = plan_pair(layout, 4, 1, 4, 1)
    assert same is not None and same.units_per_block == 1 and same.length == layout.page_bytes(4)
    split = plan_pair(layout, 4, 1, 8, 3)  # P rank 1 holds heads 2,3; D rank 3 holds head 3
    assert split is not None and split.units_per_block == 2
    assert split.length == 16 * 128 * 2 and split.src_offset == split.length and split.dst_offset == 0


def test_mla_spreads_decoder_ranks_over_prefiller_ranks() -> None:
    layout = KvLayout("mla", 2, 16, 1, 576, "bfloat16")
    assert [sources(layout, 4, 8, d) for d in range(8)] == [[d % 4] for d in range(8)]


def test_bad_tp_and_layouts_are_typed_errors() -> None:
    with pytest.raises(InvalidArgumentError):
        KvLayout("nhd", 2, 16, 6, 128).heads_per_rank(4)
    with pytest.raises(InvalidArgumentError):
        KvLayout("xyz", 2, 16, 8, 128)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        KvLayout("nhd", 2, 16, 8, 128, "complex64")
    with pytest.raises(InvalidArgumentError):
        plan_pair(KvLayout("nhd", 2, 16, 8, 128), 4, 4, 4, 0)


@given(block=st.integers(1, 16), tokens=st.integers(1, 200), chunk=st.integers(1, 64))
def test_chunks_send_each_block_once(block: int, tokens: int, chunk: int) -> None:
    sent, seen = 0, list[int]()
    for end in [*range(chunk, tokens, chunk), tokens]:
        lo, hi = chunk_blocks(block, tokens, sent, end)
        assert lo == sent and hi * block <= max(end, 0) + block - 1 + (block if end >= tokens else 0)
        seen.extend(range(lo, hi))
        sent = hi
    assert seen == list(range(-(-tokens // block)))
