"""One TransferEngine over all NICs of each host, across the network-namespace test bed.

Every host runs ``tests/netns_multi_nic_worker.py`` (one process, ONE engine over ``nic0..nicK-1``,
gloo bootstrap + ``fabric_lib.distributed.exchange``); see that file for what each scenario
checks. Here: sharded single writes, paged writes (hypothesis), scatter and barriers with every
byte and immediate count checked, on 3 hosts x 2 NICs and 2 hosts x 4 NICs; proof from the NICs'
byte counters that the traffic was spread over every NIC; bad input and a domain-count mismatch
between hosts; and a NIC of the receiver taken down mid-stream (host side and switch side).

Needs root (network namespaces) and torch; skips with the reason otherwise. Run alone with
``pytest -m netns tests/test_netns_multi_nic.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "netns_multi_nic_worker.py"




from fabric_lib.testbed import netns as tb  # noqa: E402

pytestmark = pytest.mark.netns

PREFIX = "flmnic"  # this file's beds; never touches other tests' or the CLI's
TRAFFIC = 32 << 20  # bytes rank 0 sends to rank 1 in the counted traffic phase
TRANSFER_TIMEOUT = 3.0  # seconds, for the fault scenario
# Environment of every worker: no interface pinning by the caller, one OpenMP thread (2 cores).
WORKER_ENV = {"PYTHONPATH": os.environ.get("PYTHONPATH"), "FI_TCP_IFACE": None, "OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _requirements():
    ok, why = tb.available()
    if not ok:
        pytest.skip(f"netns test bed unavailable: {why}")
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("hypothesis") is None:
        pytest.skip("torch and hypothesis are needed")
    tb.cleanup_stale(PREFIX)  # leftovers of killed runs
    yield


@pytest.fixture(scope="module")
def bed3x2():
    """3 hosts x 2 NICs, shared by the tests that leave every link up."""
    ok, why = tb.available()
    if not ok:
        pytest.skip(f"netns test bed unavailable: {why}")
    with tb.TestBed(hosts=3, nics=2, prefix=PREFIX) as bed:
        yield bed


def _run(bed, scenario: str, *args: str, timeout: float = 90.0, hosts=None) -> list[dict]:
    """Runs the worker's ``scenario`` on every host; returns each rank's RESULT (rank order)."""
    try:
        results = bed.run_all(
            [sys.executable, str(WORKER), scenario, *args],
            hosts=hosts,
            timeout=timeout,
            cwd=str(ROOT),
            env=WORKER_ENV,
        )
    except tb.RunError as e:
        pytest.fail(f"worker scenario {scenario!r} failed: {e}", pytrace=False)
    out = []
    for r in results:
        lines = [line for line in r.stdout.splitlines() if line.startswith("RESULT ")]
        assert len(lines) == 1, f"rank {r.rank}: no RESULT line\n{r.stdout}\n{r.stderr[-3000:]}"
        out.append(json.loads(lines[0][len("RESULT ") :]))
    return out


def _counters(bed) -> list[dict]:
    return [bed.nic_counters(h) for h in range(bed.hosts)]


def _check_spread(bed, reports: list[dict], before: list[dict], after: list[dict]) -> dict:
    """The counted traffic phase (rank 0 -> rank 1, TRAFFIC bytes) went over every NIC evenly.

    Two views of rank 0's tx bytes per NIC: the worker's own reading of the counters around
    exactly that phase (tight: each NIC carried payload/K within -20%/+20%, TCP/IP headers
    included), and ``TestBed.nic_counters`` around the whole run (a lower bound: other phases
    and gloo's bootstrap on nic0 only add)."""
    k = bed.num_nics
    share = TRAFFIC / k
    phase = reports[0]["traffic"]
    assert phase["payload"] == TRAFFIC
    spread = {}
    for nic in bed.nics:
        tx = phase["tx"][nic]["tx_bytes"]
        whole = after[0][nic]["tx_bytes"] - before[0][nic]["tx_bytes"]
        received = after[1][nic]["rx_bytes"] - before[1][nic]["rx_bytes"]
        assert 0.8 * share <= tx <= 1.2 * share, f"{nic} sent {tx} bytes of the phase; fair share {share:.0f}"
        assert whole >= 0.8 * share, f"nic_counters: host 0 {nic} sent only {whole} bytes in the run"
        assert received >= 0.8 * share, f"nic_counters: host 1 {nic} received only {received} bytes"
        spread[nic] = round(tx / share, 3)
    return spread


def _check_correctness(bed, reports: list[dict], examples: int) -> None:
    k = bed.num_nics
    for rank, rep in enumerate(reports):
        assert rep["rank"] == rank and rep["domains"] == bed.nics, rep
        assert rep["single"]["cases"] >= len(rep["single"]["shard_choices"]) * 9 + k
        assert rep["scatter"]["scatter_targets"] == bed.hosts - 1
        assert set(rep["bad_input"]["refused"]) >= {
            "src page out of range",
            "dst page out of range",
            "empty page list",
        }
        assert set(rep["bad_input"]["refused"].values()) == {"InvalidArgumentError"}
        assert rep["stop_s"] < 5, rep["stop_s"]
    assert reports[0]["paged"]["paged_examples"] == examples


@pytest.mark.timeout(150)
def test_one_engine_over_two_nics_three_hosts(bed3x2) -> None:
    """Sharded/pinned single writes (ring), 12 hypothesis paged-write examples between random host
    pairs, scatter to 2 peers (both shardings), barriers, bad input; traffic over both NICs."""
    before = _counters(bed3x2)
    reports = _run(bed3x2, "correctness", "--examples", "12", "--traffic-bytes", str(TRAFFIC), timeout=120)
    after = _counters(bed3x2)
    _check_correctness(bed3x2, reports, 12)
    spread = _check_spread(bed3x2, reports, before, after)
    print(f"3x2: phase timings {reports[0]['timings']}, tx share per NIC {spread}")


@pytest.mark.timeout(150)
def test_one_engine_over_four_nics_two_hosts() -> None:
    """The same on 2 hosts x 4 NICs (shard_domains 1, 2, 3 and all; pinned on each of 4)."""
    with tb.TestBed(hosts=2, nics=4, prefix=PREFIX) as bed:
        before = _counters(bed)
        reports = _run(bed, "correctness", "--examples", "8", "--traffic-bytes", str(TRAFFIC), timeout=120)
        after = _counters(bed)
    _check_correctness(bed, reports, 8)
    assert reports[0]["single"]["shard_choices"] == ["None", "1", "2", "3", "4"]
    spread = _check_spread(bed, reports, before, after)
    print(f"2x4: phase timings {reports[0]['timings']}, tx share per NIC {spread}")


@pytest.mark.timeout(90)
def test_domain_count_mismatch_is_refused(bed3x2) -> None:
    """Host 1 opens its engine over nic0 only, hosts 0 and 2 over both NICs: descriptors and
    addresses across the mismatch are refused (InvalidDescriptorError), in both directions, while
    the two 2-NIC hosts still talk to each other."""
    reports = _run(bed3x2, "mismatch", "--single-nic-rank", "1", timeout=60)
    assert [r["domains"] for r in reports] == [["nic0", "nic1"], ["nic0"], ["nic0", "nic1"]]
    for r in reports:
        for key, outcome in r["outcomes"].items():
            peer = int(key.split(":")[0])
            if 1 in (peer, r["rank"]):
                assert outcome.startswith("InvalidDescriptorError") and "same number" in outcome, (
                    r["rank"],
                    key,
                    outcome,
                )
            else:
                assert outcome == "ok", (r["rank"], key, outcome)
    assert len(reports[1]["outcomes"]) == 8  # 4 attempts at each of the two 2-NIC hosts


def _write_marker(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)  # atomic: the worker never reads a half-written marker


def _wait_marker(path: Path, runner: threading.Thread, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if not runner.is_alive() or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("side", ["host", "switch"])
def test_receiver_nic_down_mid_stream(side: str) -> None:
    """Host 0 streams sharded writes (256 KiB over both NICs, transfer_timeout 3 s) to host 1; host
    1's nic1 goes down mid-stream (``side="host"``: ``ip link set nic1 down`` in host 1;
    ``"switch"``: the hub's port, so nic1 loses carrier). Requests caught by the fault fail with
    TransferError/FabricTimeoutError within transfer_timeout + 3 s, nothing hangs; writes pinned
    to domain 0 still arrive byte-exact while nic1 is down; no immediate ever arrives before its
    data or twice; once the link is back, every successful request's immediate has arrived and a
    sharded write succeeds.

    What libfabric tcp (1.17, tcp;ofi_rxm) did here: no error completion at all (no RST reaches
    the sender; the TCP stream on nic1 just stalls), so every request with a shard on nic1 failed
    by the engine's transfer timeout (FabricTimeoutError "request not completed within 3s"),
    3.0 s after its submission, on both sides; none with TransferError. After the link came back,
    the stalled shards were delivered anyway: the failed requests' destination slots ended up
    complete (without immediates), and the source registration was held until then."""
    with tb.TestBed(hosts=2, nics=2, prefix=PREFIX) as bed, tempfile.TemporaryDirectory() as sync_dir:
        sync = Path(sync_dir)
        box: dict = {}

        def run() -> None:
            try:
                box["reports"] = _run(
                    bed,
                    "fault",
                    "--sync-dir",
                    sync_dir,
                    "--transfer-timeout",
                    str(TRANSFER_TIMEOUT),
                    timeout=90,
                )
            except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
                box["error"] = e

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        link_down = False
        try:
            if _wait_marker(sync / "streaming", runner, 60):
                bed.set_link(1, "nic1", False, side=side)
                link_down = True
                _write_marker(sync / "link_down", repr(time.monotonic()))
                if _wait_marker(sync / "pinned_done", runner, 60):
                    bed.set_link(1, "nic1", True, side=side)
                    link_down = False
                    _write_marker(sync / "link_up", "1")
            runner.join(100)
        finally:
            if link_down:
                bed.set_link(1, "nic1", True, side=side)
        assert not runner.is_alive(), "worker run did not finish"
        if "error" in box:
            raise box["error"]
    sender, receiver = box["reports"]
    print(f"nic1 down ({side} side): sender {sender}\nreceiver {receiver}")
    failed = {k: v for k, v in sender["outcomes"].items() if k != "ok"}
    assert failed and set(failed) <= {"TransferError", "FabricTimeoutError", "PeerFencedError"}, sender["outcomes"]
    assert sender["fail_latency_max"] <= TRANSFER_TIMEOUT + 3.0
    assert sender["outcomes"].get("ok", 0) >= 32
    assert receiver["imms_arrived"] >= sender["outcomes"]["ok"]
    assert sender["restore_attempts"][-1] == "ok", sender["restore_attempts"]
    # The timed-out operations keep their source registration until the provider completes them
    # (once the link is back), so it cannot be unregistered under the provider's feet; then it can.
    if sender["unregister_while_down"] != "ok":
        assert "in flight" in sender["unregister_while_down"], sender["unregister_while_down"]
        assert sender["unregister_after_restore"] == "ok", sender
    assert sender["stop_s"] < 5 and receiver["stop_s"] < 5
