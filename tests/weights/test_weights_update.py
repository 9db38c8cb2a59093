"""fabric_lib.weights across processes over tcp: 2 trainer ranks (a transformers Llama, FSDP-sharded)
update 2 inference ranks (TP2, fused qkv and gate_up) under two schedules sharing the engines,
bf16 and block FP8: three consecutive updates are exact; a killed inference rank and a killed
trainer fail the update with typed errors within the timeout bound, and the inference side tells
the partial update from a complete one."""

from __future__ import annotations

import pytest

from . import cluster as c

TP = 2
VARIANTS = {"bf16": False, "fp8": True}


@pytest.fixture(scope="module")
def cluster():
    cl = c.Cluster(VARIANTS, tp=TP)
    yield cl
    cl.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_three_consecutive_updates_are_exact(cluster, variant) -> None:
    sched = cluster.schedules[variant]
    assert sched.num_groups >= 2 and sched.stats()["gathers"] > 0
    for version in (1, 2, 3):
        trainers, inference = cluster.update(variant, version)
        assert all("stats" in r for r in trainers), trainers
        assert inference == [{"version": version, "intact": True}] * TP
        for rank in range(TP):
            assert cluster.check(variant, rank, version) == [], f"inference rank {rank}, version {version}"
        assert sum(r["stats"]["bytes"] for r in trainers) == sched.stats()["bytes"]
    # the control: the previous version's weights do not pass
    assert cluster.check(variant, 0, 2) != []


@pytest.mark.timeout(180)
def test_killed_ranks_fail_the_update_with_typed_errors_and_partial_updates_are_detected(cluster) -> None:
    """Runs last (it kills ranks), on the FP8 schedule from version 4 on."""
    # An inference rank dies: every trainer that writes to it fails the update, naming it;
    # the surviving inference rank still gets the whole version.
    cluster.inference[1].kill()
    trainers, inference = cluster.update("fp8", 4, wait=20)
    assert {(r["error"], r["role"], tuple(r["ranks"])) for r in trainers} == {
        ("WeightsPeerLostError", "inference", (1,))
    }, trainers
    assert all(r["after_s"] < 4 * c.TIMEOUT for r in trainers), trainers
    assert inference == [{"version": 4, "intact": True}]
    assert cluster.check("fp8", 0, 4) == []

    # A trainer dies after the first parameter group: the other trainer fails within the bound;
    # the inference rank sees version 5 partial and keeps reporting version 4, not intact.
    before = cluster.fetch_from("fp8", 0)
    trainers, inference = cluster.update("fp8", 5, die_after_group={1: 0}, wait=8.0)
    alive = [r for r in trainers if "died" not in r]
    assert len(alive) == 1 and (alive[0]["error"], alive[0]["role"]) == ("WeightsPeerLostError", "trainer"), (
        trainers
    )
    assert alive[0]["after_s"] < 4 * c.TIMEOUT
    (seen,) = inference
    assert seen["error"] == "UpdateIncompleteError" and seen["partial"], seen
    assert 0 < seen["received"] < seen["expected"]
    assert (seen["version"], seen["intact"]) == (4, False)
    after = cluster.fetch_from("fp8", 0)
    changed = [n for n in before if not before[n].equal(after[n])]
    assert changed and len(changed) < len(before), "a partial update changed some tensors, not all"
