"""Benchmark results people can read and compare: one JSON header (version, commit, libfabric,
provider, host, CPUs, time) in the Python benchmarks and in fabric-debug, named fields, a plot,
`python -m benchmarks.compare`, help texts, and no internal goal columns."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEADER_FIELDS = (
    "package_version",
    "git_commit",
    "libfabric_version",
    "provider",
    "host",
    "cpu_count",
    "time",
)
TINY = [
    "--sizes", "4K,64K", "--read-sizes", "4K,1M", "--reps", "1", "--bytes-per-rep", "1M", "--ops", "2000",
    "--iters", "200", "--warmup-iters", "20", "--poll", "adaptive", "--timeout", "120",
    "--breakdown", "--python-rtt",
]  # fmt: skip


def _check_header(header: dict, benchmark: str) -> None:
    assert header["schema"] == "fabric-lib-benchmark/1"
    assert header["benchmark"] == benchmark
    for field in HEADER_FIELDS:
        assert header.get(field) not in (None, ""), f"header field {field} is missing: {header}"
    assert re.fullmatch(r"\d+\.\d+", header["libfabric_version"])
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", header["git_commit"]) or header["git_commit"] == "unknown"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", header["time"])
    assert header["cpu_count"] == os.cpu_count()


@pytest.fixture(scope="module")
def transfer_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out_dir = tmp_path_factory.mktemp("bench")
    result = out_dir / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_transfer", *TINY, "--json-out", str(result)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, result


def test_bench_transfer_result_has_the_header_and_series(transfer_run) -> None:
    proc, result = transfer_run
    document = json.loads(result.read_text())
    _check_header(document["header"], "bench_transfer")
    assert document["config"]["sizes"] == "4K,64K"
    series = document["results"]["throughput"]
    assert set(series) == {
        "fabric-lib",
        "raw libfabric (baseline)",
        "fabric-lib read",
        "raw libfabric read (baseline)",
    }
    assert [p["size"] for p in series["fabric-lib"]] == [4096, 65536]
    assert [p["size"] for p in series["fabric-lib read"]] == [4096, 1 << 20]
    assert all(p["gbytes_per_s"] > 0 for s in series.values() for p in s)


def test_bench_transfer_reports_the_python_round_trip_and_the_breakdown(transfer_run) -> None:
    """The Python client (benchmarks/python_rtt.py) speaks the server's bootstrap protocol, and
    both clients report the per-step breakdown, the server's turnaround included."""
    _, result = transfer_run
    comparison = json.loads(result.read_text())["results"]["comparison"]
    assert comparison["python_rtt"]["p50_us"] > 0
    for client in ("fabric_lib", "python"):
        steps = {s["step"]: s for s in comparison["breakdown"][client]}
        for step in ("app_to_enqueued", "dequeued_to_posted", "posted_to_imm_seen", "server_fired_to_posted"):
            assert steps[step]["p50_us"] >= 0, (client, step)


def test_users_see_results_and_baselines_not_internal_goals(transfer_run) -> None:
    proc, result = transfer_run
    text = result.read_text()
    for word in ("target", "MISSED", "meets_"):
        assert word not in proc.stdout and word not in text, word
    assert "baseline" in proc.stdout


def test_bench_transfer_writes_a_plot(transfer_run) -> None:
    pytest.importorskip("matplotlib")
    _, result = transfer_run
    png = result.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_two_runs(transfer_run, tmp_path: Path) -> None:
    _, result = transfer_run
    other = json.loads(result.read_text())
    for point in other["results"]["throughput"]["fabric-lib"]:
        point["gbytes_per_s"] *= 2
    other["header"]["git_commit"] = "0" * 40
    b = tmp_path / "b.json"
    b.write_text(json.dumps(other))
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", str(result), str(b), "--plot", str(tmp_path / "ab.png")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"git_commit .* \*$", proc.stdout, flags=re.M)  # the difference is flagged
    fabric = proc.stdout.split("fabric-lib: GB/s")[1].split("\n\n")[0]
    assert [line.split()[-1] for line in fabric.strip().splitlines()[1:]] == ["2.00", "2.00"]
    bad = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", str(result), str(REPO / "pyproject.toml")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2


def test_every_bench_transfer_option_has_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_transfer", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    options = proc.stdout.split("options:")[1]
    blocks = re.split(r"\n  (?=-)", options)[1:]
    assert len(blocks) > 10
    for block in blocks:
        flag, _, text = block.partition("  ")
        description = re.sub(r"\(default: .*?\)", "", " ".join(text.split()), flags=re.S).strip()
        if not description:  # the help may start on the next line
            description = re.sub(r"\(default: .*?\)", "", " ".join(block.split()[1:]), flags=re.S)
        assert description.strip(" -"), f"{flag.split()[0]} has no help text"


def _fabric_debug() -> Path:
    found = shutil.which("fabric-debug", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("fabric-debug is not installed beside this interpreter")
    return Path(found)


def test_fabric_debug_json_has_the_header_and_named_fields() -> None:
    binary = _fabric_debug()
    server = subprocess.Popen(
        [
            binary,
            "server",
            "--provider",
            "tcp",
            "--listen",
            "127.0.0.1:0",
            "--adaptive",
            "--accept-timeout",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        ready = server.stdout.readline()
        address = ready.split()[1]
        client = subprocess.run(
            [binary, "client", "--provider", "tcp", "--connect", address, "--adaptive", "--json",
             "--sizes", "4K", "--reps", "1", "--bytes-per-rep", "1MiB", "--ops", "500", "--iters", "50",
             "--warmup-iters", "5", "--tests", "throughput,paged,rtt", "--page-sizes", "4K", "--page-counts", "8"],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        server.wait(timeout=60)
    assert client.returncode == 0, client.stderr
    report = json.loads(client.stdout)
    _check_header(report["header"], "fabric-debug")
    (point,) = report["paged"]
    assert set(point["per_domain"][0]) == {"gbits_per_s", "mpages_per_s", "share"}
    assert {v["phase"] for v in report["verified"]} == {"throughput", "paged"}
    assert "[1/3] throughput 4 KiB" in client.stderr  # progress on stderr, stdout stays JSON
