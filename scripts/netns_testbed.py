#!/usr/bin/env python3
"""Multi-host test bed made of network namespaces (root only); see fabric_lib/testing/netns.py.

    python scripts/netns_testbed.py up --hosts 3 --nics 2      # create and leave up; prints names
    python scripts/netns_testbed.py status                     # list test-bed namespaces
    python scripts/netns_testbed.py down                       # delete every test bed of the prefix
    python scripts/netns_testbed.py run --hosts 2 --nics 2 -- python my_rank.py --rank {rank} \\
        --world {world} --init {init}                          # one process per host, then teardown

`run` placeholders: {host} (index) {ns} {rank} {world} {addr} (rank 0's address, 198.18.0.1)
{port} {init} (tcp://{addr}:{port}) {self} (own nic0 address) {addrs} {nics}. Each process also
gets FABRIC_LIB_TESTBED_NICS="nic0,nic1", FABRIC_LIB_TESTBED_ADDRS, MASTER_ADDR/MASTER_PORT/RANK/
WORLD_SIZE and GLOO_SOCKET_IFNAME=nic0. A single argument after `--` runs with `sh -c`.
Host h's NIC n has address 198.18.n.(h+1)/24; enter a host with `ip netns exec <ns> bash`.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path


def _load():
    """The module from this source tree when there (pure Python), else the installed package."""
    path = Path(__file__).resolve().parents[1] / "python" / "fabric_lib" / "testing" / "netns.py"
    if not path.exists():
        from fabric_lib.testing import netns

        return netns
    spec = importlib.util.spec_from_file_location("fabric_lib_testing_netns", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


tb = _load()


def _require_available() -> None:
    ok, why = tb.available()
    if not ok:
        sys.exit(f"netns_testbed: {why}")


def _ours(prefix: str) -> list[str]:
    return [n for n in tb.list_namespaces() if n.startswith(prefix + "-")]


def cmd_up(args: argparse.Namespace) -> int:
    _require_available()
    taken = {n.split("-")[1] for n in _ours(args.prefix)}
    tag = next(f"up{i}" for i in range(10_000) if f"up{i}" not in taken)
    bed = tb.TestBed(hosts=args.hosts, nics=args.nics, prefix=args.prefix, tag=tag, keep=True, mtu=args.mtu)
    bed.up()
    try:
        if args.check:
            bed.verify_connectivity()
    except BaseException:
        bed.close(raise_errors=False)
        raise
    print(bed.describe())
    print(
        f"  enter a host: ip netns exec {bed.ns(0)} bash;  remove: {sys.argv[0]} down --prefix {args.prefix}"
    )
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    _require_available()
    removed = tb.cleanup_stale(args.prefix, force=True)
    for name in removed:
        print(f"deleted {name}")
    left = _ours(args.prefix)
    if left:
        print(f"still there: {' '.join(left)}", file=sys.stderr)
        return 1
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    for name in _ours(args.prefix):
        print(name)
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    _require_available()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        sys.exit("netns_testbed run: give a command after --")
    template: list[str] | str = command[0] if len(command) == 1 else command
    with tb.TestBed(hosts=args.hosts, nics=args.nics, prefix=args.prefix, mtu=args.mtu) as bed:
        print(bed.describe(), file=sys.stderr)
        if args.check:
            bed.verify_connectivity()
        results = bed.run_all(template, timeout=args.timeout, port=args.port, check=False)
        counters = {h: bed.nic_counters(h) for h in range(bed.hosts)} if args.counters else {}
    status = 0
    for r in results:
        state = "killed" if r.killed else f"exit {r.returncode}"
        print(f"=== rank {r.rank} (host {r.host}): {state}")
        for stream, text in (("out", r.stdout), ("err", r.stderr)):
            for line in text.splitlines():
                print(f"[{r.rank}:{stream}] {line}")
        if not r.ok and status == 0:
            status = 124 if r.killed else (r.returncode or 1)
    for h, nics in counters.items():
        print(
            f"host {h} counters: "
            + "  ".join(f"{n} tx={c['tx_bytes']} rx={c['rx_bytes']}" for n, c in nics.items())
        )
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser, sizes: bool = True) -> None:
        p.add_argument("--prefix", default="fl", help="namespace name prefix (default fl)")
        if sizes:
            p.add_argument("--hosts", type=int, default=2)
            p.add_argument("--nics", type=int, default=1)
            p.add_argument("--mtu", type=int, default=None)
            p.add_argument("--check", action="store_true", help="verify TCP reachability on every NIC first")

    p = sub.add_parser("up", help="create a test bed and leave it up")
    common(p)
    p.set_defaults(fn=cmd_up)
    p = sub.add_parser("down", help="delete every test bed with the prefix (live ones too)")
    common(p, sizes=False)
    p.set_defaults(fn=cmd_down)
    p = sub.add_parser("status", help="list the prefix's namespaces")
    common(p, sizes=False)
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("run", help="run a command on every host of a fresh test bed, then tear down")
    common(p)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--port", type=int, default=tb.DEFAULT_PORT, help="rendezvous port for {port}/{init}")
    p.add_argument("--counters", action="store_true", help="print NIC byte counters at the end")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_run)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except tb.TestBedError as e:
        print(f"netns_testbed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
