"""Which bytes of which pages a prefiller rank writes to a decoder rank (pure functions).

Every page is cut into ``units_per_block`` equal *units* (a token row for NHD, a K or V half for
HND, the whole block when a rank's entire page goes over); the heads two ranks share are one
contiguous byte run inside each unit. A rank pair therefore needs exactly one paged write per
layer: unit ``b * units_per_block + u`` of every block ``b``, ``length`` bytes at ``offset``
inside the unit, with each side's own unit stride. The same write shape serves any block list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .layout import KvLayout, check_tp


@dataclass(frozen=True)
class PairPlan:
    """One paged write per layer from (src_tp, src_rank) to (dst_tp, dst_rank)."""

    units_per_block: int
    src_unit_stride: int
    dst_unit_stride: int
    src_offset: int
    dst_offset: int
    length: int

    def units(self, blocks: Sequence[int]) -> list[int]:
        """The unit (paged-write page) indices of ``blocks``, in order."""
        u = self.units_per_block
        return [b * u + i for b in blocks for i in range(u)]


def sources(layout: KvLayout, src_tp: int, dst_tp: int, dst_rank: int) -> list[int]:
    """Prefiller ranks that hold a part of what decoder rank ``dst_rank`` needs, in rank order.

    MLA caches are replicated: each decoder rank reads one prefiller rank, ``dst_rank % src_tp``,
    which spreads the pairs over the prefiller's ranks (and so over their NICs)."""
    check_tp(dst_tp, dst_rank)
    check_tp(src_tp, 0)
    if layout.kind == "mla":
        return [dst_rank % src_tp]
    lo, hi = layout.head_range(dst_tp, dst_rank)
    per_src = layout.heads_per_rank(src_tp)
    return list(range(lo // per_src, (hi - 1) // per_src + 1))


def destinations(layout: KvLayout, src_tp: int, src_rank: int, dst_tp: int) -> list[int]:
    """Decoder ranks of a ``dst_tp`` instance that read from prefiller rank ``src_rank``."""
    check_tp(src_tp, src_rank)
    return [d for d in range(dst_tp) if src_rank in sources(layout, src_tp, dst_tp, d)]


def plan_pair(layout: KvLayout, src_tp: int, src_rank: int, dst_tp: int, dst_rank: int) -> PairPlan | None:
    """The paged-write shape from one prefiller rank to one decoder rank; None if they share
    nothing (MLA: every pair but the chosen source)."""
    check_tp(src_tp, src_rank)
    check_tp(dst_tp, dst_rank)
    if src_rank not in sources(layout, src_tp, dst_tp, dst_rank):
        return None
    src_page, dst_page = layout.page_bytes(src_tp), layout.page_bytes(dst_tp)
    if layout.kind == "mla":
        return PairPlan(1, src_page, dst_page, 0, 0, src_page)
    s_lo, s_hi = layout.head_range(src_tp, src_rank)
    d_lo, d_hi = layout.head_range(dst_tp, dst_rank)
    lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
    if (lo, hi) == (s_lo, s_hi) == (d_lo, d_hi):
        return PairPlan(1, src_page, dst_page, 0, 0, src_page)  # whole pages: one unit per block
    item = layout.itemsize
    if layout.kind == "nhd":
        units, head_bytes = 2 * layout.block_size, layout.head_dim * item
    else:  # hnd: a head's tokens are contiguous inside each K/V half
        units, head_bytes = 2, layout.block_size * layout.head_dim * item
    return PairPlan(
        units_per_block=units,
        src_unit_stride=src_page // units,
        dst_unit_stride=dst_page // units,
        src_offset=(lo - s_lo) * head_bytes,
        dst_offset=(lo - d_lo) * head_bytes,
        length=(hi - lo) * head_bytes,
    )


def chunk_blocks(block_size: int, num_tokens: int, sent_blocks: int, tokens_done: int) -> tuple[int, int]:
    """Blocks ``[sent_blocks, end)`` that become complete once ``tokens_done`` tokens of a
    ``num_tokens`` prompt are computed (the last, partial block only with the last token)."""
    end = -(-num_tokens // block_size) if tokens_done >= num_tokens else tokens_done // block_size
    return sent_blocks, max(sent_blocks, end)
