"""The scale model's layout and prediction on a small mesh (metadata only, fast): the Kimi-K2
layout schedules (fused MLA projections, stacked experts fused along dimension 1, HSDP gathers),
and the prediction follows the per-rank work and rates."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from fabric_lib.weights import build_schedule  # noqa: E402

from benchmarks import weights_scale_model as scale  # noqa: E402


def test_small_mesh_kimi_layout_schedules_and_predicts() -> None:
    sources, targets, trainers, inference = scale.kimi_k2_layout(
        layers=3, pp=1, ep=2, fsdp=2, instances=1, inf_ep=4
    )
    assert (trainers, inference) == (4, 4)
    sched = build_schedule(
        sources, targets, num_trainers=trainers, num_inference=inference, group_bytes=1 << 34
    )
    work = scale.per_rank_work(sched)
    # each inference rank receives a quarter of the experts (FP8) and everything else whole
    assert max(work["bytes_received"]) - min(work["bytes_received"]) < max(work["bytes_received"]) // 100
    assert sum(work["bytes_sent"]) == sum(work["bytes_received"]) == work["total_bytes"]
    assert all(g > 0 for g in work["bytes_gathered_in"])  # HSDP units are gathered
    rates = dict(scale.DEFAULT_RATES)
    slow = scale.predict(work, rates)
    fast = scale.predict(work, {**rates, "nic_gbps": 2 * rates["nic_gbps"]})
    assert slow["bound"] == "inference receive"
    assert abs(slow["inference_receive_s"] - 2 * fast["inference_receive_s"]) < 1e-9
    assert slow["predicted_s"] >= slow["inference_receive_s"]
