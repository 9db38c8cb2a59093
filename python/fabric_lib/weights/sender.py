"""The trainer side: runs this rank's part of the schedule after each training step.

For each unit in schedule order: (optional) host->device copy of an offloaded shard, the FSDP
all-gather among the unit's group (``torch.distributed``), then for each of this rank's writes
from it: slice and pack into staging memory (fuse, TP re-split), quantize (FP8), and submit the
one-sided write with the version's immediate. Writes complete on the engine while the next units
are gathered and packed; the staging memory's size bounds what is in flight. After each parameter
group every trainer waits for its writes and meets the others at a barrier (immediates over the
engine, bounded by ``barrier_timeout``).

Failures: a write an inference rank refuses or that times out fails that rank; this rank skips
its later writes to it but keeps running the schedule (gathers and barriers stay in step with the
other trainers) and raises ``WeightsPeerLostError`` naming the inference ranks at the end. A
trainer that fails a gather or misses a barrier makes ``update`` raise ``WeightsPeerLostError``
at once. Either way the inference side sees the version incomplete.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..engine import MrDescriptor, TransferEngine
from ..errors import FabricError, FabricTimeoutError, InvalidArgumentError
from .errors import ScheduleError, WeightsPeerLostError
from .layout import DTYPE_SIZES, Box, box_numel, box_runs, box_shape
from .manifest import Manifest
from .prefetch import Prefetcher
from .receiver import DEFAULT_IMM_BASE, update_imm
from .schedule import Schedule, Unit, Write
from .staging import StagingPool
from .transforms import gather_unit, quantize_fp8_blocks, slice_box, torch_dtype

#: Default immediates of the trainers' barriers: ``base + ((seq & 0xFF) << 12) + sender``.
DEFAULT_BARRIER_IMM_BASE = 0x57100000
MAX_TRAINERS = 1 << 12

STAGES = ("h2d", "gather", "fuse", "quantize", "submit", "wait")


@dataclass
class UpdateStats:
    """What one ``update`` did on this trainer rank; ``seconds`` per stage (host time; on a GPU
    with ``profile=True`` each stage is synchronized so its kernels are counted in it)."""

    version: int
    total_s: float = 0.0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    bytes: int = 0
    writes: int = 0
    requests: int = 0
    gathers: int = 0
    staging_peak: int = 0
    skipped: int = 0  # writes not issued because their inference rank had failed


def scale_offset(data_len: int) -> int:
    """Where a slice's scales start after its data in staging memory (16-byte aligned)."""
    return -(-data_len // 16) * 16


class _Inflight:
    """Requests submitted and not yet completed; the first error per inference rank."""

    def __init__(self, pool: StagingPool) -> None:
        self._pool = pool
        self._cond = threading.Condition()
        self.outstanding = 0
        self._refs: dict[int, int] = {}
        self.errors: dict[int, BaseException] = {}

    def add(self, slot: int, n: int) -> None:
        with self._cond:
            self.outstanding += n
            self._refs[slot] = n

    def done(self, slot: int, rank: int, error: BaseException | None) -> None:
        with self._cond:
            self.outstanding -= 1
            if error is not None:
                self.errors.setdefault(rank, error)
            self._refs[slot] -= 1
            last = self._refs[slot] == 0
            if last:
                del self._refs[slot]
            self._cond.notify_all()
        if last:
            self._pool.release(slot)

    def failed(self, rank: int) -> bool:
        with self._cond:
            return rank in self.errors

    def wait_all(self, deadline: float) -> None:
        with self._cond:
            while self.outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FabricTimeoutError(
                        f"{self.outstanding} writes still in flight at the update's deadline"
                    )
                self._cond.wait(left)


class WeightSender:
    """One trainer rank's side of the schedule.

    Args:
        engine: this rank's TransferEngine (its immediates from ``barrier_imm_base`` are the
            barriers').
        schedule: the ``Schedule`` (or its JSON), the same on every trainer.
        rank: this rank's index among the trainers (its rank in ``group``).
        params: name -> the local tensor this rank holds of every trainer parameter its
            placement gives it (FSDP shards may carry their padding). Tensors are read at each
            ``update``, so pass the live training parameters (e.g. ``p.data`` or a DTensor's
            ``to_local()``); CPU tensors are copied to ``device`` first (offloaded shards).
        manifests: every inference rank's ``WeightReceiver.manifest()``.
        group: the trainers' ``torch.distributed`` process group (default: the world); gather
            groups are created from it.
        device: where gathering, packing and quantizing happen, and where the staging memory
            lives (default: the device of the parameters, else CPU).
        staging_bytes: staging memory: the watermark on packed data in flight.
        prefetch_bytes: the watermark on units gathered ahead of the one being packed (default:
            ``staging_bytes``); a unit larger than it is gathered alone.
        barrier_timeout: seconds a barrier waits for the other trainers.
        gather_timeout: the timeout of the gather groups' collectives.
        profile: synchronize the device after each stage so stage times include GPU work.
    """

    def __init__(
        self,
        engine: TransferEngine,
        schedule: Schedule | str | bytes,
        rank: int,
        params: Mapping[str, Any],
        manifests: Sequence[bytes | str],
        *,
        group: Any = None,
        device: Any = None,
        staging_bytes: int = 256 << 20,
        prefetch_bytes: int | None = None,
        imm_base: int = DEFAULT_IMM_BASE,
        barrier_imm_base: int = DEFAULT_BARRIER_IMM_BASE,
        barrier_timeout: float = 30.0,
        gather_timeout: float = 30.0,
        profile: bool = False,
    ) -> None:
        import torch
        import torch.distributed as dist

        self.schedule = schedule if isinstance(schedule, Schedule) else Schedule.from_json(schedule)
        sched = self.schedule
        if not 0 <= rank < sched.num_trainers:
            raise InvalidArgumentError(
                f"rank {rank} is not one of the schedule's {sched.num_trainers} trainers"
            )
        if sched.num_trainers > MAX_TRAINERS:
            raise InvalidArgumentError(f"at most {MAX_TRAINERS} trainers")
        self.engine, self.rank = engine, rank
        self.imm_base, self.barrier_imm_base = imm_base, barrier_imm_base
        self.barrier_timeout, self.profile = barrier_timeout, profile
        self.params = dict(params)
        self._check_params()
        if device is None:
            devices = {t.device for t in self.params.values() if t.device.type != "cpu"}
            device = next(iter(devices)) if devices else torch.device("cpu")
        self.device = torch.device(device)

        manifest_of: dict[int, Manifest] = {}
        for data in manifests:
            m = Manifest.from_bytes(data)
            manifest_of[m.rank] = m
        missing = [r for r in range(sched.num_inference) if r not in manifest_of]
        if missing:
            raise ScheduleError(f"no manifest from inference ranks {missing}")
        for r, m in manifest_of.items():
            m.check_against(sched.tensors_of(r))
        self._dst: dict[tuple[int, str], tuple[MrDescriptor, tuple[int, ...], int]] = {}
        for r, m in manifest_of.items():
            for name, e in m.tensors.items():
                self._dst[(r, name)] = (e.descriptor, e.shape, DTYPE_SIZES[e.dtype])

        self._units = sched.units
        self._mine: dict[int, list[Write]] = defaultdict(list)
        for w in sched.writes:
            if w.writer == rank:
                self._mine[w.unit].append(w)
        biggest = max((sched.write_bytes(w) for ws in self._mine.values() for w in ws), default=0)
        if biggest + 1024 > staging_bytes:
            raise InvalidArgumentError(
                f"staging_bytes {staging_bytes} is below this rank's largest write ({biggest} bytes); "
                "raise it or build the schedule with a smaller max_write_bytes"
            )
        self.pool = StagingPool(engine, staging_bytes, self.device)
        self._side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.prefetch_bytes = staging_bytes if prefetch_bytes is None else prefetch_bytes

        # torch.distributed: gather groups (created by their members only) and trainer addresses.
        self._group = group
        self._pgs: dict[tuple[int, ...], Any] = {}
        if sched.num_trainers > 1:
            if not dist.is_initialized():
                raise InvalidArgumentError("torch.distributed must be initialized among the trainers")
            if dist.get_world_size(group) != sched.num_trainers or dist.get_rank(group) != rank:
                raise InvalidArgumentError(
                    f"rank {rank} of {sched.num_trainers} trainers, but the process group says "
                    f"{dist.get_rank(group)} of {dist.get_world_size(group)}"
                )
            needed = sorted(
                {u.gather_group for u in self._units if u.needed and u.gather and rank in u.gather_group}
            )
            for ranks in needed:
                glob = [dist.get_global_rank(group, r) if group is not None else r for r in ranks]
                self._pgs[ranks] = dist.new_group(
                    glob, timeout=timedelta(seconds=gather_timeout), use_local_synchronization=True
                )
            gathered: list[Any] = [None] * sched.num_trainers
            dist.all_gather_object(gathered, engine.main_address.to_bytes(), group=group)
            others = [gathered[r] for r in range(sched.num_trainers) if r != rank]
            self._others = [r for r in range(sched.num_trainers) if r != rank]
            self._peer_group = engine.add_peer_group(others)
        self._barrier_seq = 0
        self._last_version: int | None = None

    def _check_params(self) -> None:
        for s in self.schedule.sources.values():
            for piece in s.placement.pieces(s.shape, s.name):
                if piece.rank != self.rank:
                    continue
                t = self.params.get(s.name)
                if t is None:
                    raise ScheduleError(
                        f"trainer rank {self.rank} holds {s.name} but params has no such tensor"
                    )
                shape = s.placement.local_shape(piece)
                dtype = str(t.dtype).removeprefix("torch.")
                ok = tuple(t.shape) == shape
                if piece.flat is not None:
                    ok = t.dim() == 1 and shape[0] <= t.shape[0] <= piece.padded
                elif piece.rows is not None:
                    ok = tuple(t.shape[1:]) == shape[1:] and shape[0] <= t.shape[0] <= piece.padded
                if not ok or dtype != s.dtype:
                    raise ScheduleError(
                        f"trainer rank {self.rank}: {s.name} must be {s.dtype}{list(shape)}, got {dtype}{list(t.shape)}"
                    )

    # -- the update ------------------------------------------------------------------------------
    def update(
        self,
        version: int,
        timeout: float = 300.0,
        *,
        on_group_done: Callable[[int], None] | None = None,
    ) -> UpdateStats:
        """Sends this rank's part of update ``version`` (every trainer calls it with the same
        version; versions must increase). Returns when this rank's writes completed and every
        trainer passed the last barrier. Raises ``WeightsPeerLostError`` when an inference rank
        or a trainer failed, ``FabricTimeoutError`` at the deadline. ``on_group_done(g)`` runs
        after each parameter group's barrier (progress)."""
        if self._last_version is not None and version <= self._last_version:
            raise InvalidArgumentError(f"versions must increase: {version} after {self._last_version}")
        self._last_version = version
        deadline = time.monotonic() + timeout
        stats = UpdateStats(version)
        start = time.perf_counter()
        imm = update_imm(self.imm_base, version)
        inflight = _Inflight(self.pool)
        self.pool.peak = 0
        work = [u for u in self._units if self._gathers(u) or self._mine.get(u.index)]
        group_units: dict[int, list[Unit]] = defaultdict(list)
        for u in work:
            group_units[u.param_group].append(u)
        prefetch = Prefetcher(
            work, lambda u: self._load_unit(u, stats), self._unit_bytes, self.prefetch_bytes
        )
        try:
            for g in range(self.schedule.num_groups):
                for unit in group_units.get(g, []):
                    got, (data, ready) = prefetch.get(deadline)
                    assert got is unit
                    data = self._on_this_stream(data, ready)
                    self._run_unit(unit, data, imm, inflight, stats, deadline)
                    del data
                    prefetch.release(unit)
                t0 = time.perf_counter()
                inflight.wait_all(deadline)
                self._barrier(g, deadline)
                stats.seconds["wait"] += time.perf_counter() - t0
                if on_group_done is not None:
                    on_group_done(g)
        finally:
            prefetch.close()
            try:
                inflight.wait_all(min(deadline, time.monotonic() + self.barrier_timeout))
            except FabricTimeoutError:
                pass
        stats.total_s = time.perf_counter() - start
        stats.staging_peak = self.pool.peak
        if inflight.errors:
            ranks = sorted(inflight.errors)
            first = inflight.errors[ranks[0]]
            raise WeightsPeerLostError(
                f"update {version}: writes to inference ranks {ranks} failed ({type(first).__name__}: {first})",
                role="inference",
                ranks=ranks,
            ) from first
        return stats

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.current_stream(self.device).synchronize()

    def _timed(self, stats: UpdateStats, stage: str, t0: float) -> None:
        if self.profile:
            self._sync()
        stats.seconds[stage] += time.perf_counter() - t0

    def _load_unit(self, unit: Unit, stats: UpdateStats) -> tuple[Any, Any]:
        """The gather thread's work for ``unit``: on a GPU on a stream of its own, so packing and
        quantizing earlier units on the caller's stream do not wait for it; returns the tensor
        and the event that marks it ready (None on the CPU)."""
        if self._side_stream is None:
            return self._unit_tensor(unit, stats), None
        import torch

        with torch.cuda.stream(self._side_stream):
            data = self._unit_tensor(unit, stats)
            ready = torch.cuda.Event()
            ready.record(self._side_stream)
        return data, ready

    def _on_this_stream(self, data: Any, ready: Any) -> Any:
        """Orders the caller's stream after the gather and keeps the gathered memory from being
        reused by the side stream's allocator while the caller's kernels read it."""
        if ready is not None:
            import torch

            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(ready)
            data.record_stream(stream)
        return data

    def _unit_tensor(self, unit: Unit, stats: UpdateStats) -> Any:
        src = self.schedule.sources[unit.source]
        local = self.params[unit.source]
        if local.device != self.device:
            t0 = time.perf_counter()
            local = local.to(self.device, non_blocking=True)
            self._timed(stats, "h2d", t0)
        if unit.gather is None:
            return local.reshape(box_shape(unit.box))
        if len(unit.gather_group) == 1:  # an FSDP "group" of one holds the whole box already
            shape = box_shape(unit.box)
            if unit.gather == "flat":
                return local.reshape(-1)[: box_numel(unit.box)].view(shape)
            return local[: shape[0]]
        t0 = time.perf_counter()
        piece = src.placement.piece_of(src.shape, self.rank, src.name)
        assert piece is not None
        try:
            out = gather_unit(
                local,
                unit.gather,
                unit.box,
                len(unit.gather_group),
                piece.padded,
                self._pgs[unit.gather_group],
            )
        except Exception as e:  # noqa: BLE001 - any collective failure means a trainer is gone
            raise WeightsPeerLostError(
                f"gathering {unit.source} among trainers {list(unit.gather_group)} failed: {type(e).__name__}: {e}",
                role="trainer",
                ranks=[r for r in unit.gather_group if r != self.rank],
            ) from e
        stats.gathers += 1
        self._timed(stats, "gather", t0)
        return out

    def _gathers(self, unit: Unit) -> bool:
        return unit.needed and unit.gather is not None and self.rank in unit.gather_group

    def _unit_bytes(self, unit: Unit) -> int:
        return box_numel(unit.box) * DTYPE_SIZES[self.schedule.sources[unit.source].dtype]

    def _run_unit(
        self, unit: Unit, data: Any, imm: int, inflight: _Inflight, stats: UpdateStats, deadline: float
    ) -> None:
        for w in self._mine.get(unit.index, []):
            if inflight.failed(w.rank):
                stats.skipped += 1
                continue
            self._write(unit, data, w, imm, inflight, stats, deadline)

    def _write(
        self,
        unit: Unit,
        data: Any,
        w: Write,
        imm: int,
        inflight: _Inflight,
        stats: UpdateStats,
        deadline: float,
    ) -> None:
        import torch

        target = self.schedule.targets[w.target]
        view = slice_box(data, unit.box, w.src_box)
        nbytes = self.schedule.write_bytes(w)
        data_len = box_numel(w.dst_box) * DTYPE_SIZES[target.dtype]
        slot = self.pool.alloc(scale_offset(data_len) + nbytes - data_len, deadline)
        staging = self.pool.buffer
        scale_at = slot + scale_offset(data_len)
        if target.quantized:
            t0 = time.perf_counter()
            q, scales = quantize_fp8_blocks(view, target.block)
            self._timed(stats, "quantize", t0)
            t0 = time.perf_counter()
            staging[slot : slot + data_len].view(torch.float8_e4m3fn).view(q.shape).copy_(q)
            sc = staging[scale_at : scale_at + scales.numel() * 4].view(torch.float32)
            sc.view(scales.shape).copy_(scales)
        else:
            t0 = time.perf_counter()
            dst = staging[slot : slot + data_len].view(torch_dtype(target.dtype)).view(view.shape)
            dst.copy_(view)
        self._sync()  # the engine reads the staging memory once the copy finished
        self._timed(stats, "fuse", t0)
        t0 = time.perf_counter()
        inflight.add(slot, w.submissions)
        self._submit(w.rank, w.target, w.dst_box, slot, imm, w, inflight)
        if w.scale_box is not None:
            self._submit(w.rank, target.scale_name, w.scale_box, scale_at, imm, w, inflight, slot_key=slot)
        stats.seconds["submit"] += time.perf_counter() - t0
        stats.bytes += nbytes
        stats.writes += 1
        stats.requests += w.submissions

    def _submit(
        self,
        rank: int,
        tensor: str,
        box: Box,
        src_offset: int,
        imm: int,
        w: Write,
        inflight: _Inflight,
        slot_key: int | None = None,
    ) -> None:
        slot = src_offset if slot_key is None else slot_key
        desc, shape, itemsize = self._dst[(rank, tensor)]
        runs = box_runs(shape, box, itemsize)

        def done(err: BaseException | None) -> None:
            inflight.done(slot, rank, err)

        try:
            if len(runs.pages) == 1:
                domain = w.nic % self.engine.num_domains if self.schedule.nics_per_trainer > 1 else None
                self.engine.submit_write(
                    self.pool.region,
                    desc,
                    runs.page_len,
                    src_offset=src_offset,
                    dst_offset=runs.offset,
                    imm=imm,
                    domain=domain,
                    on_done=done,
                )
            else:
                self.engine.submit_paged_writes(
                    runs.page_len,
                    self.pool.region,
                    range(len(runs.pages)),
                    desc,
                    runs.pages,
                    src_offset=src_offset,
                    dst_stride=runs.page_stride,
                    dst_offset=runs.offset,
                    imm=imm,
                    on_done=done,
                )
        except FabricError as e:  # refused at once (e.g. the peer is fenced)
            done(e)

    # -- the trainers' barrier -------------------------------------------------------------------
    def _barrier(self, group_index: int, deadline: float) -> None:
        n = self.schedule.num_trainers
        if n == 1:
            return
        seq = self._barrier_seq & 0xFF
        self._barrier_seq += 1

        def imm_of(r: int) -> int:
            return self.barrier_imm_base + (seq << 12) + r

        counters = {r: self.engine.imm_counter(imm_of(r)) for r in self._others}
        try:
            limit = min(self.barrier_timeout, max(0.0, deadline - time.monotonic()))
            sent = self.engine.submit_barrier(imm_of(self.rank), self._peer_group)
            try:
                sent.result(timeout=limit)
            except (FabricError, TimeoutError) as e:
                raise WeightsPeerLostError(
                    f"barrier after parameter group {group_index}: a trainer is unreachable ({type(e).__name__}: {e})",
                    role="trainer",
                ) from e
            end = time.monotonic() + limit
            missing = []
            for r, c in counters.items():
                try:
                    c.wait(1, max(0.0, end - time.monotonic()))
                except FabricTimeoutError:
                    missing.append(r)
            if missing:
                raise WeightsPeerLostError(
                    f"barrier after parameter group {group_index}: trainers {missing} did not arrive within {limit:g}s",
                    role="trainer",
                    ranks=missing,
                )
        finally:
            for c in counters.values():
                c.close()

    def close(self) -> None:
        """Unregisters the staging memory (no update may be running)."""
        try:
            self.engine.unregister_memory(self.pool.region)
        except FabricError:
            pass
