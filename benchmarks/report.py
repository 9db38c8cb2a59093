"""One result format for every benchmark: a header describing the run, the configuration, and
the results; a throughput-vs-size plot; progress on long phases.

Every result file is a JSON object::

    {"header": {...run metadata, see run_header()...},
     "config": {...the command-line options...},
     "results": {...benchmark specific...,
                 "throughput": {"<series name>": [{"size": bytes, "gbytes_per_s": x}, ...], ...}}}

``results["throughput"]`` (optional) is what plots and ``python -m benchmarks.compare`` read.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
SCHEMA = "fabric-lib-benchmark/1"
T = TypeVar("T")

Series = Mapping[str, Sequence[Mapping[str, float]]]


def package_version() -> str | None:
    """The installed fabric_lib's version, or None if it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fabric-lib")
    except PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The checkout's commit, with "-dirty" if it has uncommitted changes; None outside git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def libfabric_version() -> str | None:
    """The version of the libfabric.so.1 this process would load (fi_version()), e.g. "1.17"."""
    try:
        lib = ctypes.CDLL("libfabric.so.1")
    except OSError:
        return None
    lib.fi_version.restype = ctypes.c_uint32
    v = lib.fi_version()
    return f"{v >> 16}.{v & 0xFFFF}"


def run_header(benchmark: str, provider: str | None) -> dict[str, Any]:
    """What makes two result files comparable: code, library, machine and time of the run."""
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "package_version": package_version(),
        "git_commit": git_commit(),
        "libfabric_version": libfabric_version(),
        "provider": provider,
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
        "time": datetime.datetime.now(datetime.timezone.utc)
        .isoformat(timespec="seconds")
        .replace("+00:00", "Z"),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_result(
    path: Path, benchmark: str, provider: str | None, config: Mapping[str, Any], results: Mapping[str, Any]
) -> dict[str, Any]:
    """Writes the result file (and, if it has throughput series, a PNG beside it); returns it."""
    document = {
        "header": run_header(benchmark, provider),
        "config": _plain(dict(config)),
        "results": _plain(dict(results)),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    if results.get("throughput"):
        plot_throughput(path.with_suffix(".png"), results["throughput"], title_for(document["header"]))
    return document


def title_for(header: Mapping[str, Any]) -> str:
    parts = [str(header.get("benchmark")), str(header.get("provider") or "")]
    commit = header.get("git_commit")
    if commit:
        parts.append(str(commit)[:12])
    parts.append(f"{header.get('host')}, {header.get('cpu_count')} CPUs")
    return " · ".join(p for p in parts if p)


def plot_throughput(path: Path, series: Series, title: str) -> Path | None:
    """Throughput against transfer size, one line per series (fabric-lib and its baseline)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        pts = sorted((p["size"], p["gbytes_per_s"]) for p in points if p.get("gbytes_per_s") is not None)
        if pts:
            ax.plot([s for s, _ in pts], [g for _, g in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("transfer size (bytes)")
    ax.set_ylabel("throughput (GB/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)
    return path


def progress(items: Iterable[T], total: int | None = None, desc: str = "") -> Iterator[T]:
    """Iterates with a progress bar on stderr (tqdm if installed, else one line per step)."""
    try:
        from tqdm import tqdm
    except ImportError:
        items = list(items)
        count = len(items) if total is None else total
        for i, item in enumerate(items):
            print(f"{desc} {i + 1}/{count} ...", file=sys.stderr, flush=True)
            yield item
        return
    yield from tqdm(items, total=total, desc=desc, file=sys.stderr, unit="phase", dynamic_ncols=True)


def load(path: Path) -> dict[str, Any]:
    """Reads a result file, checking that it has the shared layout."""
    document = json.loads(Path(path).read_text())
    if not isinstance(document, dict) or document.get("header", {}).get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a fabric-lib benchmark result ({SCHEMA})")
    if "results" not in document:  # a `fabric-debug client --json` report: header + measurements
        series = [
            {"size": t["size"], "gbytes_per_s": t["gbytes_per_s"]} for t in document.get("throughput", [])
        ]
        document = {
            "header": document["header"],
            "config": {},
            "results": {"throughput": {"fabric-lib": series}, "report": document},
        }
    return document
