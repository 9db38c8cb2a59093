"""Parameter metadata: names, global shapes, dtypes and how ranks hold them (placements).

A placement splits a tensor in two levels, which covers every layout of the usual trainers and
inference engines:

- ``groups``: rank lists. The *outer* level either gives every group the whole tensor
  (``outer_dim=None``: replicas, HSDP's replica groups, inference instances) or chunk ``g`` of
  dimension ``outer_dim`` to group ``g`` (expert parallelism: a group holds a range of experts).
- ``inner``: how the ranks of one group hold the group's box:
  ``"replicate"`` (each rank holds all of it), ``"shard"`` (rank ``i`` holds chunk ``i`` along
  ``dim``: TP row/column shards, EP shards; no gather is needed to use a shard),
  ``"fsdp"`` (FSDP2-style: chunk ``i`` along dimension 0, rows padded to ``ceil(rows / n)``; the
  group all-gathers it before use) or ``"flat"`` (FSDP1-style: chunk ``i`` of the flattened box,
  padded to ``ceil(numel / n)`` elements; all-gathered before use).

Shapes must split evenly for ``"shard"`` and for the outer level (what TP and EP require);
``"fsdp"`` and ``"flat"`` pad like FSDP does. Every description is plain data: ``to_dict`` /
``from_dict`` round-trip through JSON.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .errors import ScheduleError

#: One ``(start, stop)`` per dimension, in elements.
Box = tuple[tuple[int, int], ...]
Inner = Literal["replicate", "shard", "fsdp", "flat"]

#: Bytes per element of the dtypes this module moves.
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "uint8": 1}
FP8 = "float8_e4m3fn"


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def box_numel(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(al, bl), min(ah, bh)) for (al, ah), (bl, bh) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _chunk(box: Box, dim: int, parts: int, index: int, what: str) -> Box:
    lo, hi = box[dim]
    if (hi - lo) % parts:
        raise ScheduleError(
            f"{what}: dimension {dim} of extent {hi - lo} does not split into {parts} equal parts"
        )
    step = (hi - lo) // parts
    return box[:dim] + ((lo + index * step, lo + (index + 1) * step),) + box[dim + 1 :]


@dataclass(frozen=True)
class Piece:
    """What one rank holds of a tensor: ``box`` of the global tensor, or with ``flat`` only the
    elements ``[flat[0], flat[1])`` of that box flattened (FSDP1), or with ``rows`` only those
    rows (dimension 0) of it (FSDP2); ``padded`` is the local length (elements or rows) once
    padded for the gather."""

    rank: int
    box: Box
    flat: tuple[int, int] | None = None
    rows: tuple[int, int] | None = None
    padded: int = 0


@dataclass(frozen=True)
class Placement:
    """How a set of ranks holds a tensor; see the module docstring. Use the constructors below."""

    groups: tuple[tuple[int, ...], ...]
    outer_dim: int | None = None
    inner: Inner = "replicate"
    dim: int = 0

    def __post_init__(self) -> None:
        if not self.groups or any(not g for g in self.groups):
            raise ScheduleError("a placement needs at least one non-empty rank group")
        ranks = [r for g in self.groups for r in g]
        if len(set(ranks)) != len(ranks) or min(ranks) < 0:
            raise ScheduleError(f"placement ranks must be distinct and non-negative: {self.groups}")
        if self.inner not in ("replicate", "shard", "fsdp", "flat"):
            raise ScheduleError(f"inner must be replicate, shard, fsdp or flat, not {self.inner!r}")

    @property
    def ranks(self) -> list[int]:
        return sorted(r for g in self.groups for r in g)

    @property
    def gathered(self) -> bool:
        """Whether a group must all-gather its box before using it (FSDP)."""
        return self.inner in ("fsdp", "flat")

    def group_boxes(self, shape: Sequence[int], what: str = "tensor") -> list[Box]:
        """The box each group holds as a whole."""
        full = full_box(shape)
        if self.outer_dim is None:
            return [full for _ in self.groups]
        self._check_dim(self.outer_dim, shape, what)
        return [_chunk(full, self.outer_dim, len(self.groups), g, what) for g in range(len(self.groups))]

    def pieces(self, shape: Sequence[int], what: str = "tensor") -> list[Piece]:
        """Every rank's piece, groups in order, ranks in group order."""
        out = []
        for group, box in zip(self.groups, self.group_boxes(shape, what), strict=True):
            n = len(group)
            for i, rank in enumerate(group):
                if self.inner == "replicate":
                    out.append(Piece(rank, box))
                elif self.inner == "shard":
                    self._check_dim(self.dim, shape, what)
                    out.append(Piece(rank, _chunk(box, self.dim, n, i, what)))
                elif self.inner == "fsdp":
                    rows = box[0][1] - box[0][0] if box else 1
                    per = -(-rows // n)
                    out.append(
                        Piece(rank, box, rows=(min(i * per, rows), min((i + 1) * per, rows)), padded=per)
                    )
                else:
                    numel = box_numel(box)
                    per = -(-numel // n)
                    out.append(
                        Piece(rank, box, flat=(min(i * per, numel), min((i + 1) * per, numel)), padded=per)
                    )
        return out

    def piece_of(self, shape: Sequence[int], rank: int, what: str = "tensor") -> Piece | None:
        """``rank``'s piece, or None when the placement gives it nothing (cached)."""
        try:
            return _pieces_by_rank(self, tuple(shape)).get(rank)
        except ScheduleError:
            self.pieces(shape, what)  # the same error, naming the tensor
            raise

    def local_shape(self, piece: Piece) -> tuple[int, ...]:
        """The shape of the tensor a rank holds for ``piece`` (unpadded)."""
        if piece.flat is not None:
            return (piece.flat[1] - piece.flat[0],)
        shape = box_shape(piece.box)
        if piece.rows is not None:
            return (piece.rows[1] - piece.rows[0], *shape[1:])
        return shape

    def _check_dim(self, dim: int, shape: Sequence[int], what: str) -> None:
        if not 0 <= dim < len(shape):
            raise ScheduleError(f"{what}: dimension {dim} does not exist in shape {list(shape)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": [list(g) for g in self.groups],
            "outer_dim": self.outer_dim,
            "inner": self.inner,
            "dim": self.dim,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        return cls(
            tuple(tuple(int(r) for r in g) for g in d["groups"]),
            d.get("outer_dim"),
            d["inner"],
            int(d["dim"]),
        )


@functools.lru_cache(maxsize=4096)
def _pieces_by_rank(placement: Placement, shape: tuple[int, ...]) -> dict[int, Piece]:
    return {p.rank: p for p in placement.pieces(shape)}


def _ranks(ranks: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(r) for r in ranks)


def replicated(ranks: Sequence[int]) -> Placement:
    """Every rank holds the whole tensor."""
    return Placement((_ranks(ranks),), None, "replicate")


def sharded(dim: int, ranks: Sequence[int]) -> Placement:
    """Rank ``ranks[i]`` holds chunk ``i`` along ``dim`` (TP: dim 0 for column-parallel layers'
    weights, dim 1 for row-parallel ones)."""
    return Placement((_ranks(ranks),), None, "shard", dim)


def expert_sharded(ranks: Sequence[int]) -> Placement:
    """Stacked experts ``[experts, ...]``: rank ``ranks[i]`` holds chunk ``i`` of the experts."""
    return sharded(0, ranks)


def fsdp_sharded(ranks: Sequence[int], replicas: Sequence[Sequence[int]] = ()) -> Placement:
    """FSDP2 (``Shard(0)``): dimension 0 split over ``ranks``; with ``replicas``, HSDP: each rank
    list holds its own sharded copy."""
    groups = (_ranks(ranks), *(_ranks(g) for g in replicas))
    return Placement(groups, None, "fsdp")


def flat_sharded(ranks: Sequence[int], replicas: Sequence[Sequence[int]] = ()) -> Placement:
    """FSDP1 flat parameters: the flattened tensor split over ``ranks``, padded at the end."""
    groups = (_ranks(ranks), *(_ranks(g) for g in replicas))
    return Placement(groups, None, "flat")


def grouped(
    groups: Sequence[Sequence[int]], *, outer_dim: int | None, inner: Inner, dim: int = 0
) -> Placement:
    """The general two-level placement, e.g. EP over groups and FSDP inside each:
    ``grouped(ep_groups, outer_dim=0, inner="shard")``."""
    return Placement(tuple(_ranks(g) for g in groups), outer_dim, inner, dim)


@dataclass(frozen=True)
class SourceParam:
    """A trainer parameter: its name, global shape, dtype and placement over trainer ranks."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    placement: Placement

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise ScheduleError(
                f"{self.name}: unsupported dtype {self.dtype!r} (known: {sorted(DTYPE_SIZES)})"
            )
        if not self.shape or any(n < 1 for n in self.shape):
            raise ScheduleError(f"{self.name}: shape must have positive extents, got {list(self.shape)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "placement": self.placement.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SourceParam:
        return cls(
            d["name"], tuple(int(n) for n in d["shape"]), d["dtype"], Placement.from_dict(d["placement"])
        )


def source(name: str, shape: Sequence[int], dtype: str, placement: Placement) -> SourceParam:
    return SourceParam(name, tuple(int(n) for n in shape), dtype, placement)


def default_scale_name(name: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv`` (the name block-FP8 checkpoints use)."""
    return f"{name}_scale_inv"


@dataclass(frozen=True)
class TargetParam:
    """An inference parameter, made of one or more trainer parameters (``parts``).

    On each inference rank the local tensor is the concatenation along ``fuse_dim`` of each
    part's chunk under ``placement`` (as vLLM's fused qkv / gate_up layers hold
    ``[q_r; k_r; v_r]``). With ``dtype="float8_e4m3fn"`` the local tensor is block-quantized:
    blocks of ``block`` elements over the last two dimensions, one fp32 scale per block (the
    dequantization multiplier) in a second tensor ``scale_name`` of shape
    ``[..., ceil(rows / block[0]), ceil(cols / block[1])]``.
    """

    name: str
    parts: tuple[str, ...]
    placement: Placement
    dtype: str = "bfloat16"
    fuse_dim: int = 0
    block: tuple[int, int] = (128, 128)
    scale_name: str = ""

    def __post_init__(self) -> None:
        if not self.parts:
            raise ScheduleError(f"{self.name}: a target needs at least one part")
        if self.dtype not in DTYPE_SIZES:
            raise ScheduleError(f"{self.name}: unsupported dtype {self.dtype!r}")
        if self.placement.gathered:
            raise ScheduleError(f"{self.name}: inference placements hold whole chunks (replicate or shard)")
        if self.quantized and not self.scale_name:
            object.__setattr__(self, "scale_name", default_scale_name(self.name))
        if self.quantized and any(b < 1 for b in self.block):
            raise ScheduleError(f"{self.name}: block sizes must be positive, got {self.block}")

    @property
    def quantized(self) -> bool:
        return self.dtype == FP8

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "parts": list(self.parts),
            "placement": self.placement.to_dict(),
            "dtype": self.dtype,
            "fuse_dim": self.fuse_dim,
            "block": list(self.block),
            "scale_name": self.scale_name,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TargetParam:
        return cls(
            d["name"],
            tuple(d["parts"]),
            Placement.from_dict(d["placement"]),
            d["dtype"],
            int(d["fuse_dim"]),
            (int(d["block"][0]), int(d["block"][1])),
            d.get("scale_name", ""),
        )


def target(
    name: str,
    parts: Sequence[str] | str,
    placement: Placement,
    *,
    dtype: str = "bfloat16",
    fuse_dim: int = 0,
    block: tuple[int, int] = (128, 128),
    scale_name: str = "",
) -> TargetParam:
    return TargetParam(
        name,
        (parts,) if isinstance(parts, str) else tuple(parts),
        placement,
        dtype,
        fuse_dim,
        block,
        scale_name,
    )


def scale_shape(shape: Sequence[int], block: tuple[int, int]) -> tuple[int, ...]:
    """The block-scale tensor's shape for a quantized tensor of ``shape``."""
    if len(shape) < 2:
        raise ScheduleError(f"FP8 block quantization needs at least 2 dimensions, got {list(shape)}")
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


@dataclass(frozen=True)
class Runs:
    """Where a box of a row-major tensor lies in its memory: ``len(pages)`` runs of
    ``page_len`` bytes, run ``i`` at byte ``offset + pages[i] * page_stride``."""

    offset: int
    page_len: int
    page_stride: int
    pages: tuple[int, ...]


def box_runs(shape: Sequence[int], box: Box, itemsize: int) -> Runs:
    """The contiguous runs of ``box`` in a row-major tensor of ``shape`` (one run when the box
    is a block of whole trailing rows)."""
    ndim = len(shape)
    k = ndim - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    inner = math.prod(shape[k + 1 :]) * itemsize
    page_len = (box[k][1] - box[k][0]) * inner
    offset = box[k][0] * inner
    if k == 0:
        return Runs(offset, page_len, 0, (0,))
    unit = shape[k] * inner  # the stride of dimension k - 1; outer strides are multiples of it
    strides = [math.prod(shape[j + 1 : k]) for j in range(k)]  # in units of ``unit``
    pages = [0]
    for j in range(k):
        lo, hi = box[j]
        pages = [p + i * strides[j] for p in pages for i in range(lo, hi)]
    if len(pages) == 1:
        return Runs(offset + pages[0] * unit, page_len, 0, (0,))
    return Runs(offset, page_len, unit, tuple(pages))
