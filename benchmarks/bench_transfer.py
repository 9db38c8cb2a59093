"""Compare fabric-lib with a raw-libfabric loop, server and client on one host.

    python -m benchmarks.bench_transfer [--provider tcp] [--sizes 4K,1M,64M] [--same-host] [--json-out PATH]
        [--breakdown] [--python-rtt] [--server-cpus 2-4 --client-cpus 5-7]

Builds `fabric-debug` (``cargo build --release -p fabric-debug``) if its binary is missing,
compiles ``benchmarks/raw_libfabric/raw_write.c`` into ``<target>/raw_libfabric/``, then runs a
server/client pair of each on loopback with the same sizes, window and repetitions, and prints
one table: write throughput per size (raw, fabric-lib, ratio), read throughput per
``--read-sizes`` (``fi_read`` against ``submit_read``), 64-byte op rate, and imm round-trip
latency (with ``--breakdown``, p50/p99 per step of the round trip from the engine's latency
probe; with ``--python-rtt``, the same round trip from Python, ``benchmarks/python_rtt.py``,
against the same server). Results go to ``bench-results/bench_transfer.json`` (the shared result format of
``benchmarks/report.py``) with a throughput plot beside it, unless ``--json-out`` says
otherwise; ``python -m benchmarks.compare A.json B.json`` compares two runs. A failed run exits
non-zero with the child's stderr; every child is bounded by a timeout and killed when this script
exits. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.report import progress, write_result

REPO = Path(__file__).resolve().parent.parent
RAW_SOURCE = REPO / "benchmarks" / "raw_libfabric" / "raw_write.c"
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M,64M"
DEFAULT_READ_SIZES = "4K,64K,1M,16M"

_children: list[subprocess.Popen] = []


class BenchError(RuntimeError):
    """A build or benchmark run failed; the message carries the child's output."""


def _kill_children() -> None:
    for proc in _children:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


def _on_signal(signum, _frame):
    _kill_children()
    sys.exit(128 + signum)


def format_size(n: int) -> str:
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in "kmg" else t
    if not digits.isdigit() or int(digits) == 0:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 4K, 1M, 65536)")
    return int(digits) * mult


def target_dir() -> Path:
    env = os.environ.get("CARGO_TARGET_DIR")
    path = Path(env) if env else REPO / "target"
    return path if path.is_absolute() else REPO / path


def _run_checked(cmd: list[str], what: str, timeout: float) -> None:
    try:
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"{what} took longer than {timeout:.0f} s") from e
    except OSError as e:
        raise BenchError(f"{what}: cannot run {cmd[0]}: {e}") from e
    if done.returncode != 0:
        raise BenchError(f"{what} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


def fabric_debug_binary(rebuild: bool, timeout: float) -> Path:
    binary = target_dir() / "release" / "fabric-debug"
    if rebuild or not binary.exists():
        print("building fabric-debug (cargo build --release -p fabric-debug) ...", file=sys.stderr)
        _run_checked(["cargo", "build", "--release", "-p", "fabric-debug"], "cargo build", timeout)
    if not binary.exists():
        raise BenchError(f"cargo build succeeded but {binary} does not exist")
    return binary


def raw_binary(timeout: float) -> Path:
    binary = target_dir() / "raw_libfabric" / "raw_write"
    if not binary.exists() or binary.stat().st_mtime < RAW_SOURCE.stat().st_mtime:
        binary.parent.mkdir(parents=True, exist_ok=True)
        cc = os.environ.get("CC", "cc")
        _run_checked(
            [cc, "-O2", "-o", str(binary), str(RAW_SOURCE), "-lfabric"], "compiling raw_write.c", timeout
        )
    return binary


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def run_pair(name: str, server_cmd: list[str], client_cmd: list[str], timeout: float, logdir: Path) -> str:
    """Starts the server, waits for its READY line, runs the client; returns the client's stdout."""
    server_err, client_err = logdir / f"{name}-server.err", logdir / f"{name}-client.err"
    deadline = time.monotonic() + timeout
    with open(server_err, "w") as serr:
        server = subprocess.Popen(
            server_cmd, stdout=subprocess.PIPE, stderr=serr, text=True, start_new_session=True
        )
    _children.append(server)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump():
        for line in server.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    try:
        line = lines.get(timeout=60)
    except queue.Empty:
        line = None
    if not line or not line.startswith("READY "):
        _kill_children()
        raise BenchError(f"{name} server did not start (first line {line!r}):\n{_tail(server_err)}")
    address = line.split()[1]
    with open(client_err, "w") as cerr:
        client = subprocess.Popen(
            client_cmd + ["--connect", address],
            stdout=subprocess.PIPE,
            stderr=cerr,
            text=True,
            start_new_session=True,
        )
    _children.append(client)
    try:
        out, _ = client.communicate(timeout=max(1.0, deadline - time.monotonic()))
        server.wait(timeout=max(1.0, min(60.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired as e:
        _kill_children()
        raise BenchError(
            f"{name} did not finish within {timeout:.0f} s:\nclient: {_tail(client_err)}\n"
            f"server: {_tail(server_err)}"
        ) from e
    if client.returncode != 0 or server.returncode != 0:
        raise BenchError(
            f"{name} failed (client exit {client.returncode}, server exit {server.returncode}):\n"
            f"client stderr:\n{_tail(client_err)}\nserver stderr:\n{_tail(server_err)}"
        )
    return out


def common_args(a: argparse.Namespace) -> list[str]:
    args = [
        "--provider",
        a.provider,
        "--sizes",
        a.sizes,
        "--window",
        str(a.window),
        "--reps",
        str(a.reps),
        "--bytes-per-rep",
        str(a.bytes_per_rep),
        "--op-size",
        "64",
        "--op-window",
        str(a.op_window),
        "--ops",
        str(a.ops),
        "--iters",
        str(a.iters),
        "--warmup-iters",
        str(a.warmup_iters),
    ]
    if a.read_sizes:
        args += ["--read-sizes", a.read_sizes]
    return args + (["--domain", a.domain] if a.domain else [])


def pinned(cpus: str | None, cmd: list[str]) -> list[str]:
    """``cmd`` under ``taskset -c cpus`` (unchanged without cpus)."""
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def run_raw(a: argparse.Namespace, binary: Path, logdir: Path) -> dict:
    server = [str(binary), "server", "--provider", a.provider, "--listen", "127.0.0.1:0"]
    server += ["--domain", a.domain] if a.domain else []
    client = [str(binary), "client"] + common_args(a)
    out = run_pair("raw", pinned(a.server_cpus, server), pinned(a.client_cpus, client), a.timeout, logdir)
    tests = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {
        "throughput": [t for t in tests if t["test"] == "throughput"],
        "read_throughput": [t for t in tests if t["test"] == "read_throughput"],
        "op_rate": next((t for t in tests if t["test"] == "op_rate"), None),
        "rtt": next((t for t in tests if t["test"] == "rtt"), None),
    }


_TURNAROUND = re.compile(
    r"ping -> pong .*imm_seen_to_fired ([0-9.]+) / ([0-9.]+), fired_to_posted ([0-9.]+) / ([0-9.]+)"
)


def with_server_steps(result: dict, server_err: Path) -> dict:
    """Adds the server's ping -> pong steps (``fabric-debug server --echo-breakdown`` prints them on
    stderr) to the round trip's breakdown, as ``server_imm_seen_to_fired`` and
    ``server_fired_to_posted``."""
    match = _TURNAROUND.search(_tail(server_err, 100_000))
    rtt = result.get("rtt")
    if match and rtt is not None:
        f50, f99, p50, p99 = (float(g) for g in match.groups())
        rtt.setdefault("breakdown", []).extend(
            [
                {"step": "server_imm_seen_to_fired", "p50_us": f50, "p99_us": f99},
                {"step": "server_fired_to_posted", "p50_us": p50, "p99_us": p99},
            ]
        )
    return result


def run_fabric(a: argparse.Namespace, binary: Path, logdir: Path, same_host: bool = False) -> dict:
    mode = ["--adaptive"] if a.poll == "adaptive" else ["--busy"]
    mode += ["--write-completion", a.write_completion]
    mode += ["--same-host-host-memory"] if same_host else []
    server = [str(binary), "server", "--provider", a.provider, "--listen", "127.0.0.1:0"] + mode
    server += ["--domain", a.domain] if a.domain else []
    server += ["--echo-breakdown"] if a.breakdown else []
    client = [str(binary), "client", "--json", "--wait", a.wait] + mode + common_args(a)
    if a.read_sizes:
        client += ["--tests", "throughput,read,oprate,rtt"]
    client += ["--breakdown"] if a.breakdown else []
    out = run_pair(
        "fabric-lib", pinned(a.server_cpus, server), pinned(a.client_cpus, client), a.timeout, logdir
    )
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as e:
        raise BenchError(f"fabric-debug printed no JSON report:\n{out[-2000:]}") from e
    return with_server_steps(result, logdir / "fabric-lib-server.err")


def run_python_rtt(a: argparse.Namespace, binary: Path, logdir: Path) -> dict:
    """The imm round trip from Python (benchmarks/python_rtt.py) against a fabric-debug server."""
    mode = ["--adaptive"] if a.poll == "adaptive" else ["--busy"]
    mode += ["--write-completion", a.write_completion]
    server = [str(binary), "server", "--provider", a.provider, "--listen", "127.0.0.1:0"] + mode
    server += ["--domain", a.domain] if a.domain else []
    server += ["--echo-breakdown"] if a.breakdown else []
    client = [sys.executable, str(REPO / "benchmarks" / "python_rtt.py"), "--provider", a.provider]
    client += ["--poll", a.poll, "--write-completion", a.write_completion, "--wait", a.python_wait]
    client += ["--iters", str(a.iters), "--warmup-iters", str(a.warmup_iters)]
    client += ["--domain", a.domain] if a.domain else []
    client += ["--breakdown"] if a.breakdown else []
    out = run_pair("python", pinned(a.server_cpus, server), pinned(a.client_cpus, client), a.timeout, logdir)
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as e:
        raise BenchError(f"python_rtt printed no JSON report:\n{out[-2000:]}") from e
    return with_server_steps(result, logdir / "python-server.err")


def python_summary(rounds: list[dict], rust_p50_us: float | None) -> dict:
    """Medians of the Python round trips, and how far the p50 lies above fabric-debug's."""
    p50 = combine(rounds, lambda r: r["rtt"]["p50_us"])
    return {
        "p50_us": p50,
        "p99_us": combine(rounds, lambda r: r["rtt"]["p99_us"]),
        "above_rust_p50_us": p50 - rust_p50_us if p50 is not None and rust_p50_us is not None else None,
    }


def breakdown_summary(rounds: list[dict]) -> list[dict]:
    """Per step of the round trip: medians over rounds of its p50 and p99."""
    steps: list[str] = []
    for r in rounds:
        for step in (r.get("rtt") or {}).get("breakdown", []):
            if step["step"] not in steps:
                steps.append(step["step"])

    def pick(name: str, key: str):
        return lambda r: next(
            (s[key] for s in (r.get("rtt") or {}).get("breakdown", []) if s["step"] == name), None
        )

    return [
        {
            "step": name,
            "p50_us": combine(rounds, pick(name, "p50_us")),
            "p99_us": combine(rounds, pick(name, "p99_us")),
        }
        for name in steps
    ]


def ratio(x: float | None, y: float | None) -> float | None:
    return y / x if x and y is not None else None


def combine(rounds: list[dict], pick) -> float | None:
    """Median over rounds of one per-round number (each already a median of repetitions)."""
    vals = [v for v in (pick(r) for r in rounds) if v is not None]
    return statistics.median(vals) if vals else None


def same_host_summary(rounds: list[dict]) -> dict:
    """Medians of the same-host runs (process_vm_writev + shared-memory inbox)."""
    return {
        "throughput": {
            t["size"]: combine(
                rounds,
                lambda r, s=t["size"]: next(
                    (x["gbytes_per_s"] for x in r["throughput"] if x["size"] == s), None
                ),
            )
            for t in rounds[0]["throughput"]
        },
        "mops_per_s": combine(rounds, lambda r: (r.get("op_rate") or {}).get("mops_per_s")),
        "p50_us": combine(rounds, lambda r: (r.get("rtt") or {}).get("p50_us")),
        "p99_us": combine(rounds, lambda r: (r.get("rtt") or {}).get("p99_us")),
    }


def compare(
    raw_rounds: list[dict],
    fab_rounds: list[dict],
    sizes: list[int],
    read_sizes: list[int] | None = None,
    same_host_rounds: list[dict] | None = None,
    python_rounds: list[dict] | None = None,
) -> dict:
    def size_pick(size, key, series="throughput"):
        return lambda r: next((t[key] for t in r.get(series, []) if t["size"] == size), None)

    def rows_of(series: str, of_sizes: list[int]) -> list[dict]:
        rows = []
        for size in of_sizes:
            raw = combine(raw_rounds, size_pick(size, "gbytes_per_s", series))
            fab = combine(fab_rounds, size_pick(size, "gbytes_per_s", series))
            rows.append(
                {
                    "size": size,
                    "raw_gbytes_per_s": raw,
                    "fabric_lib_gbytes_per_s": fab,
                    "ratio": ratio(raw, fab),
                }
            )
        return rows

    rows = rows_of("throughput", sizes)
    read_rows = rows_of("read_throughput", read_sizes or [])
    op = lambda r: (r.get("op_rate") or {}).get("mops_per_s")  # noqa: E731
    raw_op, fab_op = combine(raw_rounds, op), combine(fab_rounds, op)
    op_ratio = ratio(raw_op, fab_op)
    lat = {}
    for side, rounds in (("raw", raw_rounds), ("fabric_lib", fab_rounds)):
        for key in ("p50_us", "p99_us"):
            lat[f"{side}_{key}"] = combine(rounds, lambda r, k=key: (r.get("rtt") or {}).get(k))
    return {
        "throughput": rows,
        "read_throughput": read_rows,
        "same_host": same_host_summary(same_host_rounds) if same_host_rounds else None,
        "op_rate": {
            "size": 64,
            "raw_mops_per_s": raw_op,
            "fabric_lib_mops_per_s": fab_op,
            "ratio": op_ratio,
        },
        "rtt": lat,
        "python_rtt": python_summary(python_rounds, lat["fabric_lib_p50_us"]) if python_rounds else None,
        "breakdown": {
            "fabric_lib": breakdown_summary(fab_rounds),
            "python": breakdown_summary(python_rounds or []),
        },
    }


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(cmp: dict, a: argparse.Namespace, provider: str) -> str:
    out = [
        f"provider {provider}, window {a.window}, op window {a.op_window}, {a.reps} reps x {a.rounds} round(s), "
        f"poll {a.poll}; medians. Baseline: a raw libfabric loop (the provider's ceiling); "
        "ratio = fabric-lib / baseline.",
        "",
        f"{'size':>8} {'fabric-lib GB/s':>15} {'baseline GB/s':>13} {'ratio':>6}",
    ]
    for row in cmp["throughput"]:
        out.append(
            f"{format_size(row['size']):>8} {fmt(row['fabric_lib_gbytes_per_s'], '15.3f')} "
            f"{fmt(row['raw_gbytes_per_s'], '13.3f')} {fmt(row['ratio'], '6.2f')}"
        )
    if cmp.get("read_throughput"):
        out += ["", f"{'read size':>9} {'fabric-lib GB/s':>15} {'baseline GB/s':>13} {'ratio':>6}"]
        for row in cmp["read_throughput"]:
            out.append(
                f"{format_size(row['size']):>9} {fmt(row['fabric_lib_gbytes_per_s'], '15.3f')} "
                f"{fmt(row['raw_gbytes_per_s'], '13.3f')} {fmt(row['ratio'], '6.2f')}"
            )
    op = cmp["op_rate"]
    out += [
        "",
        f"op rate, 64 B writes with imm: fabric-lib {fmt(op['fabric_lib_mops_per_s'], '.3f')} Mops/s, "
        f"baseline {fmt(op['raw_mops_per_s'], '.3f')} Mops/s, ratio {fmt(op['ratio'], '.2f')}",
    ]
    lat = cmp["rtt"]
    out.append(
        f"imm round trip: fabric-lib p50 {fmt(lat['fabric_lib_p50_us'], '.1f')} us, p99 "
        f"{fmt(lat['fabric_lib_p99_us'], '.1f')} us (baseline: p50 {fmt(lat['raw_p50_us'], '.1f')} us, "
        f"p99 {fmt(lat['raw_p99_us'], '.1f')} us)"
    )
    py = cmp.get("python_rtt")
    if py:
        out.append(
            f"imm round trip from Python ({a.python_wait} wait): p50 {fmt(py['p50_us'], '.1f')} us, "
            f"p99 {fmt(py['p99_us'], '.1f')} us; p50 {fmt(py['above_rust_p50_us'], '+.1f')} us "
            "against fabric-debug's"
        )
    rust_steps, py_steps = cmp["breakdown"]["fabric_lib"], cmp["breakdown"]["python"]
    if rust_steps or py_steps:
        out += [
            "",
            "round trip per step (engine latency probe; p50 / p99 us; app = the caller's own stamp):",
            f"  {'step':<30} {'fabric-debug':>17} {'Python':>17}",
        ]
        by_py = {s["step"]: s for s in py_steps}
        names = [s["step"] for s in rust_steps] + [
            s["step"] for s in py_steps if s["step"] not in {r["step"] for r in rust_steps}
        ]
        by_rust = {s["step"]: s for s in rust_steps}

        def cell(s: dict | None) -> str:
            if s is None:
                return f"{'-':>17}"
            return f"{fmt(s['p50_us'], '8.2f')} {fmt(s['p99_us'], '8.2f')}"

        for name in names:
            out.append(f"  {name:<30} {cell(by_rust.get(name))} {cell(by_py.get(name))}")
    same = cmp.get("same_host")
    if same:
        out += [
            "",
            "same-host path (--same-host: process_vm_writev + the peer's shared-memory inbox, same run):",
            f"  op rate, 64 B writes with imm: {fmt(same['mops_per_s'], '.3f')} Mops/s "
            f"(provider path {fmt(op['fabric_lib_mops_per_s'], '.3f')})",
            f"  imm round trip: p50 {fmt(same['p50_us'], '.1f')} us, p99 {fmt(same['p99_us'], '.1f')} us "
            f"(provider path p50 {fmt(lat['fabric_lib_p50_us'], '.1f')} us)",
        ]
        for size, gbs in same["throughput"].items():
            out.append(f"  {format_size(int(size)):>8} {fmt(gbs, '.3f')} GB/s")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--provider", default="tcp", help="libfabric provider (tcp, udp;ofi_rxd, shm, efa, verbs;ofi_rxm)"
    )
    p.add_argument(
        "--domain", default=None, help="domain (NIC or interface) to use; default: lo for software providers"
    )
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated write sizes (K/M/G suffixes)")
    p.add_argument(
        "--read-sizes",
        default=DEFAULT_READ_SIZES,
        help="comma-separated read sizes of the read test (empty: no read test)",
    )
    p.add_argument(
        "--window", type=int, default=16, help="writes (and reads) in flight during the throughput tests"
    )
    p.add_argument("--op-window", type=int, default=64, help="writes in flight during the op-rate test")
    p.add_argument(
        "--reps", type=int, default=5, help="timed repetitions per measurement (the median is reported)"
    )
    p.add_argument("--rounds", type=int, default=1, help="alternate baseline/fabric-lib runs this many times")
    p.add_argument(
        "--bytes-per-rep",
        type=parse_size,
        default=512 << 20,
        help="bytes moved per throughput repetition (at least)",
    )
    p.add_argument("--ops", type=int, default=200_000, help="64-byte writes per op-rate repetition")
    p.add_argument("--iters", type=int, default=10_000, help="measured round trips")
    p.add_argument("--warmup-iters", type=int, default=1_000, help="untimed round trips before measuring")
    p.add_argument(
        "--poll", choices=("busy", "adaptive"), default="busy", help="fabric-lib worker polling mode"
    )
    p.add_argument(
        "--write-completion",
        choices=("auto", "delivery", "transmit"),
        default="auto",
        help="when fabric-lib counts a write done (see TransferEngine): delivery or transmit completion",
    )
    p.add_argument(
        "--wait",
        choices=("block", "spin"),
        default="block",
        help="how the fabric-debug client waits for completions and pongs",
    )
    p.add_argument(
        "--same-host",
        action="store_true",
        help="also run fabric-lib with same-host writes and immediates (process_vm_writev + the peer's "
        "shared-memory inbox, not the provider) in every round, and report it beside the provider path",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="report where the round trip's time goes, per step (the engine's latency probe)",
    )
    p.add_argument(
        "--python-rtt",
        action="store_true",
        help="also measure the round trip from Python (benchmarks/python_rtt.py) in every round",
    )
    p.add_argument(
        "--python-wait",
        choices=("counter", "future"),
        default="counter",
        help="how the Python round trip waits: ImmCounter.wait or the Future of expect_imm_count",
    )
    p.add_argument(
        "--server-cpus",
        default=None,
        help="taskset CPU list for every server (e.g. 2-4); give each side several CPUs",
    )
    p.add_argument("--client-cpus", default=None, help="taskset CPU list for every client (e.g. 5-7)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per server/client run")
    p.add_argument("--rebuild", action="store_true", help="run cargo build even if the binary exists")
    p.add_argument(
        "--json-out",
        type=Path,
        default=REPO / "bench-results" / "bench_transfer.json",
        help="result file (a PNG plot is written beside it)",
    )
    a = p.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in a.sizes.split(",") if s.strip()]
        read_sizes = [parse_size(s) for s in a.read_sizes.split(",") if s.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if min(a.window, a.op_window, a.reps, a.rounds, a.ops, a.iters) <= 0:
        p.error("--window, --op-window, --reps, --rounds, --ops and --iters must be positive")
    if (a.server_cpus or a.client_cpus) and shutil.which("taskset") is None:
        p.error("--server-cpus/--client-cpus need taskset (util-linux)")
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        fabric_bin = fabric_debug_binary(a.rebuild, a.timeout)
        raw_bin = raw_binary(a.timeout)
        raw_rounds, fab_rounds, same_rounds, python_rounds = [], [], [], []
        tools = ("baseline", "fabric-lib") + (("same-host",) if a.same_host else ())
        tools += ("python",) if a.python_rtt else ()
        with tempfile.TemporaryDirectory(prefix="bench_transfer.") as tmp:
            phases = [(i, tool) for i in range(a.rounds) for tool in tools]
            for _, tool in progress(phases, desc="bench_transfer (baseline and fabric-lib runs)"):
                if tool == "baseline":
                    raw_rounds.append(run_raw(a, raw_bin, Path(tmp)))
                elif tool == "fabric-lib":
                    fab_rounds.append(run_fabric(a, fabric_bin, Path(tmp)))
                elif tool == "python":
                    python_rounds.append(run_python_rtt(a, fabric_bin, Path(tmp)))
                else:
                    same_rounds.append(run_fabric(a, fabric_bin, Path(tmp), same_host=True))
    except BenchError as e:
        print(f"bench_transfer: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        _kill_children()
    cmp = compare(raw_rounds, fab_rounds, sizes, read_sizes, same_rounds, python_rounds)
    provider = fab_rounds[-1].get("provider", a.provider)
    print(table(cmp, a, provider))
    throughput = {
        "fabric-lib": [
            {"size": r["size"], "gbytes_per_s": r["fabric_lib_gbytes_per_s"]} for r in cmp["throughput"]
        ],
        "raw libfabric (baseline)": [
            {"size": r["size"], "gbytes_per_s": r["raw_gbytes_per_s"]} for r in cmp["throughput"]
        ],
    }
    if cmp["read_throughput"]:
        throughput["fabric-lib read"] = [
            {"size": r["size"], "gbytes_per_s": r["fabric_lib_gbytes_per_s"]} for r in cmp["read_throughput"]
        ]
        throughput["raw libfabric read (baseline)"] = [
            {"size": r["size"], "gbytes_per_s": r["raw_gbytes_per_s"]} for r in cmp["read_throughput"]
        ]
    results = {
        "comparison": cmp,
        "throughput": throughput,
        "baseline_rounds": raw_rounds,
        "fabric_lib_rounds": fab_rounds,
        "same_host_rounds": same_rounds,
        "python_rounds": python_rounds,
    }
    print(file=sys.stderr)
    write_result(a.json_out, "bench_transfer", provider, vars(a), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
