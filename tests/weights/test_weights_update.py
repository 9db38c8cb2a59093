"""fabric_lib.weights across processes over tcp: 2 trainer ranks (a transformers Llama, FSDP-sharded)
update 2 inference ranks (TP2, fused qkv and gate_up) under two schedules sharing the engines,
bf16 and block FP8: three consecutive updates are exact; a killed inference rank and a killed
trainer fail the update with typed errors within the timeout bound, and the inference side tells
the partial update from a complete one."""

from __future__ import annotations

from typing import Any

import pytest
from fabric_lib.testing import gather, spawn_ranks
from fabric_lib.weights import build_schedule, dense_transformer

from . import cluster as c

TP = 2
VARIANTS = {"bf16": False, "fp8": True}


def _schedule(fp8: bool) -> Any:
    sources, targets = dense_transformer(
        c.shapes(), trainer_placement=c.trainer_placement(2), inference_groups=[list(range(TP))], fp8=fp8
    )
    return build_schedule(
        sources, targets, num_trainers=2, num_inference=TP, max_write_bytes=256 << 10, group_bytes=2 << 20
    )


class Cluster:
    """Two trainer and two inference processes; one sender and receiver per variant."""

    def __init__(self) -> None:
        self.schedules = {v: _schedule(fp8) for v, fp8 in VARIANTS.items()}
        self.inference = spawn_ranks(
            TP, setup=c.open_inference, teardown=c.close_inference, names=["inf0", "inf1"], timeout=90
        )
        try:
            self.trainers = spawn_ranks(
                2, setup=c.open_trainer, teardown=c.close_trainer, names=["trainer0", "trainer1"], timeout=90
            )
        except BaseException:
            self.inference.close()
            raise
        for index, (variant, sched) in enumerate(self.schedules.items()):
            text = sched.to_json()
            manifests = self.inference.call_all(c.make_receiver, variant, index, text)
            gather(self.trainers.submit_all(c.make_sender, variant, index, text, manifests, 1 << 20), timeout=60)
        self.base = c.base_weights()

    def update(
        self, variant: str, version: int, die_after_group: dict[int, int] | None = None, wait: float = 30.0
    ) -> tuple[list, list]:
        live_t = [t for t in self.trainers if t.exitcode is None and not t.broken]
        live_i = [i for i in self.inference if i.exitcode is None and not i.broken]
        sent = [t.submit(c.train_and_update, variant, version, (die_after_group or {}).get(t.rank)) for t in live_t]
        waits = [i.submit(c.wait_update, variant, version, wait) for i in live_i]
        results_i = [w.result(timeout=wait + 30) for w in waits]
        results_t = []
        for t, p in zip(live_t, sent):
            try:
                results_t.append(p.result(timeout=60))
            except Exception as e:  # the rank killed itself
                results_t.append({"died": str(e).splitlines()[0], "rank": t.rank})
        return results_t, results_i

    def fetch(self, variant: str, rank: int) -> dict[str, Any]:
        return c.as_tensors(self.inference[rank].call(c.fetch, variant))

    def check(self, variant: str, rank: int, version: int) -> list[str]:
        full = c.weights_at(self.base, version)
        expected = c.expected_inference(full, rank, TP, c.CONFIG["num_hidden_layers"], VARIANTS[variant])
        return c.mismatches(self.fetch(variant, rank), expected)

    def close(self) -> None:
        self.trainers.close()
        self.inference.close()


@pytest.fixture(scope="module")
def cluster():
    cl = Cluster()
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
    before = cluster.fetch("fp8", 0)
    trainers, inference = cluster.update("fp8", 5, die_after_group={1: 0}, wait=8.0)
    alive = [r for r in trainers if "died" not in r]
    assert len(alive) == 1 and (alive[0]["error"], alive[0]["role"]) == ("WeightsPeerLostError", "trainer"), trainers
    assert alive[0]["after_s"] < 4 * c.TIMEOUT
    (seen,) = inference
    assert seen["error"] == "UpdateIncompleteError" and seen["partial"], seen
    assert 0 < seen["received"] < seen["expected"]
    assert (seen["version"], seen["intact"]) == (4, False)
    after = cluster.fetch("fp8", 0)
    changed = [n for n in before if not before[n].equal(after[n])]
    assert changed and len(changed) < len(before), "a partial update changed some tensors, not all"
