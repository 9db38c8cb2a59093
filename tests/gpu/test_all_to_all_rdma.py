"""fabric_lib.all_to_all with remote ranks (the RDMA half: CPU proxy on the TransferEngine)
against the pure-torch reference (``a2a_reference``).

Several processes share one GPU (time-sliced: slow, but every wait is real) and stand in for
nodes: ``nvlink=1`` sends everything through the engine, over ``tcp`` (mapped pinned host
buffers) and over ``shm`` of a CUDA-enabled libfabric (GPU buffers, FI_HMEM; skipped without
one); and a mixed layout (NVLink domains of two: CUDA IPC between processes, on one GPU or
across GPUs, ranks r on GPU r % count). The process group is gloo (NCCL refuses two ranks on
one GPU). Skips without CUDA or the embedded kernels.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import fabric_lib
from fabric_lib.errors import FabricTimeoutError
from fabric_lib.testing import Ranks, gather, init_process_group, spawn_ranks

from .a2a_reference import (
    HIDDEN,
    TOPK,
    check_combine,
    check_dispatch,
    expected_combine,
    make_routing,
    make_tokens,
    run_experts,
)

MAX_TOKENS = 48
WORKER_TIMEOUT_S = int(os.environ.get("A2A_TEST_TIMEOUT", "300"))


def _gpu_count() -> int:
    try:
        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no usable CUDA counts as none
        return 0


@dataclass(frozen=True)
class Layout:
    """One deployment: the provider, its options, world size and NVLink domain size."""

    name: str
    provider: str
    world: int
    nvlink: int
    engine_options: dict[str, Any] = field(default_factory=dict)
    gpu_buffers: bool = False


LAYOUTS = [
    Layout("tcp_host", "tcp", world=3, nvlink=1),
    Layout("shm_gpu", "shm", world=2, nvlink=1, engine_options={"gpu_network": True}, gpu_buffers=True),
    Layout("mixed_tcp", "tcp", world=4, nvlink=2),
    # NVLink domains of 2, the other domain through shm with GPU buffers: on a host of 4 GPUs
    # every remote pair crosses GPUs (the engines' device copies run on each rank's own GPU).
    Layout("mixed_shm_gpu", "shm", world=4, nvlink=2, engine_options={"gpu_network": True}, gpu_buffers=True),
]


# ------------------------------------------------------------------------------------ scenarios


def new_a2a(layout: Layout, dtype: Any, **kw: Any) -> Any:
    import torch.distributed as dist
    from fabric_lib.all_to_all import AllToAll

    W = dist.get_world_size()
    args: dict[str, Any] = {
        "max_num_tokens": MAX_TOKENS,
        "hidden": HIDDEN,
        "num_experts": 8 * W,
        "experts_per_token": TOPK,
        "dispatch_dtype": dtype,
        "timeout": 30.0,
        "nvlink": layout.nvlink,
        "provider": layout.provider,
        "engine_options": {"poll_mode": "adaptive", **layout.engine_options},
        "private_tokens": 8,  # most pairs need the overflow write too
    }
    args.update(kw)
    a2a = AllToAll(**args)
    assert a2a.remote_gpu_buffers is layout.gpu_buffers, (a2a.remote_gpu_buffers, layout)
    return a2a


def settle(a2a: Any) -> None:
    """With shm and GPU buffers, waits for this stream's calls before the host copies results:
    shm's device copies (`cudaMemcpy` in the receiving engine's progress) need the CUDA driver's
    exclusive lock, which a pageable host copy (`tensor.cpu()`) holds while it waits behind the
    receive kernel, which waits for those copies (docs/all_to_all_rdma.md, Limits). Nothing to do
    elsewhere."""
    if a2a._side_stream_only:
        torch.cuda.current_stream().synchronize()


def round_trip(a2a: Any, kind: str, T: int, gen: Any, *, T_live: int | None = None) -> None:
    dev = a2a.device
    x, scales, deq = make_tokens(T, a2a.dispatch_dtype, gen, dev, a2a.hidden)
    idx, w = make_routing(kind, T, a2a.num_experts, gen, dev)
    nt = None
    if T_live is not None:
        nt = torch.tensor([T_live], dtype=torch.int32, device=dev)
    else:
        T_live = T
    out = a2a.dispatch(x, idx, scales=scales, num_tokens=nt)
    settle(a2a)
    check_dispatch(a2a, out, x, scales, idx, T_live)
    got = a2a.combine(run_experts(a2a, out), idx, w)
    settle(a2a)
    check_combine(got, deq, idx, w, a2a.num_experts, T_live)
    a2a.check()


def sc_routings(layout: Layout, gen: Any) -> None:
    """bf16 and fp8, uniform / masked / skewed (every token to rank 0's experts: its private
    quota overflows), fewer tokens than the maximum; the proxy's writes stay within the limits."""
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        a2a = new_a2a(layout, dtype)
        for kind in ("uniform", "masked", "skewed"):
            round_trip(a2a, kind, MAX_TOKENS, gen)
        round_trip(a2a, "uniform", 5 + 3 * a2a.rank, gen)
        dispatches, combines = a2a.proxy_stats()
        remote = a2a.world_size - layout.nvlink
        assert len(dispatches) == 4 and len(combines) == 4, (len(dispatches), len(combines))
        for s in dispatches:
            assert s["data_writes"] <= 2 * remote and s["count_writes"] == a2a.world_size - 1, s
        assert any(s["data_writes"] > remote for s in dispatches), "no call used the overflow write"
        assert all(c["writes"] == remote for c in combines), combines
        a2a.destroy()


def sc_quota_extremes(layout: Layout, gen: Any) -> None:
    """No private quota (everything in the overflow area) and a quota that holds everything."""
    for q in (0, MAX_TOKENS):
        a2a = new_a2a(layout, torch.bfloat16, private_tokens=q)
        round_trip(a2a, "masked", MAX_TOKENS, gen)
        round_trip(a2a, "skewed", MAX_TOKENS - 11, gen)
        a2a.destroy()


def sc_empty_ranks(layout: Layout, gen: Any) -> None:
    a2a = new_a2a(layout, torch.float8_e4m3fn)
    round_trip(a2a, "uniform", 0 if a2a.rank == 1 else MAX_TOKENS, gen)
    round_trip(a2a, "skewed", 0 if a2a.rank == 0 else 17, gen)
    round_trip(a2a, "uniform", 0, gen)  # nobody sends anything
    round_trip(a2a, "uniform", MAX_TOKENS, gen, T_live=20 + a2a.rank)
    a2a.destroy()


def sc_split_halves(layout: Layout, gen: Any) -> None:
    for fused in (True, False):
        a2a = new_a2a(layout, torch.float8_e4m3fn, fused=fused)
        dev = a2a.device
        for _ in range(2):
            x, scales, deq = make_tokens(MAX_TOKENS, a2a.dispatch_dtype, gen, dev, a2a.hidden)
            idx, w = make_routing("masked", MAX_TOKENS, a2a.num_experts, gen, dev)
            assert a2a.dispatch(x, idx, scales=scales, do_recv=False) is None
            m = torch.randn(256, 256, device=dev)
            m = m @ m
            out = a2a.dispatch(do_send=False)
            settle(a2a)
            check_dispatch(a2a, out, x, scales, idx, MAX_TOKENS)
            assert a2a.combine(run_experts(a2a, out), idx, w, do_recv=False) is None
            m = m @ m
            got = a2a.combine(None, idx, None, do_send=False)
            settle(a2a)
            check_combine(got, deq, idx, w, a2a.num_experts, MAX_TOKENS)
        a2a.check()
        a2a.destroy()


def sc_consecutive(layout: Layout, gen: Any) -> None:
    """300 calls back to back, varying sizes and routings, checked on the device (one sync). With
    remote ranks a call's halves run as two kernels by default (measured a few percent faster
    than the fused kernel there)."""
    a2a = new_a2a(layout, torch.float8_e4m3fn)
    assert a2a.fused is False, "remote ranks: the halves back to back by default"
    dev = a2a.device
    worst = torch.zeros((), device=dev)
    for i in range(300):
        T = int(torch.randint(0, MAX_TOKENS + 1, (1,), generator=gen))
        x, scales, deq = make_tokens(T, a2a.dispatch_dtype, gen, dev, a2a.hidden)
        idx, w = make_routing(("masked", "uniform", "skewed")[i % 3], T, a2a.num_experts, gen, dev)
        out = a2a.dispatch(x, idx, scales=scales)
        if i % 100 == 0:
            settle(a2a)
            check_dispatch(a2a, out, x, scales, idx, T)
        got = a2a.combine(run_experts(a2a, out), idx, w)
        settle(a2a)
        want = expected_combine(deq, idx, w, a2a.num_experts, T)
        err = ((got.float() - want).abs() - 2e-2 * want.abs()).amax() if T else torch.zeros((), device=dev)
        worst = torch.maximum(worst, err)
    a2a.check()
    assert float(worst) < 3e-2, f"worst error {float(worst)}"
    a2a.destroy()


def sc_cuda_graph(layout: Layout, gen: Any) -> None:
    """One dispatch + combine captured once and replayed 100 times with new inputs: the proxy
    follows the kernels' sequence numbers, not the host's calls."""
    a2a = new_a2a(layout, torch.float8_e4m3fn)
    dev = a2a.device
    E = a2a.num_experts
    sx, ss, _ = make_tokens(MAX_TOKENS, a2a.dispatch_dtype, gen, dev, a2a.hidden)
    si, sw = make_routing("uniform", MAX_TOKENS, E, gen, dev)
    sn = torch.tensor([MAX_TOKENS], dtype=torch.int32, device=dev)

    def step() -> Any:
        out = a2a.dispatch(sx, si, scales=ss, num_tokens=sn)
        return a2a.combine(run_experts(a2a, out), si, sw)

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        res = step()
    worst = torch.zeros((), device=dev)
    for i in range(100):
        T_live = int(torch.randint(0, MAX_TOKENS + 1, (1,), generator=gen))
        x, scales, deq = make_tokens(MAX_TOKENS, a2a.dispatch_dtype, gen, dev, a2a.hidden)
        idx, w = make_routing(("masked", "skewed")[i % 2], MAX_TOKENS, E, gen, dev)
        sx.copy_(x)
        ss.copy_(scales)
        si.copy_(idx)
        sw.copy_(w)
        sn.fill_(T_live)
        g.replay()
        settle(a2a)
        want = expected_combine(deq, idx, w, E, T_live)
        worst = torch.maximum(worst, ((res.float() - want).abs() - 2e-2 * want.abs()).amax())
    a2a.check()
    assert float(worst) < 3e-2, f"worst error over 100 replays {float(worst)}"
    round_trip(a2a, "uniform", MAX_TOKENS, gen)  # eager calls still work after the replays
    del g
    a2a.destroy()


def sc_proxy_thread(layout: Layout, gen: Any) -> None:
    """The proxy on a thread of its own (``proxy="thread"``; the engine's worker runs it by
    default): the same results, the same writes per call."""
    a2a = new_a2a(layout, torch.float8_e4m3fn, proxy="thread")
    for kind in ("uniform", "skewed", "masked"):
        round_trip(a2a, kind, MAX_TOKENS, gen)
    dispatches, combines = a2a.proxy_stats()
    remote = a2a.world_size - layout.nvlink
    assert len(dispatches) == 3 and all(s["data_writes"] <= 2 * remote for s in dispatches), dispatches
    assert all(c["writes"] == remote for c in combines), combines
    a2a.destroy()


def sc_default_stream(layout: Layout, gen: Any) -> None:
    """Calls on the legacy default stream: refused with a typed error (nothing launched, the
    object still usable) where shm's device copies run on that stream, a plain round trip
    elsewhere."""
    from fabric_lib.errors import InvalidArgumentError

    a2a = new_a2a(layout, torch.bfloat16)
    x, _, _ = make_tokens(MAX_TOKENS, a2a.dispatch_dtype, gen, a2a.device, a2a.hidden)
    idx, _ = make_routing("uniform", MAX_TOKENS, a2a.num_experts, gen, a2a.device)
    with torch.cuda.stream(torch.cuda.default_stream(a2a.device)):
        if layout.gpu_buffers:
            with pytest.raises(InvalidArgumentError, match="non-default stream"):
                a2a.dispatch(x, idx)
        else:
            round_trip(a2a, "uniform", MAX_TOKENS, gen)
    round_trip(a2a, "masked", MAX_TOKENS, gen)  # on the scenario's stream: still usable
    a2a.destroy()


SCENARIOS: dict[str, Callable[[Layout, Any], None]] = {
    "routings": sc_routings,
    "quota_extremes": sc_quota_extremes,
    "empty_ranks": sc_empty_ranks,
    "split_halves": sc_split_halves,
    "consecutive": sc_consecutive,
    "cuda_graph": sc_cuda_graph,
    "default_stream": sc_default_stream,
    "proxy_thread": sc_proxy_thread,
}


# -------------------------------------------------------------------------------- in each rank


def join_world(timeout: float = 120) -> None:
    """gloo process group (ranks may share a GPU); rank r on GPU r % count."""
    from fabric_lib.testing import this_rank

    torch.cuda.set_device(this_rank().rank % torch.cuda.device_count())
    init_process_group("gloo", timeout=timeout)


def join_wide_world() -> None:
    """join_world for many ranks on one GPU: they reach the closing barrier minutes apart."""
    join_world(timeout=WORKER_TIMEOUT_S)


def leave_world(_state: None) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def _stream_for(layout: Layout) -> Any:
    # shm queues its device copies on the legacy default stream: the calls run on a side stream.
    return torch.cuda.stream(torch.cuda.Stream()) if layout.provider == "shm" else contextlib.nullcontext()


def run_scenario(_state: None, layout: Layout, name: str) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(4321 + 7919 * rank + sum(map(ord, name)))
    try:
        with _stream_for(layout):
            {**SCENARIOS, "wide": sc_wide}[name](layout, gen)
        outcome = "ok"
    except BaseException:  # noqa: BLE001 - reported to the test
        outcome = traceback.format_exc()
    torch.cuda.synchronize()
    dist.barrier()
    return outcome


def _skip_unless_usable(layout: Layout) -> None:
    if not _gpu_count():
        pytest.skip("needs a CUDA GPU")
    if not fabric_lib._rust.AllToAll.kernel_archs():
        pytest.skip("fabric_lib was built without nvcc: no all-to-all kernels")
    if layout.gpu_buffers:
        from .test_gpu_network import skip_unless_gpu_network

        skip_unless_gpu_network()


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda layout: layout.name)
def world(request: pytest.FixtureRequest) -> Iterator[tuple[Layout, Ranks[None]]]:
    layout: Layout = request.param
    _skip_unless_usable(layout)
    with spawn_ranks(layout.world, setup=join_world, teardown=leave_world, timeout=180) as ranks:
        yield layout, ranks


@pytest.mark.gpu
@pytest.mark.timeout(WORKER_TIMEOUT_S + 60)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_all_to_all_rdma(world: tuple[Layout, Ranks[None]], scenario: str) -> None:
    layout, ranks = world
    outcomes = gather(ranks.submit_all(run_scenario, layout, scenario), WORKER_TIMEOUT_S)
    failures = [f"rank {r}:\n{o}" for r, o in enumerate(outcomes) if o != "ok"]
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------------------- a killed rank


def killed_peer(_state: None, layout: Layout, victim: int) -> float:
    """A round trip, then `victim` dies (no goodbye); the others' next call raises a typed
    timeout within the kernels' timeout, never hangs. Returns the seconds it took."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(99 + dist.get_rank())
    with _stream_for(layout):
        a2a = new_a2a(layout, torch.bfloat16, timeout=3.0)
        round_trip(a2a, "uniform", MAX_TOKENS, gen)
        dist.barrier()
        if dist.get_rank() == victim:
            os._exit(17)
        time.sleep(0.5)  # the victim is gone
        x, _, _ = make_tokens(MAX_TOKENS, torch.bfloat16, gen, a2a.device, a2a.hidden)
        idx, w = make_routing("uniform", MAX_TOKENS, a2a.num_experts, gen, a2a.device)
        started = time.monotonic()
        with pytest.raises(FabricTimeoutError):
            out = a2a.dispatch(x, idx)
            a2a.combine(run_experts(a2a, out), idx, w)
            a2a.check()
        with pytest.raises(FabricTimeoutError, match="unusable"):
            a2a.dispatch(x, idx)
        return time.monotonic() - started


@pytest.mark.gpu
@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=lambda layout: layout.name)
def test_killed_remote_rank_raises_a_typed_timeout(layout: Layout) -> None:
    _skip_unless_usable(layout)
    victim = layout.world - 1
    with spawn_ranks(layout.world, setup=join_world, timeout=180) as ranks:
        pending = ranks.submit_all(killed_peer, layout, victim)
        took = [p.result(90) for r, p in enumerate(pending) if r != victim]
        assert all(t < 30 for t in took), took
        ranks[victim].join(10)
        assert ranks[victim].exitcode == 17


# ------------------------------------------------------------------- more than 32 ranks

# Past 32 ranks the kernels keep rank sets in two words and a lane stands for two ranks (the
# wide builds of the dispatch send). 40 ranks in NVLink domains of 4 (all on the one GPU): ranks
# 32-39 are NVLink peers of each other and remote to everyone else. A2A_WIDE_WORLD (up to 64)
# and A2A_WIDE_NVLINK (a divisor of it; 1: everything through the engine) change the layout.
WIDE = Layout(
    "tcp_wide",
    "tcp",
    world=int(os.environ.get("A2A_WIDE_WORLD", "40")),
    nvlink=int(os.environ.get("A2A_WIDE_NVLINK", "4")),
)


def sc_wide(layout: Layout, gen: Any) -> None:
    """bf16 and fp8, uniform and skewed (rank 0's private quota overflows from every source)."""
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        a2a = new_a2a(layout, dtype, timeout=60.0)
        for kind in ("uniform", "skewed"):
            round_trip(a2a, kind, MAX_TOKENS, gen)
        dispatches, combines = a2a.proxy_stats()
        remote = a2a.world_size - layout.nvlink
        assert all(s["data_writes"] <= 2 * remote for s in dispatches), dispatches
        assert all(c["writes"] == remote for c in combines), combines
        a2a.destroy()


@pytest.mark.gpu
@pytest.mark.timeout(WORKER_TIMEOUT_S + 240)
def test_a_world_of_more_than_thirty_two_ranks() -> None:
    """40 ranks (ranks 32 and up in the high word of every rank set), over NVLink and through
    the engine: results equal the reference. Slow on one shared GPU: every rank gets a time
    slice."""
    _skip_unless_usable(WIDE)
    with spawn_ranks(WIDE.world, setup=join_wide_world, teardown=leave_world, timeout=240) as ranks:
        pending = ranks.submit_all(run_scenario, WIDE, "wide")
        try:
            outcomes = gather(pending, WORKER_TIMEOUT_S)
        except Exception as e:
            # The first rank to report may only have lost a peer: name every rank that exited and
            # what the ranks that answered found.
            time.sleep(2)
            exited = {r: ranks[r].exitcode for r in range(WIDE.world) if ranks[r].exitcode is not None}
            found = {r: p._value for r, p in enumerate(pending) if p.done and p._value not in (None, "ok")}
            raise AssertionError(f"ranks that exited: {exited}; failures reported: {found}") from e
    failures = [f"rank {r}:\n{o}" for r, o in enumerate(outcomes) if o != "ok"]
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------------ no GPU needed


def test_bad_layouts_are_refused_before_anything_starts() -> None:
    """nvlink must divide the group; private_tokens, nets_per_gpu and proxy are checked (no GPU
    work)."""
    import torch.distributed as dist
    from fabric_lib.all_to_all import AllToAll
    from fabric_lib.errors import InvalidArgumentError

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the checks follow the CUDA check)")
    from fabric_lib.distributed import rendezvous_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{rendezvous_port()}", rank=0, world_size=1)
    try:
        base: dict[str, Any] = {"max_num_tokens": 8, "hidden": 128, "num_experts": 8, "experts_per_token": 2}
        with pytest.raises(InvalidArgumentError, match="nvlink"):
            AllToAll(**base, nvlink=0)
        with pytest.raises(InvalidArgumentError, match="private_tokens"):
            AllToAll(**base, private_tokens=9)
        with pytest.raises(InvalidArgumentError, match="nets_per_gpu"):
            AllToAll(**base, nets_per_gpu=0)
        with pytest.raises(InvalidArgumentError, match="proxy"):
            AllToAll(**base, nvlink=1, proxy="elsewhere")  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()
