"""Bootstrap across processes: three ranks form a gloo process group over
``tcp://127.0.0.1:<free port>``; for each loopback provider they call
``fabric_lib.distributed.exchange`` to learn every rank's engine address and descriptors, then
each writes to every other rank with immediates, and every rank checks all inbound bytes and
exact counts, plus an exchange over a subgroup (``bootstrap_rank``).

The ranks are started once for all providers (importing torch in three processes is most of the
cost on 2 cores); each provider is reported by its own test.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from fabric_lib.distributed import _ephemeral_low, rendezvous_port
from fabric_lib.testing import RankError, gather, init_process_group, spawn_ranks
from providers import LOOPBACK_PROVIDERS, provider_available, provider_params

from .peer import imm_value, pattern

WORLD = 3
PROVIDERS = [p for p in LOOPBACK_PROVIDERS if provider_available(p)]


# -- run in each rank ----------------------------------------------------------------------------
BOOT_STRIDE = 1 << 20  # each sender's slot in every receiver's region
BOOT_PIECES = 5  # writes per (sender, receiver), all with the sender's imm


def boot_len(rank: int) -> int:
    """Bytes rank sends to each peer (different per rank, unaligned)."""
    return (256 << 10) + 4093 * rank + 3


def bootstrap_rank(_state: None, providers: Sequence[str], timeout: float = 60.0) -> dict[str, Any]:
    """One rank: joins a gloo process group, then for each provider in turn runs
    ``_bootstrap_round`` (engine, ``fabric_lib.distributed.exchange``, all-to-all writes, checks).
    Returns {provider: report}; the first failure raises (the other ranks then fail on their
    bounded waits)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    done: dict[str, Any] = {}
    for provider in providers:
        try:
            done[provider] = _bootstrap_round(rank, world, provider, timeout)
        except BaseException as e:
            raise RuntimeError(f"provider {provider!r}: {type(e).__name__}: {e}") from e
    dist.destroy_process_group()
    return done


def _bootstrap_round(rank: int, world: int, provider: str, timeout: float) -> dict[str, Any]:
    """Engine on ``provider``; exchange; a write of ``boot_len(rank)`` bytes (in BOOT_PIECES
    pieces, imm 0x1000+rank) into every other rank's region at ``rank * BOOT_STRIDE``, plus an
    imm-only request to each peer's second descriptor; checks every inbound byte and count, and a
    subgroup exchange."""
    import fabric_lib
    import torch
    import torch.distributed as dist
    from fabric_lib.distributed import exchange

    engine = fabric_lib.TransferEngine(provider, poll_mode="adaptive", transfer_timeout=30.0)
    try:
        recv = torch.zeros(world * BOOT_STRIDE, dtype=torch.uint8)
        aux = torch.zeros(64, dtype=torch.uint8)
        src = torch.from_numpy(pattern(100 + rank, boot_len(rank)).copy())
        recv_region, aux_region = engine.register_tensor(recv), engine.register_tensor(aux)
        src_region = engine.register_tensor(src)

        infos = exchange(engine, [recv_region.descriptor, aux_region.descriptor])
        assert [i.rank for i in infos] == list(range(world)), infos
        assert infos[rank].address == engine.main_address
        assert infos[rank].descriptors == [recv_region.descriptor, aux_region.descriptor]
        assert len({i.address.to_bytes() for i in infos}) == world
        for info in infos:
            assert [d.length for d in info.descriptors] == [world * BOOT_STRIDE, 64]

        # Every rank writes to every other rank (all at once; nothing ordered).
        n = boot_len(rank)
        cuts = [n * k // BOOT_PIECES for k in range(BOOT_PIECES + 1)]
        futures = []
        for peer in infos:
            if peer.rank == rank:
                continue
            dst = peer.descriptors[0]
            for a, b in itertools.pairwise(cuts):
                futures.append(
                    engine.submit_write(
                        src_region,
                        dst,
                        b - a,
                        src_offset=a,
                        dst_offset=rank * BOOT_STRIDE + a,
                        imm=0x1000 + rank,
                    )
                )
            futures.append(engine.submit_imm(0x2000 + rank, peer.descriptors[1]))
        for f in futures:
            f.result(timeout=timeout)

        # Inbound: exact counts per sender, then every byte.
        for s in range(world):
            if s == rank:
                continue
            with engine.imm_counter(0x1000 + s) as c:
                c.wait(BOOT_PIECES, timeout=timeout)
            with engine.imm_counter(0x2000 + s) as c:
                c.wait(1, timeout=timeout)
        time.sleep(0.05)
        extra = {imm: imm_value(engine, imm) for s in range(world) for imm in (0x1000 + s, 0x2000 + s)}
        assert all(v == 0 for v in extra.values()), f"extra immediates: {extra}"
        got = recv.numpy()
        for s in range(world):
            slot = got[s * BOOT_STRIDE : (s + 1) * BOOT_STRIDE]
            if s == rank:
                assert not slot.any(), "a peer wrote into this rank's own slot"
                continue
            ln = boot_len(s)
            assert np.array_equal(slot[:ln], pattern(100 + s, ln)), f"bytes from rank {s} differ"
            assert not slot[ln:].any(), f"rank {s} wrote past its range"
        assert not aux.numpy().any(), "imm-only requests wrote bytes"

        # A subgroup exchange: ranks 0 and world-1 only (every rank must create the group).
        sub_ranks = [0, world - 1]
        sub = dist.new_group(sub_ranks)
        if rank in sub_ranks:
            sub_infos = exchange(engine, [aux_region.descriptor], group=sub)
            assert [i.address for i in sub_infos] == [infos[r].address for r in sub_ranks]
            assert [i.rank for i in sub_infos] == [0, 1]

        dist.barrier()  # nobody stops its engine while others may still write to it
    finally:
        t0 = time.monotonic()
        engine.stop()
        stop_s = time.monotonic() - t0
    return {"stop_s": stop_s, "provider": engine.provider}


@pytest.fixture(scope="module")
def bootstrap_reports() -> dict[str, dict[int, dict[str, Any]]] | str:
    """{provider: {rank: report}}, or the failure text of the first rank that failed."""
    pytest.importorskip("torch.distributed")
    try:
        with spawn_ranks(WORLD) as ranks:
            per_rank = gather(ranks.submit_all(bootstrap_rank, PROVIDERS), timeout=150)
    except RankError as e:
        return str(e)
    return {p: {rank: per_rank[rank][p] for rank in range(WORLD)} for p in PROVIDERS}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("provider", provider_params())
def test_exchange_then_all_to_all_writes(
    bootstrap_reports: dict[str, dict[int, dict[str, Any]]] | str, provider: str
) -> None:
    assert not isinstance(bootstrap_reports, str), bootstrap_reports
    reports = bootstrap_reports[provider]
    assert sorted(reports) == list(range(WORLD))
    for rank, report in reports.items():
        assert report["provider"].split(";")[0] == provider.split(";")[0], report
        assert report["stop_s"] < 3.0, (rank, report)


def test_rendezvous_port_is_free_and_below_the_ephemeral_range() -> None:
    # A port from the ephemeral range can be given to an early client's outgoing connection
    # before the store listens on it (EADDRINUSE); a lower one cannot.
    import socket

    low = _ephemeral_low()
    for _ in range(20):
        port = rendezvous_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free
