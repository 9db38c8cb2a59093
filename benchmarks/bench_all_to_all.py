"""MoE dispatch/combine latency: fabric_lib.all_to_all (NVLink + RDMA) against torch.distributed + NCCL.

    python -m benchmarks.bench_all_to_all                      # every GPU of this host, decode defaults
    python -m benchmarks.bench_all_to_all --world-size 4 --tokens 128 4096 --dispatch-dtype fp8 bf16
    # several nodes (run on each; drop --nvlink to send everything over RDMA):
    python -m benchmarks.bench_all_to_all --world-size $((NUM_NODES * 8)) --nets-per-gpu 2 \\
        --init-method=tcp://$MASTER_IP:29500 --node-rank=$NODE_RANK --nvlink=8
    # one host standing in for 2 nodes of 2 ranks each, everything through the engine over tcp:
    python -m benchmarks.bench_all_to_all --world-size 4 --procs-per-node 2 --nvlink 1 \\
        --init-method tcp://127.0.0.1:29500 --node-rank 0 --provider tcp &
    python -m benchmarks.bench_all_to_all --world-size 4 --procs-per-node 2 --nvlink 1 \\
        --init-method tcp://127.0.0.1:29500 --node-rank 1 --provider tcp

Launched once, it spawns ``--world-size`` processes (one per GPU); under torchrun (RANK and
WORLD_SIZE set) it runs as that rank. For every (tokens, dispatch dtype) it measures, per
iteration and as the slowest rank's time (CUDA events; the GPUs are lined up by an all-reduce
behind a sleep kernel, so host launch overhead is not counted):

- ``dispatch`` / ``combine``: both halves in one call (the default: one fused kernel over NVLink
  alone, the halves' two kernels back to back with remote ranks); with remote ranks also
  ``dispatch_fused`` / ``combine_fused``, the fused kernel forced (``fused=True``);
- ``dispatch_send`` + ``dispatch_recv`` / ``combine_send`` + ``combine_recv``: the halves with a
  matmul between them (what remains of the transfer once other work overlapped it);
- ``nccl_dispatch`` / ``nccl_combine``: the same routing (each token once per destination rank)
  through a counts exchange and an uneven ``all_to_all_single`` (host sync for the split sizes),
  combine as the reverse ``all_to_all_single`` plus an fp32 ``index_add_``.

``--sweep D:C[:TMA] ...`` also times fused calls of prefill-sized configs with D / C sending warps
per block (and the bulk copy engine on or off for dispatch): ``dispatch@SPEC`` / ``combine@SPEC``,
each object also passing the combine spot check (``max_combine_error``).

With remote ranks (``--nvlink`` below the world size) it also reports the proxy's own costs, as
the proxy recorded them per call (``proxy`` in the JSON): counts published → first count message
posted, records packed → first data write posted, time to post per remote rank, writes per
remote rank per call, counts published → every remote source's records arrived (for each kind of
call apart); and the host time of each ``dispatch`` / ``combine`` call (app call →
kernel enqueued, ``host_call``).

Launched with ``--init-method`` / ``--node-rank`` it starts this node's ``--procs-per-node``
ranks (default: one per GPU; more stand in for several nodes on one GPU, over gloo since NCCL
refuses two ranks on one GPU: no NCCL baseline then). p50 and p99 go to stdout and JSON
(``--out``), and a PNG next to it when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fabric_lib.testing import gather, init_process_group, spawn_ranks, this_rank

from benchmarks.report import write_result

SLEEP_CYCLES = 600_000  # ~300 us at 1.98 GHz: the host enqueues one iteration meanwhile
DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=None, help="ranks (default: every GPU of this host)")
    p.add_argument(
        "--nets-per-gpu", type=int, default=1, help="NICs (engine domains) per GPU for remote ranks"
    )
    p.add_argument(
        "--init-method", default=None, help="torch.distributed init method (default: tcp on localhost)"
    )
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (several nodes)")
    p.add_argument(
        "--procs-per-node", type=int, default=None, help="ranks this node starts (default: one per GPU)"
    )
    p.add_argument(
        "--provider", default=None, help="libfabric provider of the engine (default: RDMA NIC, else tcp)"
    )
    p.add_argument(
        "--private-tokens", type=int, default=None, help="speculative records per remote pair (default: all)"
    )
    p.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="TransferEngine option (e.g. gpu_network=true for shm of a CUDA libfabric); repeatable",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for the whole run")
    p.add_argument(
        "--nvlink",
        type=int,
        default=None,
        help="ranks per NVLink domain (default: the world size on one host, 1 with --init-method: "
        "everything over RDMA)",
    )
    p.add_argument(
        "--proxy",
        choices=["worker", "thread"],
        default="worker",
        help="which thread runs each rank's proxy: the engine's worker (default) or one of its own "
        "(AllToAll's proxy=)",
    )
    p.add_argument(
        "--tokens", type=int, nargs="+", default=[128], help="tokens per rank (several: one run each)"
    )
    p.add_argument("--hidden", type=int, default=7168, help="token width (elements)")
    p.add_argument("--experts", type=int, default=256, help="experts, spread evenly over the ranks")
    p.add_argument("--topk", type=int, default=8, help="experts each token is routed to")
    p.add_argument(
        "--dispatch-dtype",
        nargs="+",
        choices=sorted(DTYPES),
        default=["fp8"],
        help="dispatched token format (several: one run each; fp8 carries a scale per 128 values)",
    )
    p.add_argument("--combine-dtype", choices=["bf16"], default="bf16", help="combined token format")
    p.add_argument("--max-tokens-per-expert", type=int, default=None, help="default: 2x the uniform mean")
    p.add_argument("--iters", type=int, default=200, help="timed iterations per configuration")
    p.add_argument("--warmup", type=int, default=20, help="untimed iterations first")
    p.add_argument("--no-nccl", action="store_true", help="skip the NCCL baseline")
    p.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="process group: nccl, unless this node's ranks share a GPU (then gloo; NCCL refuses "
        "two ranks on one GPU); gloo also where several --node-rank processes share one GPU",
    )
    p.add_argument(
        "--sweep",
        nargs="*",
        default=[],
        metavar="D:C[:TMA]",
        help="also time fused dispatch / combine with D / C sending warps per block (1..16; the "
        "others receive meanwhile) and the bulk copy engine on (1) or off (0) for dispatch (an empty "
        "field keeps the default), for configs of at least --sweep-min-tokens tokens (results: "
        "dispatch@SPEC, combine@SPEC)",
    )
    p.add_argument("--sweep-min-tokens", type=int, default=1024, help="smallest token count --sweep times")
    p.add_argument("--sweep-iters", type=int, default=60, help="timed iterations per --sweep config")
    p.add_argument(
        "--out", default="bench-results/bench_all_to_all.json", help="result file (JSON with the run header)"
    )
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------- timing


class Timer:
    """Per-iteration segments timed with CUDA events, the GPUs lined up before each phase."""

    def __init__(self) -> None:
        self.line = torch.zeros(1, device="cuda")
        self.marks: list[list[torch.cuda.Event]] = []

    def align(self) -> None:
        # The collective below may stage through host memory: wait for the calls of the previous
        # phase first (with shm and GPU buffers a host copy must not wait behind a call in flight;
        # docs/all_to_all_rdma.md, Limits). The phases are timed by events, so this costs nothing.
        torch.cuda.current_stream().synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        dist.all_reduce(self.line)

    def phase(self, fns: list[Any]) -> None:
        self.align()
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(len(fns) + 1)]
        evs[0].record()
        for fn, ev in zip(fns, evs[1:], strict=True):
            fn()
            ev.record()
        self.marks.append(evs)

    def segments_us(self) -> list[list[float]]:
        torch.cuda.synchronize()
        out = [[1000.0 * a.elapsed_time(b) for a, b in itertools.pairwise(evs)] for evs in self.marks]
        self.marks = []
        return out


def percentiles(xs: list[float]) -> dict[str, float]:
    t = torch.tensor(xs, dtype=torch.float64)
    return {
        "p50": round(float(t.quantile(0.5)), 2),
        "p99": round(float(t.quantile(0.99)), 2),
        "mean": round(float(t.mean()), 2),
    }


# ------------------------------------------------------------------------------------- workload


def make_inputs(T: int, H: int, E: int, K: int, dtype: Any, seed: int) -> tuple[Any, Any, Any, Any]:
    g = torch.Generator().manual_seed(seed)
    xf = torch.randn(T, H, generator=g).cuda()
    idx = torch.rand(T, E, generator=g).topk(K, dim=-1).indices.cuda()
    w = torch.rand(T, K, generator=g).softmax(-1).cuda()
    if dtype == torch.bfloat16:
        return xf.bfloat16(), None, idx, w
    blocks = xf.view(T, H // 128, 128)
    scales = (blocks.abs().amax(-1).clamp(min=1e-4) / 448.0).contiguous()
    q = (blocks / scales[..., None]).to(torch.float8_e4m3fn).view(T, H)
    return q, scales, idx, w


class NcclAllToAll:
    """The same routing with torch.distributed: one row per (token, destination rank)."""

    def __init__(self, world: int, local_experts: int) -> None:
        self.world, self.L = world, local_experts

    def dispatch(self, x: Any, scales: Any, idx: Any) -> Any:
        T = x.shape[0]
        valid = idx >= 0
        dst = torch.where(valid, idx // self.L, torch.zeros_like(idx))
        hits = torch.zeros((T, self.world), dtype=torch.int32, device=x.device)
        hits.scatter_add_(1, dst, valid.to(torch.int32))
        mask = hits > 0
        _, t_idx = mask.t().nonzero(as_tuple=True)
        parts = [x.view(torch.uint8)]
        if scales is not None:
            parts.append(scales.view(torch.uint8))
        parts.append(idx.to(torch.int32).view(torch.uint8))
        packed = torch.cat(parts, dim=1)[t_idx]
        send_counts = mask.sum(0)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts)
        in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()
        recv = torch.empty((sum(out_splits), packed.shape[1]), dtype=torch.uint8, device=x.device)
        dist.all_to_all_single(recv, packed, out_splits, in_splits)
        return recv, (t_idx, in_splits, out_splits, T)

    def combine(self, expert_rows: Any, state: Any) -> Any:
        t_idx, in_splits, out_splits, T = state
        back = torch.empty(
            (t_idx.shape[0], expert_rows.shape[1]), dtype=expert_rows.dtype, device=expert_rows.device
        )
        dist.all_to_all_single(back, expert_rows, in_splits, out_splits)
        out = torch.zeros((T, expert_rows.shape[1]), dtype=torch.float32, device=expert_rows.device)
        out.index_add_(0, t_idx, back.float())
        return out.bfloat16()


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--engine-option NAME=VALUE`` as typed values (true/false, ints, floats, else strings)."""
    out: dict[str, Any] = {"poll_mode": "busy"}
    for item in args.engine_option:
        name, _, text = item.partition("=")
        value: Any = text
        if text.lower() in ("true", "false"):
            value = text.lower() == "true"
        else:
            for kind in (int, float):
                try:
                    value = kind(text)
                    break
                except ValueError:
                    pass
        out[name] = value
    return out


def remote_kwargs(args: argparse.Namespace, world: int) -> dict[str, Any]:
    """The AllToAll arguments of the node layout (nothing when every rank is over NVLink)."""
    if args.nvlink >= world:
        return {}
    return {
        "nvlink": args.nvlink,
        "nets_per_gpu": args.nets_per_gpu,
        "provider": args.provider,
        "private_tokens": args.private_tokens,
        "engine_options": engine_options(args),
        "proxy": args.proxy,
    }


def proxy_summary(calls: dict[str, Any]) -> dict[str, Any]:
    """The proxy's recorded costs (see the module documentation) by kind of call ("halves": both
    halves' kernels back to back, "fused", "split": halves around a matmul; ``a2a.proxy_stats()``
    after each), with the dispatch's total (counts seen -> every remote source's records arrived)
    for each kind apart."""
    d = [x for dc in calls.values() for x in dc[0]]
    c = [x for dc in calls.values() for x in dc[1]]
    if not d:
        return {}

    def us(xs: list[dict[str, int]], key: str) -> dict[str, float]:
        return percentiles([x[key] / 1000.0 for x in xs])

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 3) if xs else 0.0

    out: dict[str, Any] = {
        "dispatch_calls": len(d),
        "counts_signal_to_first_write_us": us(d, "counts_signal_to_first_write_ns"),
        "dispatch_signal_to_first_write_us": us(d, "signal_to_first_write_ns"),
        "dispatch_post_per_peer_us": us(d, "post_per_peer_ns"),
        "dispatch_proxy_total_us": us(d, "total_ns"),
        **{f"dispatch_proxy_total_{kind}_us": us(dc[0], "total_ns") for kind, dc in calls.items() if dc[0]},
        "dispatch_data_writes_per_peer": mean([x["data_writes"] / max(1, x["remote_peers"]) for x in d]),
        "count_messages_per_call": mean([float(x["count_writes"]) for x in d]),
    }
    if c:
        out.update(
            {
                "combine_calls": len(c),
                "combine_signal_to_first_write_us": us(c, "signal_to_first_write_ns"),
                "combine_post_per_peer_us": us(c, "post_per_peer_ns"),
                "combine_writes_per_peer": mean([x["writes"] / max(1, x["remote_peers"]) for x in c]),
            }
        )
    return out


def bench_config(args: argparse.Namespace, T: int, dtype_name: str, rank: int, world: int) -> dict[str, Any]:
    from fabric_lib.all_to_all import AllToAll

    H, E, K = args.hidden, args.experts, args.topk
    dtype = DTYPES[dtype_name]
    L = E // world
    rows = args.max_tokens_per_expert or min(world * T, max(128, 2 * T * world * K // E))
    x, scales, idx, w = make_inputs(T, H, E, K, dtype, seed=1000 + rank)
    # Correctness spot check of the benchmarked shapes: combine of "identity experts" = x * sum(w).
    ref = x.float() if scales is None else (x.float().view(T, H // 128, 128) * scales[..., None]).view(T, H)
    ref = ref * w.sum(-1, keepdim=True)

    def combine_error(a2a: Any) -> float:
        out = a2a.dispatch(x, idx, scales=scales)
        # Host-side work below may copy to pageable memory; with shm and GPU buffers that must not
        # happen while a call is in flight (docs/all_to_all_rdma.md, Limits).
        torch.cuda.current_stream().synchronize()
        xf = out.x.float()
        if out.scales is not None:
            xf = xf * out.scales.repeat_interleave(128, dim=-1)
        got = a2a.combine(xf.bfloat16(), idx, w)
        a2a.check()
        return float(((got.float() - ref).abs() - 2e-2 * ref.abs()).amax()) if T else 0.0

    new_all_to_all = functools.partial(
        AllToAll,
        max_num_tokens=T,
        hidden=H,
        num_experts=E,
        experts_per_token=K,
        dispatch_dtype=dtype,
        max_tokens_per_expert=rows,
        **remote_kwargs(args, world),
    )
    a2a = new_all_to_all()
    side = torch.cuda.Stream() if args.provider == "shm" else None  # shm copies on the default stream
    if side is not None:
        torch.cuda.set_stream(side)
    a2a.proxy_stats()  # start counting here
    host: dict[str, list[float]] = {}

    def on_host(name: str, fn: Any) -> Any:
        """Times the call on the host: app call -> kernel enqueued."""
        t0 = time.perf_counter_ns()
        out = fn()
        host.setdefault(name, []).append((time.perf_counter_ns() - t0) / 1000.0)
        return out

    expert_out = torch.randn((L, rows, H), device="cuda").bfloat16()
    work_a = torch.randn((2048, 4096), device="cuda").bfloat16()
    work_b = torch.randn((4096, 4096), device="cuda").bfloat16()
    timer = Timer()
    seg: dict[str, list[float]] = {}

    def record(names: list[str]) -> None:
        for it in timer.segments_us()[args.warmup :]:
            for name, v in zip(names, it, strict=True):
                if name:
                    seg.setdefault(name, []).append(v)

    # Both halves in one call: the default (with remote ranks: the halves' kernels back to back),
    # then, with remote ranks, the fused kernel forced, for comparison in the same run.
    default_fused = a2a.fused
    calls: dict[str, Any] = {}
    for suffix, fused in [("", default_fused)] + ([("_fused", True)] if not default_fused else []):
        a2a.fused = fused
        for _ in range(args.warmup + args.iters):
            timer.phase([lambda: on_host("dispatch" + suffix, lambda: a2a.dispatch(x, idx, scales=scales))])
        record(["dispatch" + suffix])
        for _ in range(args.warmup + args.iters):
            timer.phase([lambda: on_host("combine" + suffix, lambda: a2a.combine(expert_out, idx, w))])
        record(["combine" + suffix])
        calls["fused" if fused else "halves"] = a2a.proxy_stats()
    a2a.fused = default_fused
    # Halves split around a matmul.
    for _ in range(args.warmup + args.iters):
        timer.phase(
            [
                lambda: a2a.dispatch(x, idx, scales=scales, do_recv=False),
                lambda: work_a @ work_b,
                lambda: a2a.dispatch(do_send=False),
            ]
        )
    record(["dispatch_send", "work", "dispatch_recv"])
    for _ in range(args.warmup + args.iters):
        timer.phase(
            [
                lambda: a2a.combine(expert_out, idx, w, do_recv=False),
                lambda: work_a @ work_b,
                lambda: a2a.combine(None, idx, None, do_send=False),
            ]
        )
    record(["combine_send", "work", "combine_recv"])
    a2a.check()
    calls["split"] = a2a.proxy_stats()
    proxy = proxy_summary(calls)
    max_err = combine_error(a2a)
    a2a.destroy()

    # Sending warps per block of fused calls (read from the environment when the object is made).
    for spec in args.sweep if T >= args.sweep_min_tokens else []:
        names = ["FABRIC_A2A_DISPATCH_SEND_WARPS", "FABRIC_A2A_COMBINE_SEND_WARPS", "FABRIC_A2A_TMA"]
        env = {k: v for k, v in zip(names, spec.split(":"), strict=False) if v}
        os.environ.update(env)
        try:
            sw = new_all_to_all()
        finally:
            for k in env:
                del os.environ[k]
        for _ in range(args.warmup + args.sweep_iters):
            timer.phase([lambda: sw.dispatch(x, idx, scales=scales)])
        record([f"dispatch@{spec}"])
        for _ in range(args.warmup + args.sweep_iters):
            timer.phase([lambda: sw.combine(expert_out, idx, w)])
        record([f"combine@{spec}"])
        sw.check()
        max_err = max(max_err, combine_error(sw))
        sw.destroy()

    if side is not None:
        torch.cuda.set_stream(torch.cuda.default_stream())
    if not args.no_nccl and dist.get_backend() == "nccl":
        nccl = NcclAllToAll(world, L)
        recv, state = nccl.dispatch(x, scales, idx)
        rows_back = torch.randn((recv.shape[0], H), device="cuda").bfloat16()
        for _ in range(args.warmup + args.iters):
            timer.phase([lambda: nccl.dispatch(x, scales, idx)])
        record(["nccl_dispatch"])
        for _ in range(args.warmup + args.iters):
            timer.phase([lambda: nccl.combine(rows_back, state)])
        record(["nccl_combine"])

    # Slowest rank per iteration.
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, seg)
    worst = {k: [max(g[k][i] for g in gathered) for i in range(len(seg[k]))] for k in seg}
    errs: list[Any] = [None] * world
    dist.all_gather_object(errs, max_err)
    proxies: list[Any] = [None] * world
    dist.all_gather_object(proxies, proxy)
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, {k: percentiles(v[args.warmup :]) for k, v in host.items()})
    stats = {k: percentiles(v) for k, v in worst.items()}
    for k in ("dispatch", "combine"):
        send, recv = worst[f"{k}_send"], worst[f"{k}_recv"]
        stats[f"{k}_split_total"] = percentiles([a + b for a, b in zip(send, recv, strict=True)])
    return {
        "tokens": T,
        "hidden": H,
        "experts": E,
        "topk": K,
        "dispatch_dtype": dtype_name,
        "combine_dtype": args.combine_dtype,
        "world_size": world,
        "max_tokens_per_expert": rows,
        "iters": args.iters,
        "max_combine_error": max(errs),
        "latency_us": stats,
        "nvlink": args.nvlink,
        "proxy_runner": args.proxy,
        "host_call_us": hosts,  # per rank: dispatch() / combine() on the host (app call -> enqueue)
        "proxy": proxies,  # per rank: the proxy's own costs (empty without remote ranks)
    }


def worker(_state: None, args: argparse.Namespace) -> None:
    """One rank (a launched one, or one of torchrun's): every configuration, rank 0 reports."""
    me = this_rank()
    info = replace(me, init_method=args.init_method or me.init_method)
    if args.shared_gpu:
        # Several ranks per GPU (standing in for nodes): NCCL refuses them, gloo carries the group.
        torch.cuda.set_device(me.local_rank % torch.cuda.device_count())
        init_process_group("gloo", timeout=300, info=info)
    else:
        init_process_group("nccl", timeout=300, info=info)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.nvlink is None:
        args.nvlink = world if args.init_method is None else 1
    results = []
    for T in args.tokens:
        for dt in args.dispatch_dtype:
            t0 = time.monotonic()
            res = bench_config(args, T, dt, rank, world)
            results.append(res)
            if rank == 0:
                s = res["latency_us"]
                line = (
                    f"EP{world} T={T} {dt}: dispatch p50 {s['dispatch']['p50']} p99 {s['dispatch']['p99']} | "
                    f"combine p50 {s['combine']['p50']} p99 {s['combine']['p99']} | "
                    f"split d {s['dispatch_send']['p50']}+{s['dispatch_recv']['p50']} "
                    f"c {s['combine_send']['p50']}+{s['combine_recv']['p50']}"
                )
                if "nccl_dispatch" in s:
                    line += f" | NCCL {s['nccl_dispatch']['p50']} / {s['nccl_combine']['p50']}"
                px = res["proxy"][0]
                if px:
                    line += (
                        f" | proxy: counts->1st write {px['counts_signal_to_first_write_us']['p50']} us, "
                        f"packed->1st write {px['dispatch_signal_to_first_write_us']['p50']} us, "
                        f"post/peer {px['dispatch_post_per_peer_us']['p50']} us, "
                        f"writes/peer {px['dispatch_data_writes_per_peer']} (+1 counts) / "
                        f"{px.get('combine_writes_per_peer', 0)}, "
                        f"host call {res['host_call_us'][0]['dispatch']['p50']} us, "
                        "counts->records "
                        + ", ".join(
                            f"{k.removeprefix('dispatch_proxy_total_').removesuffix('_us')} {v['p50']}"
                            for k, v in px.items()
                            if k.startswith("dispatch_proxy_total_") and k != "dispatch_proxy_total_us"
                        )
                        + " us"
                    )
                if "dispatch_fused" in s:
                    line += f" | fused kernel {s['dispatch_fused']['p50']} / {s['combine_fused']['p50']}"
                sweep = [f"{k} {v['p50']}" for k, v in s.items() if "@" in k]
                if sweep:
                    line += " | sweep " + ", ".join(sweep)
                print(
                    f"{line}  (err {res['max_combine_error']:.3g}, {time.monotonic() - t0:.1f}s)", flush=True
                )
    if rank == 0:
        report = {
            "device": torch.cuda.get_device_name(),
            "world_size": world,
            "nets_per_gpu": args.nets_per_gpu,
            "nvlink": args.nvlink,
            "results": results,
        }
        out = Path(args.out)
        write_result(out, "bench_all_to_all", None, vars(args), report)  # the shared result format
        plot(report, out.with_suffix(".png"))
    dist.barrier()
    dist.destroy_process_group()


def plot(report: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (the JSON has every number)")
        return
    kinds = [
        "dispatch",
        "combine",
        "dispatch_fused",
        "combine_fused",
        "dispatch_split_total",
        "combine_split_total",
        "nccl_dispatch",
        "nccl_combine",
    ]
    fig, axes = plt.subplots(
        1, len(report["results"]), figsize=(5 * len(report["results"]), 4), squeeze=False
    )
    for ax, res in zip(axes[0], report["results"], strict=True):
        s = res["latency_us"]
        names = [k for k in kinds if k in s]
        p50 = [s[k]["p50"] for k in names]
        p99 = [s[k]["p99"] for k in names]
        pos = range(len(names))
        ax.bar(pos, p50, color=["tab:blue" if not k.startswith("nccl") else "tab:gray" for k in names])
        ax.scatter(pos, p99, color="black", marker="_", s=200, label="p99")
        ax.set_xticks(list(pos), [n.replace("_", "\n") for n in names], fontsize=7)
        ax.set_ylabel("µs (slowest rank)")
        ax.set_title(f"EP{res['world_size']} {res['tokens']} tok {res['dispatch_dtype']}")
        ax.legend()
    fig.suptitle(f"MoE all-to-all on {report['device']}: p50 bars, p99 ticks")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def _node_rank(env: dict[str, str], args: argparse.Namespace) -> None:
    """One rank of this node (spawned): the torchrun-style environment, then the worker."""
    os.environ.update(env)
    worker(None, args)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.shared_gpu = args.backend == "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        worker(None, args)  # under torchrun: this process is one rank
        return
    gpus = torch.cuda.device_count()
    if args.node_rank is None:
        world = args.world_size or gpus
        if world < 1 or world > gpus:
            sys.exit(f"--world-size {world} needs that many GPUs on this host (found {gpus})")
        with spawn_ranks(world, init_method=args.init_method, timeout=300) as ranks:
            gather(ranks.submit_all(worker, args), timeout=args.timeout)
        return
    # One node of several: start this node's ranks.
    if args.init_method is None or args.world_size is None:
        sys.exit("--node-rank needs --init-method and --world-size")
    per_node = args.procs_per_node or gpus
    if per_node < 1 or args.world_size % per_node:
        sys.exit(f"--world-size {args.world_size} must be a multiple of the ranks per node ({per_node})")
    args.shared_gpu = per_node > gpus or args.backend == "gloo"
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = []
    for i in range(per_node):
        env = {
            "RANK": str(args.node_rank * per_node + i),
            "WORLD_SIZE": str(args.world_size),
            "LOCAL_RANK": str(i),
        }
        proc = ctx.Process(target=_node_rank, args=(env, args), name=f"rank{env['RANK']}")
        proc.start()
        procs.append(proc)
    deadline = time.monotonic() + args.timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    failed = [p.name for p in procs if p.exitcode != 0]
    for p in procs:
        if p.exitcode is None:
            p.kill()
    if failed:
        sys.exit(f"ranks failed or timed out: {failed}")


if __name__ == "__main__":
    main()
