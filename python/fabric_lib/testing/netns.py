"""A multi-host test bed made of Linux network namespaces (root only, no RDMA hardware needed).

Topology of ``TestBed(hosts=H, nics=K)``::

    host namespace <prefix>-<tag>-h0        hub namespace <prefix>-<tag>-hub
      lo, nic0 198.18.0.1/24  ---- veth ---- h0n0 --+-- br0   (subnet 0: 198.18.0.0/24)
          nic1 198.18.1.1/24  ---- veth ---- h0n1 --|-+ br1   (subnet 1: 198.18.1.0/24)
    host namespace <prefix>-<tag>-h1                | |
      lo, nic0 198.18.0.2/24  ---- veth ---- h1n0 --+ |
          nic1 198.18.1.2/24  ---- veth ---- h1n1 ----+

Every "host" is a network namespace with K veth "NICs" (``nic0`` .. ``nic{K-1}``); NIC ``i`` of
every host plugs into bridge ``br{i}`` of a hub namespace, so NIC ``i`` of all hosts share subnet
``i``. Addresses come only from 198.18.0.0/15 (RFC 2544 benchmarking range): NIC ``n`` of host ``h``
is ``198.18.0.0 + 256 * n + h + 1`` with a /24, i.e. 198.18.<n>.<h+1> for n < 256 and
198.19.<n-256>.<h+1> above. Nothing is created in the caller's namespace: both veth ends are
created directly inside the hub and host namespaces, so deleting the namespaces removes every link.

Teardown runs on ``close()``/``__exit__`` (also when the body raises), at interpreter exit (atexit)
and on SIGTERM/SIGHUP (the handlers chain to the previous ones). Names carry the owner's pid, so
concurrent runs do not clash, and ``cleanup_stale(prefix)`` removes leftovers of dead owners
(e.g. after SIGKILL).

Processes started with ``spawn``/``run_all`` get environment variables describing their host
(``FABRIC_LIB_TESTBED_*``), ``GLOO_SOCKET_IFNAME=nic0`` (gloo would otherwise resolve the machine's
hostname to an address that does not exist inside the namespace) and ``MASTER_ADDR``/``MASTER_PORT``
/``RANK``/``WORLD_SIZE`` for ``torch.distributed`` (rank 0 is host 0, reachable at 198.18.0.1).

This module uses only the standard library and iproute2's ``ip``; it can be loaded without the
compiled extension.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

if TYPE_CHECKING or __package__:
    from ..errors import FabricError, InvalidArgumentError
else:  # loaded as a standalone file (see above): errors.py is plain Python, load it beside us
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "fabric_lib_errors", Path(__file__).parents[1] / "errors.py"
    )
    assert _spec is not None and _spec.loader is not None
    _errors = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_errors)
    FabricError, InvalidArgumentError = _errors.FabricError, _errors.InvalidArgumentError

__all__ = [
    "ADDRESS_RANGE",
    "DEFAULT_PORT",
    "ENV_ADDRS",
    "ENV_BOOTSTRAP",
    "ENV_HOST",
    "ENV_NICS",
    "ENV_NS",
    "ENV_WORLD",
    "ProcResult",
    "RunError",
    "TestBed",
    "TestBedError",
    "available",
    "cleanup_stale",
    "list_namespaces",
]

#: Every address the test bed assigns lies in this range (RFC 2544, 198.18.0.0 - 198.19.255.255).
ADDRESS_RANGE = ipaddress.IPv4Network("198.18.0.0/15")
#: Default rendezvous port on the bootstrap address (host 0, nic0) for torch.distributed.
DEFAULT_PORT = 29500

ENV_NICS = "FABRIC_LIB_TESTBED_NICS"  # "nic0,nic1": this host's interface names
ENV_ADDRS = "FABRIC_LIB_TESTBED_ADDRS"  # "198.18.0.1,198.18.1.1": their addresses, same order
ENV_HOST = "FABRIC_LIB_TESTBED_HOST"  # host index
ENV_NS = "FABRIC_LIB_TESTBED_NS"  # namespace name
ENV_WORLD = "FABRIC_LIB_TESTBED_WORLD"  # number of hosts
ENV_BOOTSTRAP = "FABRIC_LIB_TESTBED_BOOTSTRAP"  # rank-0 address (host 0's nic0)

_MAX_HOSTS = 254
_MAX_NICS = ADDRESS_RANGE.num_addresses // 256  # 512 /24 subnets in the /15
_IFNAMSIZ = 15
_PREFIX_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,15}$")
_TAG_RE = re.compile(r"^[A-Za-z0-9]+$")


class TestBedError(FabricError, RuntimeError):
    """An ``ip`` command failed or timed out, or the test bed cannot be used here."""

    __test__ = False  # not a pytest test class


@dataclass
class ProcResult:
    """One process of ``TestBed.run_all``: where it ran, how it ended and what it printed."""

    __test__ = False

    host: int
    rank: int
    argv: list[str]
    returncode: int | None  # None: killed by the test bed (timeout or another rank failed)
    stdout: str
    stderr: str
    killed: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class TestBedIndexError(InvalidArgumentError, IndexError):
    """A host or NIC index or name that the test bed does not have."""


class RunError(TestBedError):
    """``run_all`` failed: a process exited non-zero or the run timed out; ``results`` has all."""

    def __init__(self, message: str, results: list[ProcResult]) -> None:
        super().__init__(message)
        self.results = results


# -- ip(8) -----------------------------------------------------------------------------------


def _ip(
    args: Sequence[str], *, timeout: float = 10.0, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs ``ip ARGS``; raises TestBedError with the command and its stderr on failure."""
    return _run(["ip", *args], timeout=timeout, check=check, stdin=stdin)


def _run(
    cmd: Sequence[str], *, timeout: float = 10.0, check: bool = True, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(
            list(cmd), input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError as e:
        raise TestBedError(f"`{cmd[0]}` not found (install iproute2): {e}") from None
    except subprocess.TimeoutExpired:
        raise TestBedError(f"`{shlex.join(cmd)}` timed out after {timeout:g}s") from None
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        where = f"\n--- input ---\n{stdin.rstrip()}" if stdin else ""
        raise TestBedError(f"`{shlex.join(cmd)}` failed (exit {proc.returncode}): {detail}{where}")
    return proc


def _ip_batch(netns: str | None, lines: Iterable[str], *, timeout: float = 20.0) -> None:
    """Runs many ip commands in one process (``ip [-n NS] -batch -``); stops at the first error."""
    text = "".join(line + "\n" for line in lines)
    if text:
        _ip([*(["-n", netns] if netns else []), "-batch", "-"], stdin=text, timeout=timeout)


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = _ip(["netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@lru_cache(maxsize=None)
def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, f"network namespaces need root (euid {os.geteuid()})"
    if shutil.which("ip") is None:
        return False, "iproute2 `ip` is not on PATH"
    name = f"{_PROBE_PREFIX}-{os.getpid()}-{time.monotonic_ns() % 1_000_000}"
    _install_handlers()
    _scratch.add(name)  # deleted by the exit/signal handlers if we die right here
    try:
        _ip(["netns", "add", name])
        try:
            _ip_batch(
                name,
                [
                    "link set lo up",
                    "link add probebr type bridge",
                    "link add probea type veth peer name probeb",
                    "link set probea master probebr",
                ],
            )
        finally:
            _ip(["netns", "del", name], check=False)
            _scratch.discard(name)
    except TestBedError as e:
        return False, f"cannot create network namespaces, veths and bridges here: {e}"
    return True, "ok"


def available() -> tuple[bool, str]:
    """(True, "ok") when this process can build a test bed, else (False, why not).

    Needs Linux, root, iproute2, and a kernel with netns, veth and bridge support; probed once by
    creating and deleting a scratch namespace.
    """
    return _probe()


# -- teardown on exit and on signals ---------------------------------------------------------

_registry_lock = threading.RLock()  # re-entrant: a signal handler may run while it is held
_live: dict[int, TestBed] = {}
_handlers_installed = False
_previous_handlers: dict[int, Any] = {}
_TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_PROBE_PREFIX = "flprobe"
_scratch: set[str] = set()  # namespaces of the availability probe, while it runs


def _teardown_all() -> None:
    for name in list(_scratch):
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10, check=False)
        _scratch.discard(name)
    with _registry_lock:
        beds = list(_live.values())
    for bed in beds:
        if bed._owner_pid == os.getpid():  # never tear down a parent's bed from a forked child
            try:
                bed.close(raise_errors=False)
            except Exception:  # noqa: BLE001 - best effort at exit
                pass


def _on_signal(signum: int, frame: Any) -> None:
    _teardown_all()
    previous = _previous_handlers.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:  # SIG_DFL (or unknown): die of the same signal, as without us
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    global _handlers_installed
    if _handlers_installed or threading.current_thread() is not threading.main_thread():
        return  # signal.signal only works on the main thread; atexit still covers us
    for sig in _TEARDOWN_SIGNALS:
        try:
            _previous_handlers[sig] = signal.signal(sig, _on_signal)
        except (ValueError, OSError):
            pass
    _handlers_installed = True


atexit.register(_teardown_all)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_pids(netns: str) -> None:
    out = _ip(["netns", "pids", netns], check=False).stdout
    for token in out.split():
        try:
            os.kill(int(token), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def cleanup_stale(prefix: str = "fl", *, force: bool = False) -> list[str]:
    """Deletes namespaces left by test beds with ``prefix`` whose owner process is gone.

    Test-bed namespaces are named ``<prefix>-<pid>x<n>-h<i>`` / ``<prefix>-<pid>x<n>-hub``. With
    ``force=True`` every test-bed namespace of ``prefix`` is deleted, including live ones and ones
    made with an explicit tag (``scripts/netns_testbed.py up``); test beds open in this process are
    never touched. Processes still inside a deleted namespace are killed. Returns the names deleted.
    """
    _check_prefix(prefix)
    pattern = re.compile(rf"^{re.escape(prefix)}-([A-Za-z0-9]+)-(hub|h\d+)$")
    with _registry_lock:
        mine = {ns for bed in _live.values() for ns in bed.all_namespaces}
    probe = re.compile(rf"^{_PROBE_PREFIX}-(\d+)-\d+$")
    removed = []
    for name in list_namespaces():
        m = probe.match(name)
        if m and not _pid_alive(int(m.group(1))) and name not in _scratch:
            if _ip(["netns", "del", name], check=False).returncode == 0:
                removed.append(name)
            continue
        m = pattern.match(name)
        if not m or name in mine:
            continue
        owner = re.fullmatch(r"(\d+)x\d+", m.group(1))
        if not force and (owner is None or _pid_alive(int(owner.group(1)))):
            continue
        _kill_namespace_pids(name)
        if _ip(["netns", "del", name], check=False).returncode == 0:
            removed.append(name)
    return removed


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix):
        raise InvalidArgumentError(
            f"prefix must be 1-16 letters/digits starting with a letter, got {prefix!r}"
        )


# -- the test bed ----------------------------------------------------------------------------


class TestBed:
    """H hosts (network namespaces) with K NICs each, NIC i of every host on subnet i.

    Use as a context manager (``with TestBed(hosts=2, nics=2) as bed:``) or call ``up()`` and
    ``close()``. Args:
        hosts: number of host namespaces (1..254).
        nics: NICs per host (1..512); NIC i is named ``f"{nic_prefix}{i}"``.
        prefix: first part of every namespace name (letters/digits); names are
            ``<prefix>-<tag>-h<i>`` and ``<prefix>-<tag>-hub``.
        tag: unique part of the names; default ``<pid>x<n>`` (what ``cleanup_stale`` recognises).
        mtu: MTU of the NICs (default: the veth default, 1500).
        ipv6: keep IPv6 on in the namespaces (default off: no link-local addresses, so libfabric
            lists one IPv4 entry per NIC, and the byte counters see only the traffic you make).
        keep: do not tear down at exit or on signals (for the CLI's ``up``); ``close()`` still does.
        timeout: seconds allowed for each ``ip`` invocation.
    """

    __test__ = False  # keeps pytest from collecting this class where it is imported into tests

    _seq = 0
    _seq_lock = threading.Lock()

    def __init__(
        self,
        hosts: int = 2,
        nics: int = 1,
        prefix: str = "fl",
        *,
        tag: str | None = None,
        nic_prefix: str = "nic",
        mtu: int | None = None,
        ipv6: bool = False,
        keep: bool = False,
        timeout: float = 10.0,
    ) -> None:
        _check_prefix(prefix)
        if not 1 <= hosts <= _MAX_HOSTS:
            raise InvalidArgumentError(f"hosts must be in 1..{_MAX_HOSTS}, got {hosts}")
        if not 1 <= nics <= _MAX_NICS:
            raise InvalidArgumentError(f"nics must be in 1..{_MAX_NICS}, got {nics}")
        if len(f"{nic_prefix}{nics - 1}") > _IFNAMSIZ or not re.fullmatch(
            r"[A-Za-z][A-Za-z0-9_]*", nic_prefix
        ):
            raise InvalidArgumentError(
                f"bad nic_prefix {nic_prefix!r} (letters/digits, names up to {_IFNAMSIZ} chars)"
            )
        if tag is None:
            with TestBed._seq_lock:
                tag = f"{os.getpid()}x{TestBed._seq}"
                TestBed._seq += 1
        elif not _TAG_RE.match(tag):
            raise InvalidArgumentError(f"tag must be letters/digits, got {tag!r}")
        self.hosts = hosts
        self.num_nics = nics
        self.prefix = prefix
        self.tag = tag
        self.mtu = mtu
        self.ipv6 = ipv6
        self.keep = keep
        self.timeout = timeout
        self.nics: list[str] = [f"{nic_prefix}{i}" for i in range(nics)]
        self.hub = f"{prefix}-{tag}-hub"
        self.namespaces: list[str] = [f"{prefix}-{tag}-h{h}" for h in range(hosts)]
        self._owner_pid = os.getpid()
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._lock = threading.RLock()
        self._state = "new"  # new -> up -> closed

    # -- names and addresses ----------------------------------------------------------------
    @property
    def all_namespaces(self) -> list[str]:
        """Every namespace of this bed: the hosts, then the hub."""
        return [*self.namespaces, self.hub]

    def ns(self, host: int) -> str:
        """Namespace name of ``host``."""
        return self.namespaces[self._host(host)]

    def nic(self, nic: int | str) -> str:
        """Interface name of NIC ``nic`` (index or name)."""
        return self.nics[self._nic(nic)]

    def addr(self, host: int, nic: int | str = 0) -> str:
        """IPv4 address of ``host``'s NIC ``nic``: 198.18.<nic>.<host+1> (198.19.* past 255 NICs)."""
        n, h = self._nic(nic), self._host(host)
        return str(ADDRESS_RANGE.network_address + 256 * n + h + 1)

    def subnet(self, nic: int | str) -> str:
        """The /24 that NIC ``nic`` of every host is on."""
        base = ADDRESS_RANGE.network_address + 256 * self._nic(nic)
        return str(ipaddress.IPv4Network(f"{base}/24"))

    def addrs(self, host: int) -> list[str]:
        """Addresses of all of ``host``'s NICs, in NIC order."""
        return [self.addr(host, n) for n in range(self.num_nics)]

    @property
    def bootstrap_addr(self) -> str:
        """Rank 0's rendezvous address: host 0's nic0 (198.18.0.1)."""
        return self.addr(0, 0)

    def init_method(self, port: int = DEFAULT_PORT, host: int = 0) -> str:
        """``tcp://198.18.0.1:PORT``, for ``torch.distributed.init_process_group(init_method=...)``."""
        return f"tcp://{self.addr(host, 0)}:{port}"

    def _host(self, host: int) -> int:
        if not isinstance(host, int) or not 0 <= host < self.hosts:
            raise TestBedIndexError(f"host must be in 0..{self.hosts - 1}, got {host!r}")
        return host

    def _nic(self, nic: int | str) -> int:
        if isinstance(nic, str):
            if nic not in self.nics:
                raise TestBedIndexError(f"no NIC {nic!r} (NICs: {', '.join(self.nics)})")
            return self.nics.index(nic)
        if not 0 <= nic < self.num_nics:
            raise TestBedIndexError(f"nic must be in 0..{self.num_nics - 1}, got {nic!r}")
        return nic

    # -- lifecycle --------------------------------------------------------------------------
    def up(self) -> TestBed:
        """Creates the namespaces, bridges and NICs. Idempotent; cleans up after itself on error."""
        with self._lock:
            if self._state == "up":
                return self
            if self._state == "closed":
                raise TestBedError("this test bed was closed; make a new one")
            ok, why = available()
            if not ok:
                raise TestBedError(why)
            taken = set(self.all_namespaces) & set(list_namespaces())
            if taken:
                raise TestBedError(f"namespaces already exist: {', '.join(sorted(taken))}")
            if not self.keep:
                with _registry_lock:
                    _live[id(self)] = self
                _install_handlers()
            self._state = "up"
            try:
                self._build()
            except BaseException:
                self.close(raise_errors=False)
                raise
            return self

    def _build(self) -> None:
        t = self.timeout
        for name in self.all_namespaces:
            self._created.append(name)  # recorded first: a failed add is harmless to delete
            _ip(["netns", "add", name], timeout=t)
        if not self.ipv6:
            for name in self.all_namespaces:
                # Before any NIC exists, so none gets an IPv6 link-local address. Best effort:
                # the sysctl is absent when the kernel runs without IPv6.
                _run(
                    ["ip", "netns", "exec", name, "sysctl", "-q", "-w",
                     "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
                    timeout=t, check=False,
                )  # fmt: skip
        mtu = "" if self.mtu is None else f" mtu {int(self.mtu)}"
        hub = ["link set lo up"]
        for n in range(self.num_nics):
            # No multicast snooping: the bridge would otherwise send IGMP reports into the NICs.
            hub += [f"link add br{n}{mtu} type bridge mcast_snooping 0", f"link set br{n} up"]
        for h, name in enumerate(self.namespaces):
            for n, nic in enumerate(self.nics):
                port = f"h{h}n{n}"
                hub += [
                    f"link add {port}{mtu} type veth peer name {nic}{mtu} netns {name}",
                    f"link set {port} master br{n}",
                    f"link set {port} up",
                ]
        _ip_batch(self.hub, hub, timeout=t + 0.01 * len(hub))
        for h, name in enumerate(self.namespaces):
            lines = ["link set lo up"]
            for n, nic in enumerate(self.nics):
                lines += [f"addr add {self.addr(h, n)}/24 dev {nic}", f"link set {nic} up"]
            _ip_batch(name, lines, timeout=t)
        self._wait_carrier()

    def _wait_carrier(self, timeout: float = 5.0) -> None:
        """Waits until every host NIC reports operstate "up" (veth carrier follows the peer)."""
        deadline = time.monotonic() + timeout
        pending = list(range(self.hosts))
        while pending:
            still = []
            for h in pending:
                out = _ip(["-n", self.ns(h), "-o", "link", "show"], timeout=self.timeout).stdout
                states = {
                    m.group(1): m.group(2)
                    for m in re.finditer(r"^\d+: ([^@:]+)(?:@\S+)?: .*? state (\S+)", out, re.M)
                }
                if any(states.get(nic) != "UP" for nic in self.nics):
                    still.append(h)
            pending = still
            if pending and time.monotonic() > deadline:
                raise TestBedError(f"NICs of hosts {pending} did not come up within {timeout:g}s")
            if pending:
                time.sleep(0.02)

    def close(self, *, raise_errors: bool = True) -> list[str]:
        """Kills the processes spawned here and deletes every namespace (and so every link).

        Idempotent. Returns the error messages (raises TestBedError with them when
        ``raise_errors``). A namespace that a still-running process (one not started by
        ``spawn``) keeps alive disappears from ``ip netns list`` at once and from the kernel
        when that process exits; processes found in it with ``ip netns pids`` are killed.
        """
        # Re-entrant on purpose: a SIGTERM arriving while close() runs calls close() again from
        # the signal handler (same thread), which then finishes the remaining work before the
        # process dies; so the work list shrinks one item at a time instead of being cleared.
        with self._lock:
            self._state = "closed"
            errors: list[str] = []
            procs = [p for p in self._procs if p.poll() is None]
            for p in procs:
                _kill_group(p)
            for p in procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    errors.append(f"process {p.pid} survived SIGKILL")
            while self._created:
                name = self._created[-1]
                try:
                    _kill_namespace_pids(name)  # anything started there by other means
                    proc = _ip(["netns", "del", name], timeout=self.timeout, check=False)
                    if proc.returncode != 0 and name in list_namespaces():
                        errors.append(f"ip netns del {name}: {proc.stderr.strip()}")
                except TestBedError as e:
                    errors.append(str(e))
                if self._created and self._created[-1] == name:
                    self._created.pop()
            with _registry_lock:
                _live.pop(id(self), None)
            if errors and raise_errors:
                raise TestBedError("test bed teardown incomplete: " + "; ".join(errors))
            return errors

    def __enter__(self) -> TestBed:
        return self.up()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Never mask the body's exception with a teardown error.
        errors = self.close(raise_errors=exc_type is None)
        if errors:
            print(f"netns testbed: teardown errors: {errors}", file=sys.stderr)

    def __repr__(self) -> str:
        return f"TestBed(hosts={self.hosts}, nics={self.num_nics}, tag={self.tag!r}, state={self._state})"

    def describe(self) -> str:
        """A human-readable table of hosts, namespaces and addresses."""
        rows = [
            f"test bed {self.prefix}-{self.tag}: {self.hosts} hosts x {self.num_nics} NICs, hub {self.hub}"
        ]
        for h in range(self.hosts):
            nics = "  ".join(f"{nic}={self.addr(h, n)}/24" for n, nic in enumerate(self.nics))
            rows.append(f"  host {h}: {self.ns(h)}  {nics}")
        rows.append(f"  bootstrap (rank 0): {self.bootstrap_addr}  e.g. {self.init_method()}")
        return "\n".join(rows)

    # -- processes --------------------------------------------------------------------------
    def host_env(self, host: int, *, rank: int | None = None, world: int | None = None,
                 bootstrap_host: int = 0, port: int = DEFAULT_PORT) -> dict[str, str]:  # fmt: skip
        """The environment variables a process on ``host`` gets (see the module docstring)."""
        h = self._host(host)
        rank = h if rank is None else rank
        world = self.hosts if world is None else world
        master = self.addr(bootstrap_host, 0)
        return {
            ENV_HOST: str(h),
            ENV_NS: self.ns(h),
            ENV_WORLD: str(world),
            ENV_NICS: ",".join(self.nics),
            ENV_ADDRS: ",".join(self.addrs(h)),
            ENV_BOOTSTRAP: master,
            # gloo/tensorpipe pick their interface from the hostname otherwise, which resolves to
            # an address that does not exist inside the namespace.
            "GLOO_SOCKET_IFNAME": self.nics[0],
            "TP_SOCKET_IFNAME": self.nics[0],
            "MASTER_ADDR": master,
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }

    def spawn(
        self,
        host: int,
        argv: Sequence[str],
        *,
        env: Mapping[str, str | None] | None = None,
        rank: int | None = None,
        world: int | None = None,
        port: int = DEFAULT_PORT,
        **popen_kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Starts ``argv`` inside ``host``'s namespace (``ip netns exec NS argv...``).

        The environment is this process's, plus ``host_env(host)``, plus ``env`` (a None value
        removes a variable). The process leads its own session, so the test bed can kill it and
        its children; it is killed on ``close()``. Other keyword arguments go to ``Popen``.
        """
        self._require_up()
        full_env = dict(os.environ)
        full_env.update(self.host_env(host, rank=rank, world=world, port=port))
        for key, value in (env or {}).items():
            if value is None:
                full_env.pop(key, None)
            else:
                full_env[key] = str(value)
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *argv], env=full_env, **popen_kwargs)
        with self._lock:
            self._procs.append(proc)
        return proc

    def run(
        self, host: int, argv: Sequence[str], *, timeout: float = 30.0, check: bool = True,
        env: Mapping[str, str | None] | None = None,
    ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Runs ``argv`` on ``host`` to completion; returns its CompletedProcess (text output)."""
        proc = self.spawn(host, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            raise TestBedError(
                f"{shlex.join(argv)} on host {host} timed out after {timeout:g}s\n{err}"
            ) from None
        result = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise TestBedError(f"{shlex.join(argv)} on host {host} exited {proc.returncode}: {err.strip()}")
        return result

    def placeholders(self, host: int, rank: int, world: int, *, port: int = DEFAULT_PORT,
                     bootstrap_host: int = 0) -> dict[str, str]:  # fmt: skip
        """The values ``run_all`` substitutes for ``{name}`` in argument templates."""
        master = self.addr(bootstrap_host, 0)
        return {
            "host": str(host),  # host index
            "ns": self.ns(host),  # namespace name
            "rank": str(rank),
            "world": str(world),
            "addr": master,  # rank 0's bootstrap address (198.18.0.1)
            "port": str(port),
            "init": f"tcp://{master}:{port}",
            "self": self.addr(host, 0),  # this host's nic0 address
            "addrs": ",".join(self.addrs(host)),
            "nics": ",".join(self.nics),
        }

    def run_all(
        self,
        argv_template: Sequence[str] | str,
        *,
        hosts: Sequence[int] | None = None,
        timeout: float = 60.0,
        env: Mapping[str, str | None] | None = None,
        port: int = DEFAULT_PORT,
        check: bool = True,
        cwd: str | None = None,
        kill_grace: float = 2.0,
    ) -> list[ProcResult]:
        """Runs one process per host (rank = position in ``hosts``, default all) and waits for all.

        ``argv_template`` is a list of arguments, or a string run with ``sh -c``; in it
        ``{host} {ns} {rank} {world} {addr} {port} {init} {self} {addrs} {nics}`` are replaced
        (see ``placeholders``; other braces are left alone). As soon as one process exits
        non-zero, or ``timeout`` passes, the others are sent SIGTERM, then SIGKILL after
        ``kill_grace`` seconds. Returns one ProcResult per process, in rank order; with ``check``
        raises RunError (holding them) unless every process exited 0.
        """
        self._require_up()
        hosts = list(range(self.hosts)) if hosts is None else [self._host(h) for h in hosts]
        if not hosts:
            raise InvalidArgumentError("run_all needs at least one host")
        world = len(hosts)
        started: list[tuple[int, int, list[str], subprocess.Popen[Any], Any, Any]] = []
        try:
            for rank, h in enumerate(hosts):
                values = self.placeholders(h, rank, world, port=port, bootstrap_host=hosts[0])
                argv = _fill(argv_template, values)
                out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
                proc = self.spawn(
                    h, argv, env=env, rank=rank, world=world, port=port,
                    stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd,
                )  # fmt: skip
                started.append((h, rank, argv, proc, out, err))
            failed, timed_out = self._wait_all([s[3] for s in started], timeout)
        except BaseException:
            for s in started:
                _kill_group(s[3])
            raise
        finally:
            killed = _stop_all([s[3] for s in started], kill_grace)
        results = []
        for h, rank, argv, proc, out, err in started:
            results.append(
                ProcResult(
                    host=h,
                    rank=rank,
                    argv=argv,
                    returncode=None if proc in killed else proc.returncode,
                    stdout=_read(out),
                    stderr=_read(err),
                    killed=proc in killed,
                )  # fmt: skip
            )
        if check and (timed_out or any(not r.ok for r in results)):
            why = f"timed out after {timeout:g}s" if timed_out else f"rank {failed} exited non-zero"
            raise RunError(f"run_all {why}:\n" + _summarise(results), results)
        return results

    def _wait_all(self, procs: list[subprocess.Popen[Any]], timeout: float) -> tuple[int | None, bool]:
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            for rank, code in enumerate(codes):
                if code is not None and code != 0:
                    return rank, False
            if all(code is not None for code in codes):
                return None, False
            if time.monotonic() > deadline:
                return None, True
            time.sleep(0.02)

    def _require_up(self) -> None:
        if self._state != "up":
            raise TestBedError(f"test bed is {self._state}; use it inside `with` or after up()")

    # -- observation and faults -------------------------------------------------------------
    def nic_counters(self, host: int) -> dict[str, dict[str, int]]:
        """Byte and packet counters of ``host``'s NICs, read from /sys/class/net inside its
        namespace: ``{"nic0": {"tx_bytes": .., "rx_bytes": .., "tx_packets": .., "rx_packets": ..}}``.
        """
        self._require_up()
        keys = ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")
        files = [f"/sys/class/net/{nic}/statistics/{k}" for nic in self.nics for k in keys]
        out = _run(["ip", "netns", "exec", self.ns(host), "cat", *files], timeout=self.timeout).stdout.split()
        if len(out) != len(files):
            raise TestBedError(f"unexpected counter output from {self.ns(host)}: {out!r}")
        values = iter(int(v) for v in out)
        return {nic: {k: next(values) for k in keys} for nic in self.nics}

    def set_link(self, host: int, nic: int | str, up: bool, *, side: str = "host") -> None:
        """Sets ``host``'s NIC administratively up or down (``ip link set nicN down``).

        ``side="switch"`` instead toggles the hub's end of the cable: the host's NIC stays
        configured but loses carrier (like pulling the cable).
        """
        self._require_up()
        n = self._nic(nic)
        if side == "host":
            _ip(
                ["-n", self.ns(host), "link", "set", self.nics[n], "up" if up else "down"],
                timeout=self.timeout,
            )
        elif side == "switch":
            _ip(["-n", self.hub, "link", "set", f"h{self._host(host)}n{n}", "up" if up else "down"],
                timeout=self.timeout)  # fmt: skip
        else:
            raise InvalidArgumentError(f"side must be 'host' or 'switch', got {side!r}")

    def verify_connectivity(self, *, port: int = DEFAULT_PORT - 1, timeout: float = 20.0) -> None:
        """Checks that every host reaches every other host on every NIC subnet over TCP.

        Each host listens on ``port`` and connects from each of its NIC addresses to the same NIC
        of every other host; the listener answers with its host index, which the connector
        checks. Raises RunError when any pair fails.
        """
        argv = [sys.executable, "-c", _PROBE_SCRIPT, "{host}", str(port), str(timeout * 0.8)]
        peers = ";".join(
            ",".join(f"{o}@{self.addr(o, n)}@{self.addr(h, n)}" for o in range(self.hosts) if o != h for n in range(self.num_nics))
            for h in range(self.hosts)
        )  # fmt: skip
        self.run_all(argv, timeout=timeout, env={"FABRIC_LIB_TESTBED_PROBE": peers})


# -- helpers ---------------------------------------------------------------------------------

_PLACEHOLDER_RE = re.compile(r"\{(\w+)\}")


def _fill(template: Sequence[str] | str, values: Mapping[str, str]) -> list[str]:
    def sub(text: str) -> str:
        return _PLACEHOLDER_RE.sub(lambda m: values.get(m.group(1), m.group(0)), text)

    if isinstance(template, str):
        return ["sh", "-c", sub(template)]
    return [sub(str(arg)) for arg in template]


def _kill_group(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)  # spawn() makes each process a session (and group) leader
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _stop_all(procs: list[subprocess.Popen[Any]], grace: float) -> set[subprocess.Popen[Any]]:
    """SIGTERM to the running ones, SIGKILL after ``grace``; returns those that had to be stopped."""
    running = {p for p in procs if p.poll() is None}
    for p in running:
        _kill_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_group(p, signal.SIGKILL)
            p.wait()
    return running


def _read(f: Any) -> str:
    try:
        f.seek(0)
        return f.read().decode(errors="replace")
    finally:
        f.close()


def _summarise(results: list[ProcResult], tail: int = 2000) -> str:
    parts = []
    for r in results:
        state = "killed" if r.killed else f"exit {r.returncode}"
        parts.append(f"--- rank {r.rank} (host {r.host}) {state}: {shlex.join(r.argv)[:200]}")
        if r.stdout.strip():
            parts.append("stdout: " + r.stdout[-tail:].rstrip())
        if r.stderr.strip():
            parts.append("stderr: " + r.stderr[-tail:].rstrip())
    return "\n".join(parts)


# Run by verify_connectivity in every host: argv = [me, port, timeout]; env
# FABRIC_LIB_TESTBED_PROBE = per host ";"-separated lists of "peer@peer_addr@my_addr".
_PROBE_SCRIPT = r"""
import os, socket, sys, threading, time
me, port, timeout = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
todo = [t.split("@") for t in os.environ["FABRIC_LIB_TESTBED_PROBE"].split(";")[me].split(",") if t]
incoming = sum(1 for line in os.environ["FABRIC_LIB_TESTBED_PROBE"].split(";") for t in line.split(",")
               if t and t.split("@")[1] in os.environ["FABRIC_LIB_TESTBED_ADDRS"].split(","))
srv = socket.create_server(("0.0.0.0", port), backlog=256)
served = []
def serve():
    srv.settimeout(timeout)
    while len(served) < incoming:
        c, peer = srv.accept()
        c.sendall(str(me).encode()); c.close(); served.append(peer)
t = threading.Thread(target=serve, daemon=True); t.start()
deadline = time.monotonic() + timeout
for peer, addr, src in todo:
    while True:
        try:
            with socket.create_connection((addr, port), timeout=1, source_address=(src, 0)) as s:
                got = s.recv(16).decode()
            if got != peer:
                sys.exit(f"{src} -> {addr}: answered by host {got}, expected {peer}")
            break
        except OSError as e:
            if time.monotonic() > deadline:
                sys.exit(f"{src} -> {addr}:{port}: {e}")
            time.sleep(0.05)
t.join(max(0.0, deadline - time.monotonic()))
if len(served) < incoming:
    sys.exit(f"host {me}: only {len(served)}/{incoming} peers connected")
print(f"host {me}: reached {len(todo)} peer NICs, served {len(served)}")
"""
