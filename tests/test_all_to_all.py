"""fabric_lib.all_to_all against a pure-torch reference, on 2 and 4 GPUs of one host.

One set of worker processes per world size runs every scenario (CUDA and NCCL start-up is paid
once); each scenario's outcome per rank is written to a JSON file that the tests read. Needs
``world_size`` CUDA GPUs with peer-to-peer access; skips with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import fabric_lib
from fabric_lib.distributed import rendezvous_port
from fabric_lib.errors import FabricTimeoutError, InvalidArgumentError

HIDDEN = 512
TOPK = 4
MAX_TOKENS = 96
WORKER_TIMEOUT_S = int(os.environ.get("A2A_TEST_TIMEOUT", "420"))

SCENARIOS = [
    "uniform_bf16",
    "uniform_fp8",
    "skewed_bf16",
    "skewed_fp8",
    "empty_rank",
    "fewer_tokens",
    "device_num_tokens",
    "split_halves",
    "unfused",
    "streaming",
    "wide_rows",
    "consecutive",
    "dispatch_only_loop",
    "cuda_graph",
    "host_counts",
    "bad_input",
    "device_errors",
    "call_order",
    "peer_timeout",
]


def _gpu_count() -> int:
    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA counts as none
        return 0


# ------------------------------------------------------------------------------------ reference


def make_tokens(T: int, dtype: Any, gen: Any, device: Any, hidden: int = HIDDEN) -> tuple[Any, Any, Any]:
    """(x, scales or None, dequantized fp32 x) with fp8 scales per 128 values."""
    xf = torch.randn(T, hidden, generator=gen).to(device)
    if dtype == torch.bfloat16:
        x = xf.bfloat16()
        return x, None, x.float()
    blocks = xf.view(T, hidden // 128, 128)
    scales = (blocks.abs().amax(-1).clamp(min=1e-4) / 448.0).contiguous()
    q = (blocks / scales[..., None]).to(torch.float8_e4m3fn).view(T, hidden)
    deq = (q.float().view(T, hidden // 128, 128) * scales[..., None]).view(T, hidden)
    return q, scales, deq


def make_routing(kind: str, T: int, E: int, gen: Any, device: Any) -> tuple[Any, Any]:
    if kind == "skewed":
        idx = torch.arange(TOPK, dtype=torch.int64).expand(T, TOPK).contiguous()
    else:
        idx = torch.rand(T, E, generator=gen).topk(TOPK, dim=-1).indices
        if kind == "masked":
            drop = torch.rand(T, TOPK, generator=gen) < 0.15
            idx = torch.where(drop, torch.full_like(idx, -1), idx)
    weights = torch.rand(T, TOPK, generator=gen).softmax(-1)
    return idx.to(device), weights.to(device)


def coef(E: int, device: Any) -> Any:
    return 1.0 + torch.arange(E, device=device, dtype=torch.float32) / E


def run_experts(a2a: Any, out: Any) -> Any:
    """The 'experts': expert e multiplies its (dequantized) rows by coef[e]."""
    L, r = a2a.local_experts, a2a.rank
    xf = out.x.float()
    if out.scales is not None:
        xf = xf * out.scales.repeat_interleave(128, dim=-1)
    c = coef(a2a.num_experts, xf.device)[r * L : (r + 1) * L]
    return (xf * c[:, None, None]).nan_to_num().bfloat16()


def expected_combine(deq: Any, idx: Any, w: Any, E: int, T_live: int) -> Any:
    c = coef(E, deq.device)
    valid = idx >= 0
    factor = (w * c[idx.clamp(min=0)] * valid).sum(-1)
    out = deq * factor[:, None]
    out[T_live:] = 0
    return out


def check_combine(got: Any, deq: Any, idx: Any, w: Any, E: int, T_live: int) -> None:
    want = expected_combine(deq, idx, w, E, T_live)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=3e-2)


def check_dispatch(a2a: Any, out: Any, x: Any, scales: Any, idx: Any, T_live: int) -> None:
    """Gathers every rank's inputs and compares the expert-major layout bit for bit."""
    import torch.distributed as dist

    W, L, K, Tm = a2a.world_size, a2a.local_experts, a2a.experts_per_token, a2a.max_num_tokens
    dev = a2a.device
    xb = (
        x.view(torch.uint8)
        if x.numel()
        else torch.empty((0, a2a.hidden * x.element_size()), dtype=torch.uint8, device=dev)
    )
    row_bytes = xb.shape[1]
    px = torch.zeros((Tm, row_bytes), dtype=torch.uint8, device=dev)
    px[:T_live] = xb[:T_live]
    pi = torch.full((Tm, K), -1, dtype=torch.int64, device=dev)
    pi[:T_live] = idx[:T_live].long()
    ns = a2a.num_scales
    ps = torch.zeros((Tm, max(ns, 1)), dtype=torch.float32, device=dev)
    if ns:
        ps[:T_live] = scales[:T_live]
    gx = [torch.empty_like(px) for _ in range(W)]
    gi = [torch.empty_like(pi) for _ in range(W)]
    gs = [torch.empty_like(ps) for _ in range(W)]
    dist.all_gather(gx, px)
    dist.all_gather(gi, pi)
    dist.all_gather(gs, ps)
    counts = out.counts.cpu().tolist()
    for el in range(L):
        e = a2a.rank * L + el
        rows, srows = [], []
        for s in range(W):
            tt, _ = (gi[s] == e).nonzero(as_tuple=True)
            rows.append(gx[s][tt])
            srows.append(gs[s][tt])
        want = torch.cat(rows)
        n = want.shape[0]
        assert counts[el] == n, f"expert {e}: {counts[el]} rows, expected {n}"
        got = out.x[el, :n].view(torch.uint8).reshape(n, row_bytes)
        assert torch.equal(got, want), f"expert {e}: rows differ"
        if ns:
            assert torch.equal(out.scales[el, :n], torch.cat(srows)[:, :ns]), f"expert {e}: scales differ"


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


def sc_routings(dtype: Any, *routings: str) -> Any:
    """Round trips of MAX_TOKENS tokens with each routing in turn, on one object."""

    def run(gen: Any) -> None:
        a2a = new_a2a(dtype)
        for routing in routings:
            round_trip(a2a, routing, MAX_TOKENS, gen)
        a2a.destroy()

    return run


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


RUNNERS = {
    "uniform_bf16": sc_routings(torch.bfloat16, "masked", "uniform"),
    "uniform_fp8": sc_routings(torch.float8_e4m3fn, "masked", "uniform"),
    "skewed_bf16": sc_routings(torch.bfloat16, "skewed", "uniform"),
    "skewed_fp8": sc_routings(torch.float8_e4m3fn, "skewed", "uniform"),
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
assert list(RUNNERS) == SCENARIOS


def _worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import datetime

    import torch.distributed as dist

    for k, v in {
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
    }.items():
        os.environ.setdefault(k, v)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl",
        init_method=init_method,
        rank=rank,
        world_size=world,
        device_id=dev,
        timeout=datetime.timedelta(seconds=120),
    )
    results: dict[str, str] = {}
    path = os.path.join(out_dir, f"rank{rank}.json")
    only = os.environ.get("A2A_TEST_ONLY")
    for name in SCENARIOS:
        if only and name not in only.split(","):
            continue
        gen = torch.Generator().manual_seed(1234 + 7919 * rank + sum(map(ord, name)))
        t0 = time.monotonic()
        try:
            RUNNERS[name](gen)
            results[name] = "ok"
        except BaseException:  # noqa: BLE001 - reported to the parent test
            results[name] = traceback.format_exc()
        results[name + ".seconds"] = f"{time.monotonic() - t0:.2f}"
        with open(path, "w") as f:
            json.dump(results, f)
        torch.cuda.synchronize()
        dist.barrier()
    dist.destroy_process_group()


_cache: dict[int, dict[int, dict[str, str]]] = {}


def _run_world(world: int) -> dict[int, dict[str, str]]:
    if world in _cache:
        return _cache[world]
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out_dir = tempfile.mkdtemp(prefix=f"a2a-test-{world}-")
    init = f"tcp://127.0.0.1:{rendezvous_port()}"
    procs = [ctx.Process(target=_worker, args=(r, world, init, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results: dict[int, dict[str, str]] = {}
    for r, p in enumerate(procs):
        try:
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                results[r] = json.load(f)
        except FileNotFoundError:
            results[r] = {}
        results[r]["exitcode"] = str(p.exitcode)
    _cache[world] = results
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}gpu")
def world_results(request: pytest.FixtureRequest) -> dict[int, dict[str, str]]:
    world = request.param
    found = _gpu_count()
    if found < world:
        pytest.skip(f"needs {world} CUDA GPUs on one host (found {found})")
    if not fabric_lib._rust.AllToAll.kernel_archs():
        pytest.skip("fabric_lib was built without nvcc: no all-to-all kernels")
    return _run_world(world)


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.timeout(WORKER_TIMEOUT_S + 60)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_all_to_all(world_results: dict[int, dict[str, str]], scenario: str) -> None:
    only = os.environ.get("A2A_TEST_ONLY")
    if only and scenario not in only.split(","):
        pytest.skip("not selected by A2A_TEST_ONLY")
    failures = []
    for rank, res in sorted(world_results.items()):
        outcome = res.get(scenario, f"did not run (worker exit code {res.get('exitcode')})")
        if outcome != "ok":
            failures.append(f"rank {rank}:\n{outcome}")
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
