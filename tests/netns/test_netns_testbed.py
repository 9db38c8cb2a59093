"""The network-namespace test bed (fabric_lib.testing.netns), and fabric_lib across its hosts.

Needs root (to create network namespaces); skips with the reason otherwise. Run alone with
``pytest -m netns tests/netns/test_netns_testbed.py``.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
from fabric_lib.testing import gather, host_ranks, init_process_group, this_rank
from fabric_lib.testing import netns as tb

PREFIX = "fltest"  # distinct from the CLI's default "fl", so these tests never touch its beds
PAYLOAD = 4 << 20  # bytes written over each NIC
CHUNKS = 4  # writes per NIC, each with the NIC's immediate


def _skip_unless_available() -> None:
    ok, why = tb.available()
    if not ok:
        pytest.skip(f"netns test bed unavailable: {why}")


@pytest.fixture(autouse=True)
def _netns_env():
    _skip_unless_available()
    tb.cleanup_stale(PREFIX)  # leftovers of killed runs
    yield


def _bed_names(bed) -> set[str]:
    return set(bed.all_namespaces)


def _leftovers(tag: str) -> tuple[list[str], list[str]]:
    """Namespaces and links (in this namespace) whose name mentions this bed's prefix and tag."""
    needle = f"{PREFIX}-{tag}"
    namespaces = [n for n in tb.list_namespaces() if n.startswith(needle)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    return namespaces, [line for line in links.splitlines() if needle in line]


def _assert_gone(tag: str) -> None:
    namespaces, links = _leftovers(tag)
    assert not namespaces and not links, (namespaces, links)


# -- (1) topology, addressing, reachability, teardown -----------------------------------------


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_three_hosts_two_nics_reach_each_other_and_tear_down() -> None:
    with tb.TestBed(hosts=3, nics=2, prefix=PREFIX) as bed:
        tag = bed.tag
        assert _bed_names(bed) <= set(tb.list_namespaces())
        for h in range(3):
            out = bed.run(h, ["ip", "-o", "-4", "addr", "show"]).stdout
            got = dict(re.findall(r"^\d+: (\S+)\s+inet (\S+)", out, re.M))
            assert got == {
                "lo": "127.0.0.1/8",
                "nic0": f"198.18.0.{h + 1}/24",
                "nic1": f"198.18.1.{h + 1}/24",
            }
            for n in range(2):
                assert ipaddress.ip_address(bed.addr(h, n)) in tb.ADDRESS_RANGE  # 198.18.0.0/15 only
                assert tb.ADDRESS_RANGE.supernet_of(ipaddress.IPv4Network(bed.subnet(n)))
            link = bed.run(h, ["ip", "-o", "link", "show", "lo"]).stdout
            assert "UP" in link.split(">")[0], link
            assert bed.run(h, ["ip", "-o", "-6", "addr", "show"]).stdout.strip() == "", "IPv6 should be off"
        assert bed.bootstrap_addr == "198.18.0.1" and bed.init_method(1234) == "tcp://198.18.0.1:1234"
        before = [bed.nic_counters(h) for h in range(3)]
        bed.verify_connectivity()  # TCP from each NIC address to the same NIC of every other host
        after = [bed.nic_counters(h) for h in range(3)]
        for h in range(3):
            for nic in ("nic0", "nic1"):
                assert after[h][nic]["tx_bytes"] > before[h][nic]["tx_bytes"]
                assert after[h][nic]["rx_bytes"] > before[h][nic]["rx_bytes"]

        # NIC faults: with host 1's nic1 down, host 0 cannot reach 198.18.1.2, but nic0 still works.
        bed.set_link(1, "nic1", up=False)
        probe = [
            sys.executable,
            "-c",
            "import socket,sys; socket.create_connection((sys.argv[1], 9), timeout=1)",
        ]
        res = bed.run(0, [*probe, bed.addr(1, 1)], check=False, timeout=20)
        assert res.returncode != 0, res.stderr
        assert any(m in res.stderr for m in ("timed out", "No route to host", "unreachable")), res.stderr
        res = bed.run(0, [*probe, bed.addr(1, 0)], check=False, timeout=20)
        assert "Connection refused" in res.stderr, res.stderr  # reached host 1; nothing listens on 9
        bed.set_link(1, "nic1", up=True)
        bed.verify_connectivity()
    _assert_gone(tag)
    assert bed.close() == []  # idempotent


# -- (2) fabric_lib over both NICs of two hosts ------------------------------------------------


def engine_per_nic(_state: None) -> dict[str, Any]:
    """One host of test (2): an engine per NIC; rank 0 writes PAYLOAD bytes with an immediate over
    each; rank 1 checks every byte and the immediate counts. Returns this rank's report."""
    import fabric_lib
    import torch
    import torch.distributed as dist
    from fabric_lib.distributed import exchange

    rank = this_rank().rank
    nics = os.environ[tb.ENV_NICS].split(",")
    init_process_group("gloo", timeout=60)
    engines = [
        fabric_lib.TransferEngine("tcp", nic, poll_mode="adaptive", transfer_timeout=30.0) for nic in nics
    ]
    try:
        chunk = PAYLOAD // CHUNKS
        expected = [
            torch.randint(0, 256, (PAYLOAD,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
            for n in range(len(nics))
        ]
        buffers = [e.clone() if rank == 0 else torch.zeros(PAYLOAD, dtype=torch.uint8) for e in expected]
        regions = [engine.register_tensor(buf) for engine, buf in zip(engines, buffers)]
        counters = [engine.imm_counter(100 + n) for n, engine in enumerate(engines)] if rank == 1 else []
        peers = [exchange(engine, [region.descriptor]) for engine, region in zip(engines, regions)]
        for n, (engine, nic) in enumerate(zip(engines, nics)):
            assert engine.domain_name == nic, (engine.domain_name, nic)
        report: dict[str, Any] = {"rank": rank, "domains": [e.domain_name for e in engines]}
        if rank == 0:
            futures = [
                engine.submit_write(
                    regions[n],
                    peers[n][1].descriptors[0],
                    chunk,
                    src_offset=i * chunk,
                    dst_offset=i * chunk,
                    imm=100 + n,
                )  # fmt: skip
                for n, engine in enumerate(engines)
                for i in range(CHUNKS)
            ]
            for f in futures:
                f.result(timeout=60)
        else:
            for n, counter in enumerate(counters):
                counter.wait(CHUNKS, timeout=60)
                assert counter.value == 0
                assert torch.equal(buffers[n], expected[n]), f"bytes differ on {nics[n]}"
            report["verified"] = [PAYLOAD] * len(nics)
        dist.barrier()
        return report
    finally:
        for engine in engines:
            engine.stop()
        dist.destroy_process_group()


@pytest.mark.netns
@pytest.mark.timeout(120)
def test_transfer_engine_per_nic_across_hosts() -> None:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    with tb.TestBed(hosts=2, nics=2, prefix=PREFIX) as bed:
        ok = bed.run(
            0, [sys.executable, "-c", "import fabric_lib; print(sorted(set(fabric_lib.list_providers())))"]
        )
        for nic in ("nic0", "nic1"):
            assert f"('tcp;ofi_rxm', '{nic}')" in ok.stdout, ok.stdout
        before = [bed.nic_counters(h) for h in range(2)]
        with host_ranks(bed, env={"FI_TCP_IFACE": None, "OMP_NUM_THREADS": "1"}) as ranks:
            reports = gather(ranks.submit_all(engine_per_nic), timeout=90)
        after = [bed.nic_counters(h) for h in range(2)]
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["domains"] == ["nic0", "nic1"], report
    assert reports[1]["verified"] == [4194304, 4194304], reports[1]
    for nic in ("nic0", "nic1"):
        sent = after[0][nic]["tx_bytes"] - before[0][nic]["tx_bytes"]
        received = after[1][nic]["rx_bytes"] - before[1][nic]["rx_bytes"]
        assert sent > PAYLOAD, (nic, sent)
        assert received > PAYLOAD, (nic, received)
    # nic1 carries only the fabric traffic (gloo uses nic0), so it is close to the payload.
    assert after[0]["nic1"]["tx_bytes"] - before[0]["nic1"]["tx_bytes"] < PAYLOAD * 1.2


# -- (3) teardown after an exception, a signal, and SIGKILL ------------------------------------


@pytest.mark.netns
@pytest.mark.timeout(60)
def test_teardown_after_exception_in_body() -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with tb.TestBed(hosts=2, nics=2, prefix=PREFIX) as bed:
            tag = bed.tag
            sleeper = bed.spawn(0, ["sleep", "60"])
            assert _leftovers(tag)[0]
            raise Boom()
    assert sleeper.poll() is not None, "spawned processes are killed on teardown"
    _assert_gone(tag)

    # A failing rank makes run_all kill the others and raise, with every output.
    with tb.TestBed(hosts=3, nics=1, prefix=PREFIX) as bed:
        tag = bed.tag
        start = time.monotonic()
        with pytest.raises(tb.RunError) as info:
            bed.run_all("if [ {rank} = 1 ]; then echo bad >&2; exit 3; fi; sleep 60", timeout=30)
        assert time.monotonic() - start < 10
        codes = {r.rank: (r.returncode, r.killed) for r in info.value.results}
        assert codes == {0: (None, True), 1: (3, False), 2: (None, True)}
        assert "bad" in info.value.results[1].stderr
    _assert_gone(tag)


_CHILD = textwrap.dedent(
    """
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("tbchild", sys.argv[1])
    tb = importlib.util.module_from_spec(spec); sys.modules["tbchild"] = tb; spec.loader.exec_module(tb)
    bed = tb.TestBed(hosts=2, nics=2, prefix=sys.argv[2]).up()
    bed.spawn(1, ["sleep", "60"])
    print(bed.tag, flush=True)
    time.sleep(60)
    """
)


@pytest.mark.netns
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL], ids=lambda s: s.name
)
def test_teardown_when_interrupted(sig: signal.Signals) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, tb.__file__, PREFIX], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        tag = child.stdout.readline().strip()
        assert tag, "child did not bring its test bed up"
        assert len(_leftovers(tag)[0]) == 3
        child.send_signal(sig)
        child.wait(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if sig == signal.SIGKILL:  # no handler can run: the names stay until cleanup_stale
        expected = {f"{PREFIX}-{tag}-{x}" for x in ("h0", "h1", "hub")}
        left = set(_leftovers(tag)[0])
        assert left <= expected
        removed = set(tb.cleanup_stale(PREFIX))  # (a concurrent run's fixture may have done it)
        assert left <= removed, (left, removed)
    else:
        assert child.returncode != 0
    _assert_gone(tag)
