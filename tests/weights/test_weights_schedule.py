"""The static schedule without processes: determinism, JSON round trip, exclusive cover checked
byte by byte independently of the builder, balance over trainers and NICs, errors for layouts that
cannot be scheduled; the runs of a box and the FP8 quantizer against plain references; one
trainer and two inference engines in this process exercising paged writes (fuse along dim 1)."""

from __future__ import annotations

import math

import fabric_lib
import pytest
import torch
from fabric_lib import weights as W
from fabric_lib.weights.layout import box_runs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .cluster import reference_fp8


def _bytes_written(sched: W.Schedule) -> dict[tuple[int, str], list[int]]:
    """Per (inference rank, tensor): how many writes touch each byte (from the runs alone)."""
    hits: dict[tuple[int, str], list[int]] = {}
    for rank in range(sched.num_inference):
        for name, (shape, dtype) in sched.tensors_of(rank).items():
            hits[(rank, name)] = [0] * (math.prod(shape) * W.DTYPE_SIZES[dtype])
    for w in sched.writes:
        t = sched.targets[w.target]
        parts = [(w.target, w.dst_box)] + ([(t.scale_name, w.scale_box)] if w.scale_box else [])
        for name, box in parts:
            shape, dtype = sched.tensors_of(w.rank)[name]
            runs = box_runs(shape, box, W.DTYPE_SIZES[dtype])
            for p in runs.pages:
                start = runs.offset + p * runs.page_stride
                for b in range(start, start + runs.page_len):
                    hits[(w.rank, name)][b] += 1
    return hits


@st.composite
def layouts(draw):
    """Random trainer and inference layouts over tensors whose extents split evenly."""
    trainers = draw(st.integers(1, 4))
    inference = draw(st.sampled_from([1, 2, 4]))
    fp8 = draw(st.booleans())
    unit = 128 if fp8 else draw(st.sampled_from([1, 4, 8]))
    sources, targets = [], []
    for i in range(draw(st.integers(1, 4))):
        rows = unit * inference * draw(st.integers(1, 3)) * (trainers if draw(st.booleans()) else 1)
        cols = unit * inference * draw(st.integers(1, 2))
        kind = draw(st.sampled_from(["replicate", "row", "col", "fsdp", "flat", "hsdp", "ep"]))
        ranks = list(range(trainers))
        halves = [ranks[: trainers // 2], ranks[trainers // 2 :]]
        if kind == "hsdp" and trainers >= 2:
            pl = W.fsdp_sharded(halves[0], replicas=[halves[1]])
        elif kind == "ep" and trainers >= 2 and rows % 2 == 0 and (not fp8 or (rows // 2) % 128 == 0):
            inner = draw(st.sampled_from(["shard", "fsdp", "flat", "replicate"]))
            ok = inner != "shard" or ((rows // 2) % len(halves[0]) == 0 and (rows // 2) % len(halves[1]) == 0)
            if fp8 and inner == "shard":
                ok = ok and all((rows // 2 // len(h)) % 128 == 0 for h in halves)
            pl = W.grouped(halves, outer_dim=0, inner=inner if ok else "replicate")
        elif kind == "row" and rows % trainers == 0 and (not fp8 or (rows // trainers) % 128 == 0):
            pl = W.sharded(0, ranks)
        elif kind == "col" and cols % trainers == 0 and (not fp8 or (cols // trainers) % 128 == 0):
            pl = W.sharded(1, ranks)
        elif kind == "fsdp":
            pl = W.fsdp_sharded(ranks)
        elif kind == "flat":
            pl = W.flat_sharded(ranks)
        else:
            pl = W.replicated(ranks)
        parts = [f"s{i}a"] + ([f"s{i}b"] if draw(st.booleans()) else [])
        for p in parts:
            sources.append(W.source(p, (rows, cols), "bfloat16", pl))
        tp = list(range(inference))
        split = draw(st.sampled_from([0, 1]))
        targets.append(
            W.target(f"t{i}", parts, W.sharded(split, tp), dtype=W.FP8 if fp8 else "bfloat16", fuse_dim=0)
        )
    nics = draw(st.integers(1, 3))
    max_write = draw(st.sampled_from([1 << 12, 1 << 16, 1 << 30]))
    return sources, targets, trainers, inference, nics, max_write


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
@pytest.mark.timeout(120)
def test_every_byte_is_written_exactly_once_and_the_schedule_is_deterministic(layout) -> None:
    sources, targets, trainers, inference, nics, max_write = layout
    sched = W.build_schedule(
        sources, targets, num_trainers=trainers, num_inference=inference, nics_per_trainer=nics,
        max_write_bytes=max_write, group_bytes=1 << 16,
    )  # fmt: skip
    for key, hits in _bytes_written(sched).items():
        assert set(hits) == {1}, f"{key}: bytes written {sorted(set(hits))} times"
    again = W.build_schedule(
        sources, targets, num_trainers=trainers, num_inference=inference, nics_per_trainer=nics,
        max_write_bytes=max_write, group_bytes=1 << 16,
    )  # fmt: skip
    assert again.to_json() == sched.to_json()
    assert W.Schedule.from_json(sched.to_json()).to_json() == sched.to_json()
    # every writer holds the unit it sends from
    for w in sched.writes:
        assert w.writer in sched.units[w.unit].holders
        assert 0 <= w.nic < nics


@settings(max_examples=25, deadline=None)
@given(trainers=st.integers(2, 8), inference=st.sampled_from([1, 2, 4, 8]), nics=st.integers(1, 4),
       layers=st.integers(1, 6))  # fmt: skip
def test_replicated_weights_are_balanced_over_trainers_and_nics(trainers, inference, nics, layers) -> None:
    """Where every trainer may send every write, no trainer (and no NIC of one) sends more than
    the least-loaded one plus one write."""
    ranks = list(range(trainers))
    sources = [
        W.source(f"w{i}", (256 * (1 + i % 3), 512), "bfloat16", W.replicated(ranks)) for i in range(layers)
    ]
    targets = [W.target(s.name, s.name, W.sharded(0, list(range(inference)))) for s in sources]
    sched = W.build_schedule(
        sources,
        targets,
        num_trainers=trainers,
        num_inference=inference,
        nics_per_trainer=nics,
        max_write_bytes=1 << 16,
    )
    stats = sched.stats()
    biggest = max(sched.write_bytes(w) for w in sched.writes)
    sent = stats["bytes_sent"]
    assert max(sent) - min(sent) <= biggest
    for per_nic in stats["bytes_per_nic"]:
        assert max(per_nic) - min(per_nic) <= biggest


def test_overlapping_or_missing_writes_are_refused() -> None:
    ranks = [0]
    sources = [W.source("a", (8, 8), "bfloat16", W.replicated(ranks))]
    targets = [W.target("a", "a", W.replicated([0]))]
    sched = W.build_schedule(sources, targets, num_trainers=1, num_inference=1)
    (w,) = sched.writes
    twice = W.Schedule(
        list(sched.sources.values()), list(sched.targets.values()), 1, 1, 1, sched.units, [w, w], 1
    )
    with pytest.raises(W.ScheduleError, match="overlap"):
        W.check_exclusive_cover(twice)
    none = W.Schedule(list(sched.sources.values()), list(sched.targets.values()), 1, 1, 1, sched.units, [], 1)
    with pytest.raises(W.ScheduleError, match="cover 0 of 64"):
        W.check_exclusive_cover(none)


def test_layouts_that_cannot_be_scheduled_raise_typed_errors() -> None:
    with pytest.raises(W.ScheduleError, match="equal parts"):
        W.build_schedule(
            [W.source("a", (6, 4), "bfloat16", W.sharded(0, [0, 1, 2, 3]))],
            [],
            num_trainers=4,
            num_inference=1,
        )
    # FP8 blocks may not mix two trainer shards: rows 64 per trainer with 128-row blocks
    sources = [W.source("a", (128, 128), "bfloat16", W.sharded(0, [0, 1]))]
    with pytest.raises(W.ScheduleError, match="FP8 blocks"):
        W.build_schedule(
            sources, [W.target("a", "a", W.replicated([0]), dtype=W.FP8)], num_trainers=2, num_inference=1
        )
    with pytest.raises(W.ScheduleError, match="concatenated"):
        bad = [
            W.source("a", (4, 4), "bfloat16", W.replicated([0])),
            W.source("b", (4, 8), "bfloat16", W.replicated([0])),
        ]
        W.build_schedule(
            bad, [W.target("ab", ["a", "b"], W.replicated([0]))], num_trainers=1, num_inference=1
        )
    with pytest.raises(W.ScheduleError, match="no trainer parameter"):
        W.build_schedule([], [W.target("x", "missing", W.replicated([0]))], num_trainers=1, num_inference=1)
    with pytest.raises(W.ScheduleError, match="malformed"):
        W.Schedule.from_json('{"schema": "fabric-lib-weights-schedule/1"}')
    assert issubclass(W.ScheduleError, fabric_lib.InvalidArgumentError)


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
@settings(max_examples=100, deadline=None)
def test_box_runs_address_exactly_the_box(shape, data) -> None:
    ranges = []
    for n in shape:
        lo = data.draw(st.integers(0, n - 1))
        ranges.append((lo, data.draw(st.integers(lo + 1, n))))
    box = tuple(ranges)
    runs = box_runs(shape, box, 2)
    got = sorted(
        b
        for p in runs.pages
        for b in range(runs.offset + p * runs.page_stride, runs.offset + p * runs.page_stride + runs.page_len)
    )
    flat = torch.arange(math.prod(shape)).reshape(shape)
    index = flat[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1)
    expected = sorted(2 * int(i) + k for i in index for k in (0, 1))
    assert got == expected


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (3, 130, 129)])
def test_fp8_block_quantizer_matches_the_plain_reference(shape) -> None:
    torch.manual_seed(1)
    x = (torch.randn(shape) * 3).to(torch.bfloat16)
    x[..., :128, :128] = 0  # an all-zero block
    q, s = W.quantize_fp8_blocks(x, (128, 128))
    for i in range(x.shape[0] if x.dim() == 3 else 1):
        xi, qi, si = (x[i], q[i], s[i]) if x.dim() == 3 else (x, q, s)
        rq, rs = reference_fp8(xi)
        assert torch.equal(qi.contiguous().view(torch.uint8), rq.view(torch.uint8))
        assert torch.equal(si, rs)


def test_expert_layout_over_paged_writes_in_one_process() -> None:
    """Stacked experts, gate and up fused along dim 1 (vLLM's w13), trainer EP2 -> inference EP
    over 2 ranks with a different split; and a TP re-split 2 -> 2 along the other dimension."""
    experts, inter, hidden = 4, 128, 256
    sources = [
        W.source("gate", (experts, inter, hidden), "bfloat16", W.expert_sharded([0])),
        W.source("up", (experts, inter, hidden), "bfloat16", W.expert_sharded([0])),
        W.source("o", (256, 256), "bfloat16", W.replicated([0])),
    ]
    for dtype in ("bfloat16", W.FP8):
        targets = [
            W.target("w13", ["gate", "up"], W.expert_sharded([0, 1]), fuse_dim=1, dtype=dtype),
            W.target("o", "o", W.sharded(1, [0, 1]), dtype=dtype),
        ]
        sched = W.build_schedule(sources, targets, num_trainers=1, num_inference=2, max_write_bytes=1 << 18)
        torch.manual_seed(2)
        full = {s.name: torch.randn(s.shape).to(torch.bfloat16) for s in sources}
        engines = [fabric_lib.TransferEngine("tcp", poll_mode="adaptive") for _ in range(3)]
        try:
            receivers = [W.WeightReceiver(engines[1 + r], W.inference_params(sched, r), r) for r in range(2)]
            for rc in receivers:
                rc.set_schedule(sched)
            sender = W.WeightSender(
                engines[0], sched, 0, W.trainer_shards(sched, 0, full), [rc.manifest() for rc in receivers],
                staging_bytes=1 << 20,
            )  # fmt: skip
            assert any(
                len(box_runs(*sched.tensors_of(w.rank)[w.target][:1], w.dst_box, 1).pages) > 1
                for w in sched.writes
            )
            for version in (1, 2):
                sender.update(version, timeout=30)
                for rc in receivers:
                    rc.wait_for_update(version, timeout=30)
            for r, rc in enumerate(receivers):
                w13 = torch.cat([full["gate"].chunk(2)[r], full["up"].chunk(2)[r]], dim=1)
                o = full["o"].chunk(2, dim=1)[r]
                if dtype == W.FP8:
                    for name, ref in (("w13", w13), ("o", o)):
                        q, s = W.quantize_fp8_blocks(ref, (128, 128))
                        assert torch.equal(
                            rc.params[name].view(torch.uint8), q.contiguous().view(torch.uint8)
                        )
                        assert torch.equal(rc.params[f"{name}_scale_inv"], s)
                else:
                    assert torch.equal(rc.params["w13"], w13) and torch.equal(rc.params["o"], o)
                assert rc.version == 2 and rc.intact
            with pytest.raises(fabric_lib.InvalidArgumentError):
                sender.update(2)  # versions only increase
        finally:
            for e in engines:
                e.stop()


def test_receiver_refuses_mismatched_tensors_and_reports_incomplete_versions() -> None:
    sources = [W.source("a", (256, 128), "bfloat16", W.replicated([0]))]
    sched = W.build_schedule(
        sources, [W.target("a", "a", W.sharded(0, [0, 1]), dtype=W.FP8)], num_trainers=1, num_inference=2
    )
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive") as engine:
        wrong = W.inference_params(sched, 0)
        wrong["a"] = torch.zeros(128, 128, dtype=torch.bfloat16)  # bf16 where FP8 is written
        with pytest.raises(W.ScheduleError, match="a is bfloat16"):
            W.WeightReceiver(engine, wrong, 0).set_schedule(sched)
        missing = W.inference_params(sched, 0)
        del missing["a_scale_inv"]
        with pytest.raises(W.ScheduleError, match="registered no tensor"):
            W.WeightReceiver(engine, missing, 0).set_schedule(sched)
        receiver = W.WeightReceiver(engine, W.inference_params(sched, 0), 0)
        with pytest.raises(fabric_lib.InvalidArgumentError, match="set_schedule"):
            receiver.wait_for_update(1, timeout=0.1)
        receiver.set_schedule(sched.to_json())
        assert receiver.expected_writes == 2  # data and scales
        with pytest.raises(W.UpdateIncompleteError) as info:
            receiver.wait_for_update(1, timeout=0.2)
        assert (info.value.received, info.value.expected, info.value.partial) == (0, 2, False)
        assert isinstance(info.value, fabric_lib.FabricTimeoutError)
        assert not receiver.intact and receiver.version is None
        with pytest.raises(fabric_lib.InvalidArgumentError, match="new version"):
            receiver.wait_for_update(1, timeout=0.1)  # a failed version is never reused
        # a sender whose manifest list lacks a rank is refused before anything is sent
        with pytest.raises(W.ScheduleError, match="no manifest"):
            W.WeightSender(
                engine, sched, 0, {"a": torch.zeros(256, 128, dtype=torch.bfloat16)}, [receiver.manifest()]
            )
        with pytest.raises(W.ScheduleError, match="must be bfloat16"):
            W.WeightSender(engine, sched, 0, {"a": torch.zeros(255, 128, dtype=torch.bfloat16)}, [])


def test_uneven_groups_tile_without_gaps() -> None:
    """Groups of different sizes split rows differently (not a grid): still one writer per byte."""
    pl = W.grouped([[0, 1], [2, 3, 4]], outer_dim=1, inner="shard", dim=0)
    sources = [W.source("a", (12, 8), "bfloat16", pl)]
    for split in (0, 1):
        targets = [W.target("a", "a", W.sharded(split, [0, 1, 2, 3]))]
        sched = W.build_schedule(sources, targets, num_trainers=5, num_inference=4, max_write_bytes=8)
        for key, hits in _bytes_written(sched).items():
            assert set(hits) == {1}, key


def test_a_single_trainer_with_fsdp_placements_needs_no_collective() -> None:
    sources = [
        W.source("a", (256, 256), "bfloat16", W.flat_sharded([0])),
        W.source("b", (256, 256), "bfloat16", W.fsdp_sharded([0])),
    ]
    targets = [
        W.target("a", "a", W.sharded(0, [0, 1]), dtype=W.FP8),
        W.target("b", "b", W.sharded(1, [0, 1])),
    ]
    sched = W.build_schedule(sources, targets, num_trainers=1, num_inference=2)
    full = {s.name: torch.randn(s.shape).to(torch.bfloat16) for s in sources}
    engines = [fabric_lib.TransferEngine("tcp", poll_mode="adaptive") for _ in range(3)]
    try:
        receivers = [W.WeightReceiver(engines[1 + r], W.inference_params(sched, r), r) for r in range(2)]
        for rc in receivers:
            rc.set_schedule(sched)
        manifests = [rc.manifest() for rc in receivers]
        sender = W.WeightSender(
            engines[0], sched, 0, W.trainer_shards(sched, 0, full), manifests, staging_bytes=1 << 20
        )
        assert sender.update(1, timeout=30).gathers == 0
        for rc in receivers:
            rc.wait_for_update(1, timeout=30)
        assert torch.equal(receivers[1].params["b"], full["b"].chunk(2, dim=1)[1])
        q, s = W.quantize_fp8_blocks(full["a"].chunk(2)[0], (128, 128))
        assert torch.equal(receivers[0].params["a"].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(receivers[0].params["a_scale_inv"], s)
    finally:
        for e in engines:
            e.stop()
