"""GPU -> GPU writes over the network path, against libfabric's own ``fi_rma_bw`` (FI_HMEM
providers) or against the engine's own host -> host writes (staged providers).

    python -m benchmarks.bench_gpu_network [--provider shm] [--sizes 1M,4M,16M,64M]
        [--fi-rma-bw PATH] [--json-out PATH]
    python -m benchmarks.bench_gpu_network --provider tcp [--sizes ...]

Two processes on this machine (one GPU is enough) talk through the provider as two hosts would
(``gpu_network=True, force_network=True``): the writer keeps ``--window`` writes with an
immediate in flight; a size's time runs from the first submit to the moment the receiver counted
every immediate. Needs a provider with FI_HMEM for CUDA (``shm`` of the libfabric that
``scripts/build_libfabric.sh`` builds, on ``LD_LIBRARY_PATH``). With ``--fi-rma-bw`` (the fabtest
of that libfabric) the same sizes and window run through ``fi_rma_bw -D cuda -o writedata`` too,
alternating rounds, and the table gives both and their ratio (medians over rounds).

On a provider without FI_HMEM (``tcp``) the GPU memory travels staged through host memory
(bounce buffers on the writer, the landing area on the receiver; docs/gpu.md): each round then
also writes the same sizes host -> host between the same two engines, and the ratio is staged
GPU -> GPU over host -> host. Every run adds paged GPU -> GPU writes of 64 KiB pages.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from fabric_lib.testing import spawn_ranks

from benchmarks.report import write_result

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 60.0


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


PAGE = 64 << 10
PAGES = 64  # per paged request: 4 MiB


class Receiver:
    """The receiving process: an engine, a GPU buffer and a host buffer."""

    def __init__(self, provider: str, nbytes: int) -> None:
        import fabric_lib

        self.engine = fabric_lib.TransferEngine(
            provider, gpu_network=True, force_network=True, transfer_timeout=TIMEOUT
        )
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.region = self.engine.register_tensor(self.buf)
        self.host = torch.empty(nbytes, dtype=torch.uint8)
        self.host_region = self.engine.register_tensor(self.host)

    def close(self) -> None:
        self.engine.stop()


def descriptors(rx: Receiver) -> tuple[bytes, bytes, str]:
    """The GPU and host descriptors, and how GPU memory is reached: "hmem" or "staged"."""
    d = rx.region.descriptor
    if d.network_reachable:
        path = "hmem"
    elif d.staged_reachable:
        path = "staged"
    else:
        raise RuntimeError("GPU memory is unreachable over this provider (no FI_HMEM, staging off)")
    return d.to_bytes(), rx.host_region.descriptor.to_bytes(), path


def counted_at(rx: Receiver, imm: int, n: int) -> float:
    """Waits until ``imm`` arrived ``n`` times and the bytes are visible; when (CLOCK_MONOTONIC,
    shared by the processes of one host). The device synchronize matters: shm's CUDA IPC path
    copies device to device with ``cudaMemcpy``, which returns (and the immediate is counted)
    before such a copy finished."""
    with rx.engine.imm_counter(imm) as c:
        c.wait(n, timeout=TIMEOUT)
    torch.cuda.synchronize()
    return time.monotonic()


def fabric_gbps(
    writer: Any, src: Any, dst: Any, rx: Any, size: int, window: int, count: int, imm: int
) -> float:
    done = rx.submit(counted_at, imm, count)
    inflight: list[Any] = []
    t0 = time.monotonic()
    for _ in range(count):
        if len(inflight) == window:
            inflight.pop(0).result(TIMEOUT)
        inflight.append(writer.submit_write(src, dst, size, imm=imm))
    for f in inflight:
        f.result(TIMEOUT)
    return count * size / (done.result(TIMEOUT) - t0) / 1e9


def paged_gbps(writer: Any, src: Any, dst: Any, rx: Any, window: int, count: int, imm: int) -> float:
    """Paged GPU -> GPU writes of PAGES pages of PAGE bytes, shuffled destinations."""
    pages = list(range(PAGES))
    dst_pages = pages[::-1]
    done = rx.submit(counted_at, imm, count)
    inflight: list[Any] = []
    t0 = time.monotonic()
    for _ in range(count):
        if len(inflight) == window:
            inflight.pop(0).result(TIMEOUT)
        inflight.append(writer.submit_paged_writes(PAGE, src, pages, dst, dst_pages, imm=imm))
    for f in inflight:
        f.result(TIMEOUT)
    return count * PAGE * PAGES / (done.result(TIMEOUT) - t0) / 1e9


def fi_rma_bw_gbps(binary: Path, provider: str, size: int, window: int, count: int) -> float:
    """One server/client run of ``fi_rma_bw`` on CUDA buffers; the client's MB/sec."""
    args = [str(binary), "-p", provider, "-E", "-D", "cuda", "-o", "writedata", "-S", str(size)]
    args += ["-W", str(window), "-I", str(count)]
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(1.0)
        out = subprocess.run([*args, "127.0.0.1"], capture_output=True, text=True, timeout=120).stdout
    finally:
        server.wait(30)
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s*\d+[kmg]?\s+\d+", line)]
    if not rows:
        raise RuntimeError(f"fi_rma_bw printed no result:\n{out[-2000:]}")
    return float(rows[-1][4]) / 1e3  # MB/sec -> GB/s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--provider", default="shm", help="shm (FI_HMEM for CUDA) or a provider without it, staged (tcp)"
    )
    ap.add_argument("--sizes", default="1M,4M,16M,64M", help="write sizes, comma-separated")
    ap.add_argument("--window", type=int, default=16, help="writes in flight")
    ap.add_argument(
        "--bytes-per-size", type=parse_size, default=2 << 30, help="bytes moved per size and round"
    )
    ap.add_argument("--rounds", type=int, default=3, help="alternating fabric-lib / baseline rounds")
    ap.add_argument("--fi-rma-bw", type=Path, default=None, help="fi_rma_bw binary for the baseline")
    ap.add_argument(
        "--json-out", default=str(REPO / "bench-results" / "bench_gpu_network.json"), help="result file"
    )
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    import fabric_lib

    rows: dict[int, dict[str, list[float]]] = {s: {"fabric": [], "baseline": []} for s in sizes}
    paged: list[float] = []
    nbytes = max(max(sizes), PAGE * PAGES)
    with spawn_ranks(
        1,
        setup=Receiver,
        setup_kwargs={"provider": args.provider, "nbytes": nbytes},
        teardown=Receiver.close,
        timeout=120,
    ) as (rx,):
        gpu_bytes, host_bytes, path = rx.call(descriptors)
        dst, dst_host = (
            fabric_lib.MrDescriptor.from_bytes(gpu_bytes),
            fabric_lib.MrDescriptor.from_bytes(host_bytes),
        )
        with fabric_lib.TransferEngine(
            args.provider, gpu_network=True, force_network=True, transfer_timeout=TIMEOUT
        ) as writer:
            src = writer.register_tensor(torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda"))
            src_host = writer.register_tensor(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
            torch.cuda.synchronize()
            imm = 1
            for _ in range(args.rounds):
                for size in sizes:
                    count = max(2 * args.window, args.bytes_per_size // size)
                    imm += 1
                    rows[size]["fabric"].append(
                        fabric_gbps(writer, src, dst, rx, size, args.window, count, imm)
                    )
                    if path == "staged":
                        imm += 1
                        rows[size]["baseline"].append(
                            fabric_gbps(writer, src_host, dst_host, rx, size, args.window, count, imm)
                        )
                    elif args.fi_rma_bw:
                        rows[size]["baseline"].append(
                            fi_rma_bw_gbps(args.fi_rma_bw, args.provider, size, args.window, count)
                        )
                imm += 1
                count = max(2 * args.window, args.bytes_per_size // (PAGE * PAGES))
                paged.append(paged_gbps(writer, src, dst, rx, args.window, count, imm))
            stats = writer.staging_stats
    baseline = "host->host GB/s" if path == "staged" else "fi_rma_bw GB/s"
    table = []
    print(
        f"GPU -> GPU over {args.provider} ({'staged through host memory' if path == 'staged' else 'FI_HMEM'}),"
        f" window {args.window}, medians of {args.rounds} rounds"
    )
    print(f"{'size':>8} {'fabric-lib GB/s':>16} {baseline:>16} {'ratio':>6}")
    for size in sizes:
        fab = statistics.median(rows[size]["fabric"])
        raw = statistics.median(rows[size]["baseline"]) if rows[size]["baseline"] else None
        ratio = fab / raw if raw else None
        table.append(
            {"size": size, "fabric_gbps": fab, "baseline_gbps": raw, "ratio": ratio, "rounds": rows[size]}
        )
        print(
            f"{size >> 20:>6}Mi {fab:>16.2f} {raw if raw is not None else float('nan'):>16.2f}"
            f" {ratio if ratio is not None else float('nan'):>6.2f}"
        )
    print(
        f"paged GPU -> GPU, {PAGES} pages of {PAGE >> 10} KiB per request: {statistics.median(paged):.2f} GB/s"
    )
    if path == "staged":
        print(f"writer staging: {stats}")
    series = {
        "fabric-lib": [{"size": r["size"], "gbytes_per_s": r["fabric_gbps"]} for r in table],
        ("host->host" if path == "staged" else "fi_rma_bw"): [
            {"size": r["size"], "gbytes_per_s": r["baseline_gbps"]} for r in table
        ],
    }
    write_result(
        Path(args.json_out),
        "bench_gpu_network",
        args.provider,
        {"window": args.window, "rounds": args.rounds, "device": torch.cuda.get_device_name(0), "path": path},
        {"rows": table, "paged_64k_gbps": paged, "throughput": series},
    )


if __name__ == "__main__":
    main()
