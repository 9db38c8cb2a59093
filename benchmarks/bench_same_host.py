"""Same-host GPU transfers (CUDA IPC path) against a torch peer-copy baseline, on a GPU host.

    python -m benchmarks.bench_same_host [--src 0 --dst 1] [--json-out PATH] [--quick]

One process, two TransferEngines (provider tcp on loopback, busy polling): the writer owns a
buffer on GPU ``--src``, the receiver one on GPU ``--dst``. Every request carries an immediate and
a run ends when the receiver counted all of them (so the numbers include making the data visible
and the immediates' trip through the receiver's shared-memory inbox). Measured in the same run:

- single writes (>= 1 MiB) vs ``dst.copy_(src)`` across the GPUs (torch peer copy, copy engines,
  the baseline);
- paged writes of 2048 random pages, 64 KiB and 16 KiB, with the default 16-block copy kernel,
  against the peer copy of the same bytes;
- UVM watcher callback latency: a kernel waits on a GPU flag, then stores to a watcher; the CPU
  sets the flag and times until the Python callback ran, on the callback thread and with
  ``inline=True`` on the watcher thread. The headline figure chains the rounds (each callback
  sets the flag for the next one, so only the callback's thread runs Python); also reported with
  the main thread setting the flag and blocking on a condition (its Python between the two holds
  the GIL, which a callback arriving early must wait for). ``fabric-debug watcher`` measures a
  Rust reaction. Also reported: the same round trip with the CPU spinning on the word itself (no watcher thread, no callback), which bounds the
  part that is GPU signalling rather than watcher (published: 6.2 / 12.6 us p50/p99 in Rust,
  9.3 us p50 in Python).

Prints a table and writes the shared result format (``benchmarks/report.py``; default
``bench-results/bench_same_host.json``) with a plot of the single-write throughput beside it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Literal, cast

import fabric_lib
import fabric_lib.cuda as fcuda
import torch

from benchmarks.report import progress, write_result

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 60.0


WriteCompletion = Literal["auto", "delivery", "transmit"]


def _engine(write_completion: WriteCompletion = "auto") -> fabric_lib.TransferEngine:
    return fabric_lib.TransferEngine("tcp", "lo", transfer_timeout=TIMEOUT, write_completion=write_completion)


def _peer_copy_gbps(dst: torch.Tensor, src: torch.Tensor, iters: int, repeats: int = 3) -> float:
    """Best of `repeats` timed runs of `iters` torch peer copies (copy engines)."""
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(src.device)
    torch.cuda.synchronize(dst.device)
    best = 0.0
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)
        best = max(best, src.numel() * src.element_size() * iters / (time.perf_counter() - t0) / 1e9)
    return best


def _run_requests(recv: fabric_lib.TransferEngine, imm: int, iters: int, submit, repeats: int = 3) -> float:
    """Shortest of `repeats` runs of `iters` requests, each run ending when every imm arrived."""
    counter = recv.imm_counter(imm)
    for _ in range(2):  # warm-up
        submit()
    counter.wait(2, timeout=TIMEOUT)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        futures = [submit() for _ in range(iters)]
        counter.wait(iters, timeout=TIMEOUT)
        best = min(best, time.perf_counter() - t0)
        for f in futures:
            f.result(TIMEOUT)
    return best


def bench_single(w, r, src_dev: int, dst_dev: int, sizes: list[int], budget: int) -> list[dict]:
    rows = []
    for size in sizes:
        src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=f"cuda:{src_dev}")
        dst = torch.zeros(size, dtype=torch.uint8, device=f"cuda:{dst_dev}")
        rs, rd = w.register_tensor(src), r.register_tensor(dst)
        torch.cuda.synchronize()
        iters = max(5, min(200, budget // size))
        elapsed = _run_requests(
            r, 11, iters, lambda rs=rs, rd=rd, size=size: w.submit_write(rs, rd.descriptor, size, imm=11)
        )
        fab = size * iters / elapsed / 1e9
        torch.cuda.synchronize()
        assert torch.equal(dst[-4096:].cpu(), src[-4096:].cpu())
        base = _peer_copy_gbps(dst, src, iters)
        rows.append(
            {
                "kind": "single",
                "bytes": size,
                "iters": iters,
                "fabric_gbps": fab,
                "peer_copy_gbps": base,
                "ratio": fab / base,
            }
        )
        w.unregister_memory(rs)
        r.unregister_memory(rd)
        del src, dst
    return rows


def bench_paged(w, r, src_dev: int, dst_dev: int, page_lens: list[int], pages: int, iters: int) -> list[dict]:
    rows = []
    rng = random.Random(0)
    for page_len in page_lens:
        n = page_len * pages
        src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=f"cuda:{src_dev}")
        dst = torch.zeros(n, dtype=torch.uint8, device=f"cuda:{dst_dev}")
        rs, rd = w.register_tensor(src), r.register_tensor(dst)
        torch.cuda.synchronize()
        sp = list(range(pages))
        dp = list(range(pages))
        rng.shuffle(sp)
        rng.shuffle(dp)
        submit_t0 = time.perf_counter()
        for _ in range(20):
            fabric_lib.engine._page_list(sp)
        page_list_us = (time.perf_counter() - submit_t0) / 20 * 1e6
        elapsed = _run_requests(
            r,
            12,
            iters,
            lambda page_len=page_len, rs=rs, sp=sp, rd=rd, dp=dp: w.submit_paged_writes(
                page_len, rs, sp, rd.descriptor, dp, imm=12
            ),
        )
        fab = n * iters / elapsed / 1e9
        torch.cuda.synchronize()
        got = dst.view(pages, page_len)[dp[0]].cpu()
        assert torch.equal(got, src.view(pages, page_len)[sp[0]].cpu())
        base = _peer_copy_gbps(dst, src, iters)
        rows.append(
            {
                "kind": "paged",
                "page_bytes": page_len,
                "pages": pages,
                "iters": iters,
                "fabric_gbps": fab,
                "peer_copy_gbps": base,
                "ratio": fab / base,
                "blocks": 16,
                "us_per_request": elapsed / iters * 1e6,
                "page_list_conversion_us": page_list_us,
            }
        )
        w.unregister_memory(rs)
        r.unregister_memory(rd)
        del src, dst
    return rows


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _watcher_chain(stream, flag, watcher_ptr: int, first: int, n: int, stamps: list[int], done) -> None:
    """Queues ``n`` rounds (kernel waits for the flag, then stores to the watcher word); the
    caller's callback arms the next round by setting the flag, so no other thread needs the GIL
    while a round is in flight."""
    for i in range(n):
        stream.flag_poll(flag.ptr, first + i, timeout=10.0, slot=(first + i) % 1024)
        stream.write_u64(watcher_ptr, first + i)
    time.sleep(0.002)
    flag.set(first)  # the first round; the callback starts the others
    if not done.wait(timeout=30):
        raise RuntimeError(f"watcher chain stalled after {len(stamps)} callbacks")
    assert stream.synchronize(30)


def bench_watcher(engine, device: int, iterations: int, chunk: int = 200, inline: bool = False) -> dict:
    """Flag set by the CPU -> kernel sees it -> kernel stores i to the word -> seen on the CPU.
    ``inline``: the Python callback runs on the watcher thread (no hand-off).

    Two ways to drive it: the main thread sets the flag and blocks on a condition until the
    callback ran (the window between the two holds the GIL, which the callback then waits for),
    and a chain in which each callback sets the flag for the next round (only the callback's
    thread runs Python, so this is the callback's own latency)."""
    stream = fcuda.SignalStream(device)
    flag = engine.alloc_gpu_flag(device)
    stamps: dict[int, int] = {}
    cv = threading.Condition()
    chain: list[int] = []
    chain_end = [0]
    chain_done = threading.Event()
    mode = ["main"]

    def cb(old: int, new: int) -> None:
        t = time.perf_counter_ns()
        if mode[0] == "chain":
            chain.append(t)
            if new < chain_end[0]:
                flag.set(new + 1)
            else:
                chain_done.set()
            return
        with cv:
            stamps[new] = t
            cv.notify()

    watcher = engine.alloc_uvm_watcher(cb, device, inline=inline)
    direct = engine.alloc_gpu_flag(device)  # a plain word the CPU spins on (no watcher)
    via_watcher: list[float] = []
    spin: list[float] = []
    chained: list[float] = []
    value = 0
    for m in ("spin", "main", "chain"):
        mode[0] = m
        done = 0
        while done < iterations:
            n = min(chunk, iterations - done)
            if m == "chain":
                chain.clear()
                chain_done.clear()
                chain_end[0] = value + n
                _watcher_chain(stream, flag, watcher.ptr, value + 1, n, chain, chain_done)
                chained += [(b - a) / 1e3 for a, b in zip(chain, chain[1:])]
                value += n
                done += n
                continue
            target = watcher.ptr if m == "main" else direct.ptr
            for i in range(n):
                stream.flag_poll(flag.ptr, value + i + 1, timeout=10.0, slot=(value + i) % 1024)
                stream.write_u64(target, value + i + 1)
            time.sleep(0.002)
            for i in range(n):
                v = value + i + 1
                if m == "spin":
                    t0 = time.perf_counter_ns()
                    flag.set(v)
                    while direct.get() != v:
                        pass
                    spin.append((time.perf_counter_ns() - t0) / 1e3)
                else:
                    t0 = time.perf_counter_ns()
                    flag.set(v)
                    with cv:
                        if not cv.wait_for(lambda: v in stamps, timeout=10):  # called before v changes
                            raise RuntimeError(f"watcher callback for {v} never came")
                        via_watcher.append((stamps.pop(v) - t0) / 1e3)
            assert stream.synchronize(30)
            value += n
            done += n
    watcher.close()
    drop = min(50, iterations // 10)
    via_watcher, spin, chained = via_watcher[drop:], spin[drop:], chained[drop:]
    return {
        "kind": "uvm_watcher_inline" if inline else "uvm_watcher",
        "iterations": len(chained),
        "callback_rtt_p50_us": statistics.median(chained),
        "callback_rtt_p99_us": _pct(chained, 0.99),
        "main_thread_rtt_p50_us": statistics.median(via_watcher),
        "main_thread_rtt_p99_us": _pct(via_watcher, 0.99),
        "spin_rtt_p50_us": statistics.median(spin),
        "spin_rtt_p99_us": _pct(spin, 0.99),
        # CPU->GPU->CPU round trip minus the CPU->GPU half (~ half the spin round trip).
        "callback_latency_est_p50_us": statistics.median(chained) - statistics.median(spin) / 2,
        "callback_latency_est_p99_us": _pct(chained, 0.99) - statistics.median(spin) / 2,
        "published_p50_us": 6.2,
        "published_p99_us": 12.6,
        "published_python_p50_us": 9.3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=int, default=0, help="CUDA device of the writer's buffer")
    ap.add_argument(
        "--dst", type=int, default=1, help="CUDA device of the receiver's buffer (--src if absent)"
    )
    ap.add_argument(
        "--json-out",
        default=str(REPO / "bench-results" / "bench_same_host.json"),
        help="result file (a PNG plot is written beside it)",
    )
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    ap.add_argument("--watcher-only", action="store_true", help="only the UVM watcher latencies")
    ap.add_argument(
        "--write-completion",
        choices=("auto", "delivery", "transmit"),
        default="auto",
        help="the engines' write_completion (same-host immediates take the shared-memory inbox, so this "
        "only matters where the inbox is unavailable and they travel over tcp)",
    )
    args = ap.parse_args()
    n = fcuda.device_count()
    dst_dev = args.dst if args.dst < n else args.src
    sizes = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
    budget = 4 << 30
    pages, paged_iters, watch_iters = 2048, 20, 2000
    if args.quick:
        sizes, budget, paged_iters, watch_iters = [1 << 20, 16 << 20, 256 << 20], 2 << 30, 10, 500
    completion = cast(WriteCompletion, args.write_completion)
    w, r = _engine(completion), _engine(completion)
    results = {
        "device": torch.cuda.get_device_name(args.src),
        "src": args.src,
        "dst": dst_dev,
        "kernels": fcuda.kernels()[1],
        "rows": [],
    }
    try:
        phases = [
            lambda: bench_single(w, r, args.src, dst_dev, sizes, budget),
            lambda: bench_paged(w, r, args.src, dst_dev, [64 << 10, 16 << 10], pages, paged_iters),
            lambda: [bench_watcher(r, args.src, watch_iters, inline=inline) for inline in (False, True)],
        ]
        if args.watcher_only:
            phases = phases[-1:]
        for phase in progress(phases, desc="bench_same_host (single, paged, watcher)"):
            results["rows"] += phase()
    finally:
        w.stop()
        r.stop()
    print(f"same-host GPU{args.src} -> GPU{dst_dev} ({results['device']}), fabric-lib vs torch peer copy")
    print(f"{'what':<22}{'fabric GB/s':>12}{'peer GB/s':>11}{'ratio':>8}")
    for row in results["rows"]:
        if row["kind"] == "single":
            name = f"single {row['bytes'] >> 20} MiB"
        elif row["kind"] == "paged":
            name = f"paged {row['page_bytes'] >> 10} KiB x{row['pages']}"
        else:
            continue
        print(f"{name:<22}{row['fabric_gbps']:>12.1f}{row['peer_copy_gbps']:>11.1f}{row['ratio']:>8.2f}")
    for wrow in (row for row in results["rows"] if row["kind"].startswith("uvm_watcher")):
        where = "watcher thread" if wrow["kind"].endswith("inline") else "callback thread"
        print(
            f"UVM watcher (Python callback on the {where}): CPU flag -> GPU -> watcher -> callback round trip p50 "
            f"{wrow['callback_rtt_p50_us']:.1f} us, p99 {wrow['callback_rtt_p99_us']:.1f} us (callbacks chained; "
            f"driven by the main thread: p50 {wrow['main_thread_rtt_p50_us']:.1f} us, p99 "
            f"{wrow['main_thread_rtt_p99_us']:.1f} us); CPU spinning on the "
            f"word itself: p50 {wrow['spin_rtt_p50_us']:.1f} us, p99 {wrow['spin_rtt_p99_us']:.1f} us; estimated "
            f"GPU-write -> callback p50 {wrow['callback_latency_est_p50_us']:.1f} us, p99 "
            f"{wrow['callback_latency_est_p99_us']:.1f} us (published 6.2 / 12.6 us Rust, 9.3 us p50 Python)"
        )
    singles = [row for row in results["rows"] if row["kind"] == "single"]
    results["throughput"] = (
        {}
        if not singles
        else {
            "fabric-lib": [{"size": row["bytes"], "gbytes_per_s": row["fabric_gbps"]} for row in singles],
            "torch peer copy (baseline)": [
                {"size": row["bytes"], "gbytes_per_s": row["peer_copy_gbps"]} for row in singles
            ],
        }
    )
    write_result(Path(args.json_out), "bench_same_host", "tcp", vars(args), results)


if __name__ == "__main__":
    main()
