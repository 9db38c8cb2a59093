"""Compare two benchmark result files (the shared format of benchmarks/report.py).

    python -m benchmarks.compare A.json B.json [--plot out.png]

Prints what differs between the two runs (commit, versions, provider, host, time) and, for every
throughput series both files have, the throughput per size and the ratio B / A. Exits 2 if a
file is not a benchmark result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.report import load, plot_throughput

HEADER_FIELDS = (
    "benchmark",
    "git_commit",
    "package_version",
    "libfabric_version",
    "provider",
    "host",
    "cpu_count",
    "time",
)


def _size(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def compare(a: dict, b: dict) -> str:
    lines = [f"{'':18} {'A':>28} {'B':>28}"]
    for field in HEADER_FIELDS:
        va, vb = a["header"].get(field), b["header"].get(field)
        mark = "" if va == vb else "  *"
        lines.append(f"{field:18} {str(va)[:28]:>28} {str(vb)[:28]:>28}{mark}")
    series_a = a["results"].get("throughput") or {}
    series_b = b["results"].get("throughput") or {}
    common = [name for name in series_a if name in series_b]
    if not common:
        lines.append("\nno throughput series in common")
    for name in common:
        by_size_a = {p["size"]: p.get("gbytes_per_s") for p in series_a[name]}
        by_size_b = {p["size"]: p.get("gbytes_per_s") for p in series_b[name]}
        lines += ["", f"{name}: GB/s", f"{'size':>8} {'A':>10} {'B':>10} {'B / A':>7}"]
        for size in sorted(set(by_size_a) | set(by_size_b)):
            ga, gb = by_size_a.get(size), by_size_b.get(size)
            ratio = gb / ga if ga and gb is not None else None
            lines.append(f"{_size(size):>8} {_fmt(ga, '10.3f')} {_fmt(gb, '10.3f')} {_fmt(ratio, '7.2f')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path, help="the first (reference) result file")
    p.add_argument("b", type=Path, help="the second result file, compared against the first")
    p.add_argument(
        "--plot", type=Path, default=None, help="also write a PNG with both runs' throughput series"
    )
    args = p.parse_args(argv)
    try:
        a, b = load(args.a), load(args.b)
    except (OSError, ValueError) as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    print(compare(a, b))
    if args.plot is not None:
        series = {f"A {k}": v for k, v in (a["results"].get("throughput") or {}).items()}
        series.update({f"B {k}": v for k, v in (b["results"].get("throughput") or {}).items()})
        plot_throughput(args.plot, series, f"{args.a.name} vs {args.b.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
