"""The static transfer schedule: which trainer rank writes which slice of which parameter to which
inference rank, where, and in which order. Computed once from metadata alone (no tensors), by any
process (the controller); deterministic (the same descriptions give the same JSON, byte for byte).

How it is built:

1. **Units.** Each trainer parameter is cut into the boxes its placement's groups or ranks hold
   whole: a TP/EP shard is a unit held by one rank; an FSDP group's box is a unit held (after
   the group's all-gather) by every rank of the group; a replicated tensor is a unit held by
   every replica.
2. **Writes.** For every inference rank and target parameter, each part's chunk is intersected
   with the units of its source; each intersection is one write (data, plus the matching block
   scales for FP8) into the rank's local tensor at the part's offset, split into pieces of at
   most ``max_write_bytes`` (whole FP8 block rows).
3. **Writers.** Every write may come from any rank that holds its unit (replicas and FSDP group
   members alike); writes are assigned largest first to the least-loaded candidate (bytes), and
   each writer's writes to its least-loaded NIC. A gather runs only where its group has writes.
4. **Groups.** Units in order are cut into parameter groups of about ``group_bytes``; the trainers
   wait for their writes and meet at a barrier after each group.
5. **Checks.** Every byte of every inference tensor (and scale tensor) is written exactly once:
   no two writes overlap and together they cover it (``ScheduleError`` otherwise).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ScheduleError
from .layout import (
    DTYPE_SIZES,
    Box,
    SourceParam,
    TargetParam,
    box_numel,
    box_shape,
    intersect,
    scale_shape,
)

SCHEMA = "fabric-lib-weights-schedule/1"


@dataclass(frozen=True, slots=True)
class Unit:
    """A box of a trainer parameter that its ``holders`` each have whole; with ``gather``
    ("fsdp" or "flat"), only after ``gather_group`` (in placement order) all-gathered it."""

    index: int
    source: str
    box: Box
    holders: tuple[int, ...]
    gather: str | None
    gather_group: tuple[int, ...]
    param_group: int = 0
    needed: bool = False  # some holder writes from it (else its gather is skipped)


@dataclass(frozen=True, slots=True)
class Write:
    """One slice: trainer ``writer`` sends ``src_box`` of its unit (source coordinates) into
    ``dst_box`` of inference rank ``rank``'s local ``target`` tensor, and for FP8 the block
    scales into ``scale_box`` of the scale tensor. ``nic``: the writer's NIC index."""

    unit: int
    writer: int
    nic: int
    rank: int
    target: str
    src_box: Box
    dst_box: Box
    scale_box: Box | None

    @property
    def submissions(self) -> int:
        """Engine requests (and so immediates) this write makes: data, and scales for FP8."""
        return 1 if self.scale_box is None else 2


@dataclass(frozen=True)
class LocalPart:
    """Where one part lies in an inference rank's local tensor."""

    source: str
    box: Box  # of the source, in global coordinates
    offset: int  # along the target's fuse_dim


class Schedule:
    """A computed schedule; build with ``build_schedule``, share with ``to_json``/``from_json``."""

    def __init__(
        self,
        sources: Sequence[SourceParam],
        targets: Sequence[TargetParam],
        num_trainers: int,
        num_inference: int,
        nics_per_trainer: int,
        units: Sequence[Unit],
        writes: Sequence[Write],
        num_groups: int,
    ) -> None:
        self.sources = {s.name: s for s in sources}
        self.targets = {t.name: t for t in targets}
        self.num_trainers = num_trainers
        self.num_inference = num_inference
        self.nics_per_trainer = nics_per_trainer
        self.units = list(units)
        self.writes = list(writes)
        self.num_groups = num_groups
        self._locals: dict[tuple[str, int], tuple[tuple[int, ...], list[LocalPart]]] = {}

    # -- local tensors on the inference side ------------------------------------------------
    def local_layout(self, target: str, rank: int) -> tuple[tuple[int, ...], list[LocalPart]]:
        """The local shape of ``target`` on inference rank ``rank`` and where each part lies."""
        key = (target, rank)
        if key not in self._locals:
            self._locals[key] = _local_layout(self.targets[target], self.sources, rank)
        return self._locals[key]

    def tensors_of(self, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every tensor inference rank ``rank`` registers: name -> (local shape, dtype),
        scale tensors included."""
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for t in self.targets.values():
            if rank not in t.placement.ranks:
                continue
            shape, _ = self.local_layout(t.name, rank)
            out[t.name] = (shape, t.dtype)
            if t.quantized:
                out[t.scale_name] = (scale_shape(shape, t.block), "float32")
        return out

    # -- who does what ------------------------------------------------------------------------
    def writes_by(self, writer: int) -> list[Write]:
        """The writes trainer ``writer`` issues, in schedule order."""
        return [w for w in self.writes if w.writer == writer]

    def submissions_to(self, rank: int) -> int:
        """Immediates inference rank ``rank`` counts per update (one per engine request)."""
        return sum(w.submissions for w in self.writes if w.rank == rank)

    def write_bytes(self, w: Write) -> int:
        t = self.targets[w.target]
        n = box_numel(w.dst_box) * DTYPE_SIZES[t.dtype]
        return n + (box_numel(w.scale_box) * 4 if w.scale_box is not None else 0)

    def stats(self) -> dict[str, Any]:
        """Totals for inspection: bytes and requests per trainer, NIC and inference rank."""
        sent = [0] * self.num_trainers
        requests = [0] * self.num_trainers
        received = [0] * self.num_inference
        nic = [[0] * self.nics_per_trainer for _ in range(self.num_trainers)]
        gathered = [0] * self.num_trainers
        for w in self.writes:
            b = self.write_bytes(w)
            sent[w.writer] += b
            requests[w.writer] += w.submissions
            received[w.rank] += b
            nic[w.writer][w.nic] += b
        for u in self.units:
            if u.needed and u.gather:
                size = box_numel(u.box) * DTYPE_SIZES[self.sources[u.source].dtype]
                for r in u.gather_group:
                    gathered[r] += size
        return {
            "trainers": self.num_trainers,
            "inference_ranks": self.num_inference,
            "units": len(self.units),
            "gathers": sum(1 for u in self.units if u.needed and u.gather),
            "writes": len(self.writes),
            "requests": sum(requests),
            "param_groups": self.num_groups,
            "bytes": sum(sent),
            "bytes_sent": sent,
            "requests_sent": requests,
            "bytes_received": received,
            "bytes_per_nic": nic,
            "bytes_gathered": gathered,
        }

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "num_trainers": self.num_trainers,
            "num_inference": self.num_inference,
            "nics_per_trainer": self.nics_per_trainer,
            "num_groups": self.num_groups,
            "sources": [s.to_dict() for s in self.sources.values()],
            "targets": [t.to_dict() for t in self.targets.values()],
            "units": [
                [
                    u.index,
                    u.source,
                    _lists(u.box),
                    list(u.holders),
                    u.gather,
                    list(u.gather_group),
                    u.param_group,
                    u.needed,
                ]
                for u in self.units
            ],
            "writes": [
                [
                    w.unit,
                    w.writer,
                    w.nic,
                    w.rank,
                    w.target,
                    _lists(w.src_box),
                    _lists(w.dst_box),
                    None if w.scale_box is None else _lists(w.scale_box),
                ]
                for w in self.writes
            ],  # fmt: skip
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)

    def digest(self) -> str:
        """SHA-256 of the JSON form: every side can check it holds the same schedule."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schedule:
        if d.get("schema") != SCHEMA:
            raise ScheduleError(f"not a weight-transfer schedule ({SCHEMA}): schema {d.get('schema')!r}")
        units = [
            Unit(int(i), s, _box(b), tuple(h), g, tuple(gg), int(pg), bool(nd))
            for i, s, b, h, g, gg, pg, nd in d["units"]
        ]
        writes = [
            Write(int(u), int(wr), int(n), int(r), t, _box(sb), _box(db), None if scb is None else _box(scb))
            for u, wr, n, r, t, sb, db, scb in d["writes"]
        ]
        return cls(
            [SourceParam.from_dict(s) for s in d["sources"]],
            [TargetParam.from_dict(t) for t in d["targets"]],
            int(d["num_trainers"]),
            int(d["num_inference"]),
            int(d["nics_per_trainer"]),
            units,
            writes,
            int(d["num_groups"]),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Schedule:
        try:
            return cls.from_dict(json.loads(text))
        except (KeyError, TypeError, ValueError) as e:
            raise ScheduleError(f"malformed schedule JSON: {e!r}") from None


def _lists(box: Box) -> list[list[int]]:
    return [[lo, hi] for lo, hi in box]


def _box(value: Iterable[Iterable[int]]) -> Box:
    return tuple((int(lo), int(hi)) for lo, hi in value)


# -- building -------------------------------------------------------------------------------
def _local_layout(
    t: TargetParam, sources: dict[str, SourceParam], rank: int
) -> tuple[tuple[int, ...], list[LocalPart]]:
    parts: list[LocalPart] = []
    offset = 0
    shape: list[int] | None = None
    for name in t.parts:
        if name not in sources:
            raise ScheduleError(f"target {t.name}: part {name!r} is no trainer parameter")
        src = sources[name]
        if not 0 <= t.fuse_dim < len(src.shape):
            raise ScheduleError(
                f"target {t.name}: fuse_dim {t.fuse_dim} does not exist in {name}{list(src.shape)}"
            )
        piece = t.placement.piece_of(src.shape, rank, f"target {t.name} part {name}")
        if piece is None:
            raise ScheduleError(f"target {t.name}: inference rank {rank} is not in its placement")
        box = piece.box
        ext = list(box_shape(box))
        if shape is None:
            shape = ext
        else:
            others = [n for i, n in enumerate(ext) if i != t.fuse_dim]
            if len(ext) != len(shape) or others != [n for i, n in enumerate(shape) if i != t.fuse_dim]:
                raise ScheduleError(
                    f"target {t.name}: part {name} chunk {ext} cannot be concatenated with {shape} "
                    f"along dimension {t.fuse_dim}"
                )
            shape[t.fuse_dim] += ext[t.fuse_dim]
        parts.append(LocalPart(name, box, offset))
        offset += ext[t.fuse_dim]
    assert shape is not None
    return tuple(shape), parts


def _units(sources: Sequence[SourceParam], num_trainers: int) -> list[Unit]:
    units: list[Unit] = []
    for s in sources:
        pl = s.placement
        if pl.ranks and max(pl.ranks) >= num_trainers:
            raise ScheduleError(f"{s.name}: placement names trainer rank {max(pl.ranks)} of {num_trainers}")
        boxes = pl.group_boxes(s.shape, s.name)
        for group, box in zip(pl.groups, boxes, strict=True):
            if pl.inner == "replicate":
                units.append(Unit(len(units), s.name, box, tuple(sorted(group)), None, ()))
            elif pl.inner == "shard":
                for rank in group:
                    piece = pl.piece_of(s.shape, rank, s.name)
                    assert piece is not None
                    units.append(Unit(len(units), s.name, piece.box, (rank,), None, ()))
            else:
                units.append(Unit(len(units), s.name, box, tuple(sorted(group)), pl.inner, tuple(group)))
    return units


class _BoxIndex:
    """A source's units by where they start along dimension 0, so a query looks at the few
    that can meet it (a superset; the caller intersects)."""

    def __init__(self, units: list[Unit]) -> None:
        by_start: dict[int, list[Unit]] = defaultdict(list)
        for u in units:
            by_start[u.box[0][0]].append(u)
        self._starts = sorted(by_start)
        self._units = [by_start[s] for s in self._starts]
        # reach[i]: the furthest row any unit starting at or before starts[i] extends to
        self._reach = []
        furthest = 0
        for group in self._units:
            furthest = max([furthest, *(u.box[0][1] for u in group)])
            self._reach.append(furthest)

    def overlapping(self, box: Box) -> list[Unit]:
        lo, hi = box[0]
        first = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while first > 0 and self._reach[first - 1] > lo:
            first -= 1
        last = bisect.bisect_left(self._starts, hi)
        return [u for group in self._units[first:last] for u in group]


def _aligned(t: TargetParam, local_shape: tuple[int, ...], box: Box) -> bool:
    for d, b in ((len(local_shape) - 2, t.block[0]), (len(local_shape) - 1, t.block[1])):
        lo, hi = box[d]
        if lo % b or (hi % b and hi != local_shape[d]):
            return False
    return True


def _scale_box(t: TargetParam, box: Box) -> Box:
    *lead, (r0, r1), (c0, c1) = box
    b0, b1 = t.block
    return (*lead, (r0 // b0, -(-r1 // b0)), (c0 // b1, -(-c1 // b1)))


def _split(
    t: TargetParam, src_box: Box, dst_box: Box, row_bytes: int, max_bytes: int
) -> list[tuple[Box, Box]]:
    """Cuts a write into pieces of at most ``max_bytes`` along dimension 0 (whole block rows
    for a 2-D FP8 tensor)."""
    rows = dst_box[0][1] - dst_box[0][0]
    if rows * row_bytes <= max_bytes or rows == 1:
        return [(src_box, dst_box)]
    step = max(1, max_bytes // row_bytes)
    if t.quantized and len(dst_box) == 2:
        step = max(t.block[0], step - step % t.block[0])
    out = []
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        s = ((src_box[0][0] + start, src_box[0][0] + stop), *src_box[1:])
        d = ((dst_box[0][0] + start, dst_box[0][0] + stop), *dst_box[1:])
        out.append((s, d))
    return out


def build_schedule(
    sources: Sequence[SourceParam],
    targets: Sequence[TargetParam],
    *,
    num_trainers: int,
    num_inference: int,
    nics_per_trainer: int = 1,
    max_write_bytes: int = 64 << 20,
    group_bytes: int = 1 << 30,
) -> Schedule:
    """Computes the schedule (see the module docstring). ``sources`` in the order the trainers
    should send them (model order keeps FSDP gathers and barriers in layer order)."""
    if num_trainers < 1 or num_inference < 1 or nics_per_trainer < 1:
        raise ScheduleError("num_trainers, num_inference and nics_per_trainer must be at least 1")
    if max_write_bytes < 1 or group_bytes < 1:
        raise ScheduleError("max_write_bytes and group_bytes must be positive")
    if len(set(s.name for s in sources)) != len(sources):
        raise ScheduleError("trainer parameter names must be unique")
    if len(set(t.name for t in targets)) != len(targets):
        raise ScheduleError("inference parameter names must be unique")
    scale_names = [t.scale_name for t in targets if t.quantized]
    if set(scale_names) & {t.name for t in targets} or len(set(scale_names)) != len(scale_names):
        raise ScheduleError("scale tensor names must differ from every other inference tensor name")
    by_name = {s.name: s for s in sources}
    by_target = {t.name: t for t in targets}
    units = _units(sources, num_trainers)
    units_of: dict[str, list[Unit]] = defaultdict(list)
    for u in units:
        units_of[u.source].append(u)
    index = {name: _BoxIndex(us) for name, us in units_of.items()}

    # Writes, each with its candidate writers (holder rank -> the unit it would send from).
    pending: list[tuple[int, Box, Box, Box | None, str, int, dict[int, int]]] = []
    for t in targets:
        itemsize = DTYPE_SIZES[t.dtype]
        for rank in t.placement.ranks:
            if rank >= num_inference:
                raise ScheduleError(
                    f"target {t.name}: placement names inference rank {rank} of {num_inference}"
                )
            shape, parts = _local_layout(t, by_name, rank)
            if t.quantized:
                scale_shape(shape, t.block)  # at least 2-D
            row_bytes = math.prod(shape[1:]) * itemsize
            for part in parts:
                by_box: dict[Box, dict[int, int]] = {}
                for u in index[part.source].overlapping(part.box):
                    inter = intersect(part.box, u.box)
                    if inter is None:
                        continue
                    cands = by_box.setdefault(inter, {})
                    for h in u.holders:
                        cands.setdefault(h, u.index)
                for inter in sorted(by_box):
                    dst = tuple(
                        (
                            lo - pl + (part.offset if d == t.fuse_dim else 0),
                            hi - pl + (part.offset if d == t.fuse_dim else 0),
                        )
                        for d, ((lo, hi), (pl, _)) in enumerate(zip(inter, part.box, strict=True))
                    )
                    if t.quantized and not _aligned(t, shape, dst):
                        raise ScheduleError(
                            f"target {t.name} on inference rank {rank}: the slice {list(dst)} of {part.source} "
                            f"does not align with the {t.block} FP8 blocks (a block would mix two trainer "
                            f"units or two parts); use a placement whose chunks are multiples of the block"
                        )
                    for s_box, d_box in _split(t, inter, dst, row_bytes, max_write_bytes):
                        scale = _scale_box(t, d_box) if t.quantized else None
                        nbytes = box_numel(d_box) * itemsize + (box_numel(scale) * 4 if scale else 0)
                        pending.append((nbytes, s_box, d_box, scale, t.name, rank, by_box[inter]))

    # Writers: largest first to the least-loaded candidate; then NICs likewise per writer.
    load = [0] * num_trainers
    order = sorted(range(len(pending)), key=lambda i: (-pending[i][0], i))
    writer_of = [0] * len(pending)
    for i in order:
        cands = pending[i][6]
        best = min(cands, key=lambda r: (load[r], r))
        writer_of[i] = best
        load[best] += pending[i][0]
    nic_load = [[0] * nics_per_trainer for _ in range(num_trainers)]
    nic_of = [0] * len(pending)
    for i in order:
        loads = nic_load[writer_of[i]]
        n = min(range(nics_per_trainer), key=lambda k: (loads[k], k))
        nic_of[i] = n
        loads[n] += pending[i][0]

    writes_of_unit: dict[int, list[Write]] = defaultdict(list)
    for i, (_, s_box, d_box, scale, tname, rank, cands) in enumerate(pending):
        w = writer_of[i]
        writes_of_unit[cands[w]].append(Write(cands[w], w, nic_of[i], rank, tname, s_box, d_box, scale))

    # Groups: units in order, cut every ``group_bytes`` of writes.
    final_units: list[Unit] = []
    writes: list[Write] = []
    group, acc = 0, 0
    for u in units:
        ws = writes_of_unit.get(u.index, [])
        final_units.append(
            Unit(u.index, u.source, u.box, u.holders, u.gather, u.gather_group, group, bool(ws))
        )
        writes.extend(ws)
        acc += sum(_bytes_of(by_target[w.target], w) for w in ws)
        if acc >= group_bytes:
            group, acc = group + 1, 0
    num_groups = 1 + max((u.param_group for u in final_units if u.needed), default=0)
    schedule = Schedule(
        sources, targets, num_trainers, num_inference, nics_per_trainer, final_units, writes, num_groups
    )
    check_exclusive_cover(schedule)
    return schedule


def _bytes_of(t: TargetParam, w: Write) -> int:
    return box_numel(w.dst_box) * DTYPE_SIZES[t.dtype] + (box_numel(w.scale_box) * 4 if w.scale_box else 0)


def _disjoint_cover(boxes: list[Box], shape: tuple[int, ...], what: str) -> None:
    numel = math.prod(shape)
    total = sum(box_numel(b) for b in boxes)
    for b in boxes:
        if any(lo < 0 or hi > n for (lo, hi), n in zip(b, shape, strict=True)):
            raise ScheduleError(f"{what}: write {list(b)} lies outside the tensor {list(shape)}")
    # Sweep along dimension 0: only boxes whose row ranges overlap can collide.
    active: list[Box] = []
    for b in sorted(boxes):
        active = [a for a in active if a[0][1] > b[0][0]]
        for a in active:
            if intersect(a, b) is not None:
                raise ScheduleError(
                    f"{what}: writes {list(a)} and {list(b)} overlap (two writers on one byte)"
                )
        active.append(b)
    if total != numel:
        raise ScheduleError(
            f"{what}: writes cover {total} of {numel} elements (a full update must cover every one)"
        )


def check_exclusive_cover(schedule: Schedule) -> None:
    """Raises ``ScheduleError`` unless every element of every inference tensor (and scale
    tensor) is written by exactly one write."""
    data: dict[tuple[int, str], list[Box]] = defaultdict(list)
    scales: dict[tuple[int, str], list[Box]] = defaultdict(list)
    for w in schedule.writes:
        data[(w.rank, w.target)].append(w.dst_box)
        if w.scale_box is not None:
            scales[(w.rank, w.target)].append(w.scale_box)
    for t in schedule.targets.values():
        for rank in t.placement.ranks:
            shape, _ = schedule.local_layout(t.name, rank)
            _disjoint_cover(data.get((rank, t.name), []), shape, f"{t.name} on inference rank {rank}")
            if t.quantized:
                _disjoint_cover(
                    scales.get((rank, t.name), []),
                    scale_shape(shape, t.block),
                    f"{t.scale_name} on inference rank {rank}",
                )
