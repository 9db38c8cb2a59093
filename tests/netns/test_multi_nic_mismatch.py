"""Engines with different domain counts across the network-namespace test bed: descriptors and
addresses across the mismatch are refused (InvalidDescriptorError) in both directions, while the
hosts with the same count still talk to each other. Needs root; skips with the reason otherwise.
"""

from __future__ import annotations

from typing import Any

import fabric_lib
import pytest
import torch
import torch.distributed as dist
from fabric_lib.distributed import exchange
from fabric_lib.testing import gather, this_rank
from fabric_lib.testing.netns import TestBed

from .multi_nic import WAIT, Ctx, check, host_nics, on_hosts

pytestmark = [pytest.mark.netns, pytest.mark.usefixtures("multi_nic_requirements")]


# -- run in each host's rank ---------------------------------------------------------------------
def scenario_mismatch(_state: None, single_nic_rank: int) -> dict[str, Any]:
    """Rank ``single_nic_rank`` opens its engine over its first NIC only; every rank tries a write,
    a paged write, an imm and a peer group towards every other rank and reports the outcomes
    (refused across the mismatch, checked here too)."""
    nics = host_nics()
    mine = nics[:1] if this_rank().rank == single_nic_rank else nics
    ctx = Ctx(mine, poll_mode="adaptive", shard_min_bytes=0, transfer_timeout=10.0)

    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    region = ctx.engine.register_tensor(buf)
    peers = exchange(ctx.engine, [region.descriptor])
    outcomes = {}
    e = ctx.engine
    for r in range(ctx.world):
        if r == ctx.rank:
            continue
        desc, addr = peers[r].descriptors[0], peers[r].address
        same = (r == single_nic_rank) == (ctx.rank == single_nic_rank)
        attempts = {
            "write": lambda d=desc: e.submit_write(region, d, 4096, imm=9).result(timeout=WAIT),
            "paged": lambda d=desc: e.submit_paged_writes(1024, region, [0, 1], d, [1, 0]).result(
                timeout=WAIT
            ),
            "imm": lambda d=desc: e.submit_imm(9, d).result(timeout=WAIT),
            "peer_group": lambda a=addr: e.add_peer_group([a]),
        }
        for name, fn in attempts.items():
            try:
                fn()
                outcomes[f"{r}:{name}"] = "ok"
            except fabric_lib.InvalidDescriptorError as ex:
                outcomes[f"{r}:{name}"] = f"InvalidDescriptorError: {ex}"
            if not same:
                check(
                    outcomes[f"{r}:{name}"].startswith("InvalidDescriptorError"),
                    f"{name} to rank {r} ({len(mine)} vs other domain count): {outcomes[f'{r}:{name}']}",
                )
    dist.barrier()
    return {"rank": ctx.rank, "domains": mine, "outcomes": outcomes, "stop_s": ctx.close()}


# -- the test -------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_domain_count_mismatch_is_refused(bed3x2: TestBed) -> None:
    """Host 1 opens its engine over nic0 only, hosts 0 and 2 over both NICs: descriptors and
    addresses across the mismatch are refused (InvalidDescriptorError), in both directions, while
    the two 2-NIC hosts still talk to each other."""
    with on_hosts(bed3x2) as ranks:
        reports = gather(ranks.submit_all(scenario_mismatch, single_nic_rank=1), 60)
    assert [r["domains"] for r in reports] == [["nic0", "nic1"], ["nic0"], ["nic0", "nic1"]]
    for r in reports:
        for key, outcome in r["outcomes"].items():
            peer = int(key.split(":")[0])
            if 1 in (peer, r["rank"]):
                assert outcome.startswith("InvalidDescriptorError") and "same number" in outcome, (
                    r["rank"],
                    key,
                    outcome,
                )
            else:
                assert outcome == "ok", (r["rank"], key, outcome)
    assert len(reports[1]["outcomes"]) == 8  # 4 attempts at each of the two 2-NIC hosts
