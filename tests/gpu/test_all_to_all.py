"""fabric_lib.all_to_all against a pure-torch reference (``a2a_reference``), on 2 and 4 GPUs of one
host.

One world of ranks per world size (``fabric_lib.testing.spawn_ranks``, NCCL process group) runs
every scenario in turn, so CUDA and NCCL start-up is paid once; each test runs its scenario on
every rank and asserts that each one passed. Needs ``world_size`` CUDA GPUs with peer-to-peer
access; skips with the reason elsewhere.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import fabric_lib
from fabric_lib.errors import FabricTimeoutError, InvalidArgumentError
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

MAX_TOKENS = 96
WORKER_TIMEOUT_S = int(os.environ.get("A2A_TEST_TIMEOUT", "420"))


def _gpu_count() -> int:
    try:
        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no usable CUDA counts as none
        return 0


# ------------------------------------------------------------------------------------ scenarios


def new_a2a(dtype: Any, **kw: Any) -> Any:
    import torch.distributed as dist
    from fabric_lib.all_to_all import AllToAll

    W = dist.get_world_size()
    args = {
        "max_num_tokens": MAX_TOKENS,
        "hidden": HIDDEN,
        "num_experts": 8 * W,
        "experts_per_token": TOPK,
        "dispatch_dtype": dtype,
        "timeout": 10.0,
    }
    args.update(kw)
    return AllToAll(**args)


def round_trip(
    a2a: Any, kind: str, T: int, gen: Any, *, T_live: int | None = None, full: bool = True
) -> None:
    dev = a2a.device
    x, scales, deq = make_tokens(T, a2a.dispatch_dtype, gen, dev, a2a.hidden)
    idx, w = make_routing(kind, T, a2a.num_experts, gen, dev)
    nt = None
    if T_live is not None:
        nt = torch.tensor([T_live], dtype=torch.int32, device=dev)
    else:
        T_live = T
    out = a2a.dispatch(x, idx, scales=scales, num_tokens=nt)
    if full:
        check_dispatch(a2a, out, x, scales, idx, T_live)
    y = run_experts(a2a, out)
    got = a2a.combine(y, idx, w)
    check_combine(got, deq, idx, w, a2a.num_experts, T_live)
    a2a.check()


def sc_routings(dtype: Any, routings: tuple[str, ...], gen: Any) -> None:
    """Round trips of MAX_TOKENS tokens with each routing in turn, on one object."""
    a2a = new_a2a(dtype)
    for routing in routings:
        round_trip(a2a, routing, MAX_TOKENS, gen)
    a2a.destroy()


def sc_empty_rank(gen: Any) -> None:
    a2a = new_a2a(torch.float8_e4m3fn)
    T = 0 if a2a.rank == 1 else MAX_TOKENS
    round_trip(a2a, "uniform", T, gen)
    T = 0 if a2a.rank == 0 else 33
    round_trip(a2a, "skewed", T, gen)
    a2a.destroy()


def sc_fewer_tokens(gen: Any) -> None:
    a2a = new_a2a(torch.bfloat16)
    round_trip(a2a, "uniform", 17, gen)
    round_trip(a2a, "masked", 1 + a2a.rank * 5, gen)
    a2a.destroy()


def sc_device_num_tokens(gen: Any) -> None:
    a2a = new_a2a(torch.float8_e4m3fn)
    round_trip(a2a, "uniform", MAX_TOKENS, gen, T_live=40 + a2a.rank)
    round_trip(a2a, "uniform", 64, gen, T_live=0)
    round_trip(a2a, "uniform", 64, gen, T_live=64)
    a2a.destroy()


def sc_split_halves(gen: Any) -> None:
    a2a = new_a2a(torch.float8_e4m3fn)
    dev = a2a.device
    for _ in range(3):
        x, scales, deq = make_tokens(MAX_TOKENS, a2a.dispatch_dtype, gen, dev)
        idx, w = make_routing("uniform", MAX_TOKENS, a2a.num_experts, gen, dev)
        m = torch.randn(1024, 1024, device=dev)
        assert a2a.dispatch(x, idx, scales=scales, do_recv=False) is None
        m = m @ m
        out = a2a.dispatch(do_send=False)
        check_dispatch(a2a, out, x, scales, idx, MAX_TOKENS)
        y = run_experts(a2a, out)
        assert a2a.combine(y, idx, w, do_recv=False) is None
        m = m @ m
        got = a2a.combine(None, idx, None, do_send=False)
        check_combine(got, deq, idx, w, a2a.num_experts, MAX_TOKENS)
    a2a.check()
    a2a.destroy()


def sc_unfused(gen: Any) -> None:
    """Both halves as two kernels each (fused=False) give the same results."""
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        a2a = new_a2a(dtype, fused=False)
        round_trip(a2a, "masked", MAX_TOKENS, gen)
        round_trip(a2a, "skewed", 50, gen)
        a2a.destroy()


def _with_send_warps(dispatch: int | None, combine: int | None, make: Any) -> Any:
    """Creates an AllToAll with the sending warps of fused calls forced (read at creation)."""
    names = {"FABRIC_A2A_DISPATCH_SEND_WARPS": dispatch, "FABRIC_A2A_COMBINE_SEND_WARPS": combine}
    try:
        for k, v in names.items():
            if v is not None:
                os.environ[k] = str(v)
        return make()
    finally:
        for k in names:
            os.environ.pop(k, None)


def sc_streaming(gen: Any) -> None:
    """Many tokens per block (prefill): fused calls stream (some warps send while the others
    receive), with the default split, the extremes, and back to back calls of varying size."""
    big = 2048
    a2a = new_a2a(torch.float8_e4m3fn, max_num_tokens=big)  # default: streams (>= 4 tokens per block)
    round_trip(a2a, "uniform", big, gen)
    round_trip(a2a, "masked", big - 301, gen)
    round_trip(a2a, "skewed", big, gen)
    round_trip(a2a, "uniform", 5 + a2a.rank, gen)
    a2a.destroy()
    for dw, cw in ((1, 1), (15, 15), (16, 16)):
        a2a = _with_send_warps(dw, cw, lambda: new_a2a(torch.bfloat16, max_num_tokens=big))
        round_trip(a2a, "masked", big, gen)
        round_trip(a2a, "uniform", 700 + 3 * a2a.rank, gen, T_live=650)
        a2a.destroy()
    a2a = _with_send_warps(2, 3, lambda: new_a2a(torch.float8_e4m3fn))  # one token per block
    round_trip(a2a, "masked", MAX_TOKENS, gen)
    round_trip(a2a, "skewed", MAX_TOKENS, gen)
    a2a.destroy()


def sc_wide_rows(gen: Any) -> None:
    """The benchmark's hidden size: rows of several 2 KiB chunks (fp8 with a partial last one and
    fp32 scales in the record), decode-sized and streaming."""
    H = 7168
    for dtype, T in ((torch.float8_e4m3fn, 64), (torch.bfloat16, 64), (torch.float8_e4m3fn, 1100)):
        a2a = new_a2a(dtype, hidden=H, max_num_tokens=T, max_tokens_per_expert=2 * T)
        round_trip(a2a, "masked", T, gen)
        round_trip(a2a, "uniform", T - 7, gen)
        a2a.destroy()


def sc_consecutive(gen: Any) -> None:
    a2a = new_a2a(torch.float8_e4m3fn)
    assert a2a.fused is True, "every rank over NVLink: one fused kernel by default"
    dev = a2a.device
    worst = torch.zeros((), device=dev)
    for i in range(300):
        T = int(torch.randint(0, MAX_TOKENS + 1, (1,), generator=gen))
        x, scales, deq = make_tokens(T, a2a.dispatch_dtype, gen, dev)
        idx, w = make_routing("masked" if i % 3 else "uniform", T, a2a.num_experts, gen, dev)
        out = a2a.dispatch(x, idx, scales=scales)
        if i % 50 == 0:
            check_dispatch(a2a, out, x, scales, idx, T)
        got = a2a.combine(run_experts(a2a, out), idx, w)
        want = expected_combine(deq, idx, w, a2a.num_experts, T)
        err = ((got.float() - want).abs() - 2e-2 * want.abs()).amax() if T else torch.zeros((), device=dev)
        worst = torch.maximum(worst, err)
    a2a.check()
    assert float(worst) < 3e-2, f"worst error {float(worst)}"
    a2a.destroy()


def sc_dispatch_only_loop(gen: Any) -> None:
    a2a = new_a2a(torch.bfloat16)
    dev = a2a.device
    for _ in range(60):
        x, scales, deq = make_tokens(MAX_TOKENS, a2a.dispatch_dtype, gen, dev)
        idx, w = make_routing("uniform", MAX_TOKENS, a2a.num_experts, gen, dev)
        out = a2a.dispatch(x, idx, scales=scales)
    check_dispatch(a2a, out, x, scales, idx, MAX_TOKENS)
    y = run_experts(a2a, out)
    for _ in range(60):
        got = a2a.combine(y, idx, w)
    check_combine(got, deq, idx, w, a2a.num_experts, MAX_TOKENS)
    a2a.check()
    a2a.destroy()


def sc_cuda_graph(gen: Any) -> None:
    a2a = new_a2a(torch.float8_e4m3fn)
    dev = a2a.device
    E = a2a.num_experts
    sx, ss, _ = make_tokens(MAX_TOKENS, a2a.dispatch_dtype, gen, dev)
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
        x, scales, deq = make_tokens(MAX_TOKENS, a2a.dispatch_dtype, gen, dev)
        idx, w = make_routing("masked" if i % 2 else "uniform", MAX_TOKENS, E, gen, dev)
        sx.copy_(x)
        ss.copy_(scales)
        si.copy_(idx)
        sw.copy_(w)
        sn.fill_(T_live)
        g.replay()
        want = expected_combine(deq, idx, w, E, T_live)
        err = ((res.float() - want).abs() - 2e-2 * want.abs()).amax()
        worst = torch.maximum(worst, err)
    a2a.check()
    assert float(worst) < 3e-2, f"worst error over 100 replays {float(worst)}"
    # The object still works eagerly after the replays.
    round_trip(a2a, "uniform", MAX_TOKENS, gen)
    del g
    a2a.destroy()


def sc_host_counts(gen: Any) -> None:
    a2a = new_a2a(torch.bfloat16, publish_host_counts=True)
    dev = a2a.device
    for seq in (1, 2):
        x, _, _ = make_tokens(MAX_TOKENS, torch.bfloat16, gen, dev)
        idx, w = make_routing("masked", MAX_TOKENS, a2a.num_experts, gen, dev)
        out = a2a.dispatch(x, idx)
        a2a.combine(run_experts(a2a, out), idx, w)
        a2a.check()
        got_seq, counts = a2a.host_counts()
        want = torch.bincount(idx[idx >= 0].flatten().cpu(), minlength=a2a.num_experts).tolist()
        assert got_seq == seq and counts == want, (got_seq, counts, want)
    a2a.destroy()


def _raises(exc: Any, fn: Any, match: str = "") -> None:
    with pytest.raises(exc, match=match):
        fn()


def sc_bad_input(gen: Any) -> None:
    a2a = new_a2a(torch.bfloat16)
    dev = a2a.device
    E = a2a.num_experts
    x, _, deq = make_tokens(MAX_TOKENS, torch.bfloat16, gen, dev)
    idx, w = make_routing("uniform", MAX_TOKENS, E, gen, dev)
    _raises(InvalidArgumentError, lambda: a2a.combine(None, idx, w), "before any dispatch")
    _raises(InvalidArgumentError, lambda: a2a.dispatch(x.float(), idx), "dtype")
    _raises(InvalidArgumentError, lambda: a2a.dispatch(x.cpu(), idx.cpu()), "cpu")
    _raises(InvalidArgumentError, lambda: a2a.dispatch(x[:, :256], idx), "hidden")
    big = torch.zeros((MAX_TOKENS + 1, HIDDEN), dtype=torch.bfloat16, device=dev)
    _raises(
        InvalidArgumentError,
        lambda: a2a.dispatch(big, torch.zeros((MAX_TOKENS + 1, TOPK), dtype=torch.int64, device=dev)),
        "max_num_tokens",
    )
    _raises(InvalidArgumentError, lambda: a2a.dispatch(x, idx[:, :2]), "shape")
    _raises(InvalidArgumentError, lambda: a2a.dispatch(x, idx.float()), "dtype")
    _raises(
        InvalidArgumentError,
        lambda: a2a.dispatch(x, idx, scales=torch.ones(MAX_TOKENS, 4, device=dev)),
        "only for fp8",
    )
    _raises(
        InvalidArgumentError, lambda: a2a.dispatch(x, idx, num_tokens=torch.tensor([3], device=dev)), "int32"
    )
    a2a.validate = True
    bad = idx.clone()
    bad[3, 1] = E
    _raises(InvalidArgumentError, lambda: a2a.dispatch(x, bad), "expert indices")
    bad[3, 1] = -7
    _raises(InvalidArgumentError, lambda: a2a.dispatch(x, bad), "expert indices")
    a2a.validate = False
    # Nothing was launched: the object still works.
    out = a2a.dispatch(x, idx)
    y = run_experts(a2a, out)
    _raises(InvalidArgumentError, lambda: a2a.combine(y[:, :-1], idx, w), "expert_out")
    _raises(InvalidArgumentError, lambda: a2a.combine(y, idx, w[:-1]), "weights")
    _raises(InvalidArgumentError, lambda: a2a.combine(y, idx[:-1], w), "indices")
    _raises(InvalidArgumentError, lambda: a2a.combine(y.float(), idx, w), "dtype")
    got = a2a.combine(y, idx, w)
    check_combine(got, deq, idx, w, E, MAX_TOKENS)
    a2a.check()
    a2a.destroy()
    fp8 = new_a2a(torch.float8_e4m3fn)
    q, scales, _ = make_tokens(MAX_TOKENS, torch.float8_e4m3fn, gen, dev)
    _raises(InvalidArgumentError, lambda: fp8.dispatch(q, idx), "scales")
    _raises(InvalidArgumentError, lambda: fp8.dispatch(q, idx, scales=scales[:, :2]), "scales")
    _raises(InvalidArgumentError, lambda: fp8.dispatch(x, idx, scales=scales), "dtype")
    fp8.destroy()


def sc_device_errors(gen: Any) -> None:
    """Errors only the kernels see are raised by check() / the next call, and the object recovers.
    (Every rank has the same bad input, so every rank raises at the same call.)"""
    a2a = new_a2a(torch.bfloat16)
    dev = a2a.device
    E = a2a.num_experts
    x, _, _ = make_tokens(MAX_TOKENS, torch.bfloat16, gen, dev)
    idx, w = make_routing("uniform", MAX_TOKENS, E, gen, dev)
    bad = idx.clone()
    bad[0, 0] = E + 5
    out = a2a.dispatch(x, bad)
    torch.cuda.synchronize()
    _raises(InvalidArgumentError, lambda: a2a.combine(run_experts(a2a, out), bad, w), "outside")
    nt = torch.tensor([MAX_TOKENS + 50], dtype=torch.int32, device=dev)
    out = a2a.dispatch(x, idx, num_tokens=nt)
    _raises(InvalidArgumentError, a2a.check, "device token count")
    got = a2a.combine(run_experts(a2a, out), idx, w)  # all rows of x were used
    check_combine(got, x.float(), idx, w, E, MAX_TOKENS)
    round_trip(a2a, "uniform", MAX_TOKENS, gen)
    a2a.destroy()
    small = new_a2a(torch.bfloat16, max_tokens_per_expert=8)
    sk, _ = make_routing("skewed", MAX_TOKENS, E, gen, dev)
    out = small.dispatch(x, sk)
    torch.cuda.synchronize()
    if small.rank == 0:  # experts 0..TOPK-1 live on rank 0: only it overflows
        _raises(InvalidArgumentError, small.check, "max_tokens_per_expert")
    else:
        small.check()
    assert out.counts.max().item() <= 8
    small.destroy()


def sc_call_order(gen: Any) -> None:
    """A send half twice without the receive half is reported (not silently raced); the object
    works again once the halves are back in order."""
    a2a = new_a2a(torch.bfloat16)
    dev = a2a.device
    x, _, _ = make_tokens(MAX_TOKENS, torch.bfloat16, gen, dev)
    idx, _ = make_routing("uniform", MAX_TOKENS, a2a.num_experts, gen, dev)
    a2a.dispatch(x, idx, do_recv=False)
    a2a.dispatch(x, idx, do_recv=False)
    a2a.dispatch(do_send=False)
    _raises(InvalidArgumentError, a2a.check, "before the receive half")
    a2a.dispatch(do_send=False)  # the second send's receive half: back in order
    round_trip(a2a, "uniform", MAX_TOKENS, gen)
    a2a.destroy()


def sc_peer_timeout(gen: Any) -> None:
    """Rank 0 skips a dispatch: the others' kernels time out and report it instead of hanging."""
    import torch.distributed as dist

    a2a = new_a2a(torch.bfloat16, timeout=2.0)
    dev = a2a.device
    x, _, _ = make_tokens(MAX_TOKENS, torch.bfloat16, gen, dev)
    idx, _ = make_routing("uniform", MAX_TOKENS, a2a.num_experts, gen, dev)
    if a2a.rank != 0:
        t0 = time.monotonic()
        a2a.dispatch(x, idx)
        _raises(FabricTimeoutError, a2a.check, "timed out")
        assert time.monotonic() - t0 < 30
        _raises(FabricTimeoutError, lambda: a2a.dispatch(x, idx), "unusable")
    torch.cuda.synchronize()
    dist.barrier()


# Each scenario runs on every rank with its own generator; module-level functions (or partials of
# them), so that they reach the ranks by reference.
SCENARIOS: dict[str, Callable[[Any], None]] = {
    "uniform_bf16": functools.partial(sc_routings, torch.bfloat16, ("masked", "uniform")),
    "uniform_fp8": functools.partial(sc_routings, torch.float8_e4m3fn, ("masked", "uniform")),
    "skewed_bf16": functools.partial(sc_routings, torch.bfloat16, ("skewed", "uniform")),
    "skewed_fp8": functools.partial(sc_routings, torch.float8_e4m3fn, ("skewed", "uniform")),
    "empty_rank": sc_empty_rank,
    "fewer_tokens": sc_fewer_tokens,
    "device_num_tokens": sc_device_num_tokens,
    "split_halves": sc_split_halves,
    "unfused": sc_unfused,
    "streaming": sc_streaming,
    "wide_rows": sc_wide_rows,
    "consecutive": sc_consecutive,
    "dispatch_only_loop": sc_dispatch_only_loop,
    "cuda_graph": sc_cuda_graph,
    "host_counts": sc_host_counts,
    "bad_input": sc_bad_input,
    "device_errors": sc_device_errors,
    "call_order": sc_call_order,
    "peer_timeout": sc_peer_timeout,
}


# -------------------------------------------------------------------------------- in each rank


def join_world() -> None:
    init_process_group("nccl", timeout=120)


def leave_world(_state: None) -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def run_scenario(_state: None, name: str, scenario: Callable[[Any], None]) -> str:
    """Runs one scenario; "ok", or the traceback of what it raised. Every rank meets the others
    afterwards, so that the next scenario starts together whatever this one did."""
    import torch.distributed as dist

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1234 + 7919 * rank + sum(map(ord, name)))
    try:
        scenario(gen)
        outcome = "ok"
    except BaseException:  # noqa: BLE001 - reported to the test
        outcome = traceback.format_exc()
    torch.cuda.synchronize()
    dist.barrier()
    return outcome


# ------------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}gpu")
def gpu_world(request: pytest.FixtureRequest) -> Iterator[Ranks[None]]:
    """``world`` ranks, one per GPU, in one NCCL process group, for the whole module."""
    world = request.param
    found = _gpu_count()
    if found < world:
        pytest.skip(f"needs {world} CUDA GPUs on one host (found {found})")
    if not fabric_lib._rust.AllToAll.kernel_archs():
        pytest.skip("fabric_lib was built without nvcc: no all-to-all kernels")
    with spawn_ranks(world, setup=join_world, teardown=leave_world, timeout=180) as ranks:
        yield ranks


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.timeout(WORKER_TIMEOUT_S + 60)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_all_to_all(gpu_world: Ranks[None], scenario: str) -> None:
    only = os.environ.get("A2A_TEST_ONLY")
    if only and scenario not in only.split(","):
        pytest.skip("not selected by A2A_TEST_ONLY")
    outcomes = gather(gpu_world.submit_all(run_scenario, scenario, SCENARIOS[scenario]), WORKER_TIMEOUT_S)
    failures = [f"rank {rank}:\n{outcome}" for rank, outcome in enumerate(outcomes) if outcome != "ok"]
    assert not failures, "\n".join(failures)


def test_import_and_errors_without_gpu() -> None:
    """Importing works anywhere; creating one without a process group is a clear error."""
    from fabric_lib import all_to_all

    assert all_to_all.ERR_TIMEOUT == 1
    archs = all_to_all.AllToAll.kernel_archs()
    assert archs == "" or "sm_90a" in archs
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialized")
    with pytest.raises(InvalidArgumentError, match="process group"):
        all_to_all.AllToAll(max_num_tokens=8, hidden=128, num_experts=8, experts_per_token=2)
