"""The rank launcher itself (``fabric_lib.testing``): answers in order, the rank's traceback on
failure, a failed call raised at once by ``gather``, bounded waits, dead ranks reported, setup and
teardown, and the process group every rank joins."""

from __future__ import annotations

import os
import signal
import time

import pytest
from fabric_lib.testing import RankError, RankInfo, gather, init_process_group, spawn_ranks, this_rank

# -- run in the ranks ----------------------------------------------------------------------------


def open_counter(start: int) -> list[int]:
    return [start]


def add(state: list[int], n: int) -> int:
    state[0] += n
    return state[0]


def whoami(_state: object) -> tuple[RankInfo, int]:
    return this_rank(), os.getpid()


def fail_on(_state: object, rank: int, hold_s: float) -> int:
    if this_rank().rank == rank:
        raise ValueError(f"rank {rank} refuses")
    time.sleep(hold_s)
    return this_rank().rank


def sleep(_state: object, seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def failing_setup() -> None:
    raise RuntimeError("setup refused")


def teardown_value(state: list[int]) -> int:
    return state[0] * 10


def all_reduce_ranks(_state: object) -> int:
    import torch
    import torch.distributed as dist

    init_process_group("gloo", timeout=30)
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    dist.destroy_process_group()
    return int(total.item())


# -- the tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_state_answers_in_order_and_teardown_value() -> None:
    with spawn_ranks(2, setup=open_counter, setup_kwargs=[{"start": 0}, {"start": 100}]) as ranks:
        first = [r.submit(add, 1) for r in ranks]
        second = [r.submit(add, 2) for r in ranks]
        assert gather(second) == [3, 103]  # answers to earlier calls are read first, not lost
        assert gather(first) == [1, 101]
        infos = [info for info, _ in ranks.call_all(whoami)]
        assert [(i.rank, i.world_size, i.local_rank) for i in infos] == [(0, 2, 0), (1, 2, 1)]
        assert infos[0].init_method == infos[1].init_method and infos[0].init_method.startswith(
            "tcp://127.0.0.1:"
        )
    with spawn_ranks(1, setup=open_counter, setup_kwargs={"start": 4}, teardown=teardown_value) as ranks:
        ranks[0].call(add, 1)
        assert ranks.close() == [50]


@pytest.mark.timeout(60)
def test_failures_are_raised_at_once_with_the_ranks_traceback() -> None:
    with spawn_ranks(2) as ranks:
        t0 = time.monotonic()
        with pytest.raises(RankError, match=r"(?s)rank1: 'fail_on' failed.*ValueError: rank 1 refuses"):
            gather(ranks.submit_all(fail_on, 1, 30.0), timeout=45)
        assert time.monotonic() - t0 < 10, "gather waited for the ranks that did not fail"
    with pytest.raises(RankError, match="setup refused"):
        spawn_ranks(1, setup=failing_setup)


@pytest.mark.timeout(60)
def test_bounded_waits_and_dead_ranks() -> None:
    with spawn_ranks(2) as ranks:
        slow, fine = ranks
        with pytest.raises(RankError, match=r"rank0: no answer to 'sleep' within 0.5s"):
            gather([slow.submit(sleep, 20.0)], timeout=0.5)
        with pytest.raises(RankError, match="unusable after an earlier failure"):
            slow.call(sleep, 0.0)  # its late answer would be taken for this call's
        assert fine.call(sleep, 0.0) == 0.0
        pending = fine.submit(sleep, 20.0)
        os.kill(fine.pid, signal.SIGKILL)
        with pytest.raises(RankError, match=r"died \(exit code -9\) during 'sleep'"):
            pending.result(10)
        assert ranks.close() == [None, None]  # killed: no teardown value


@pytest.mark.timeout(120)
def test_every_rank_joins_one_process_group() -> None:
    pytest.importorskip("torch.distributed")
    with spawn_ranks(3) as ranks:
        assert gather(ranks.submit_all(all_reduce_ranks), timeout=90) == [3, 3, 3]
