"""The one rank launcher of the tests and benchmarks: processes that run the functions they are sent.

A rank is a process joined to the launcher by a multiprocessing Pipe. It first runs an optional
``setup`` function, whose return value is its *state*; then it runs each function sent to it as
``fn(state, *args, **kwargs)`` and answers with the return value, or with the traceback of what
it raised (``RankError`` in the launcher). Functions travel by reference (pickle): a module-level
function of an importable module, a test module included (ranks get the launcher's ``sys.path``
and main module, as multiprocessing's spawn does), never a lambda or closure.

A rank is placed either as a spawned child of this process (``spawn_ranks``; the spawn start
method, so no process holding libfabric or CUDA state is forked) or on a host of a network-namespace
test bed (``host_ranks``), where the same loop runs inside the host's namespace. Every rank knows
its ``RankInfo`` (``this_rank()``), from which ``init_process_group`` joins the ranks' process
group. Ranks die with the launcher (``PR_SET_PDEATHSIG``), every wait is bounded, and a rank that
does not exit when asked is killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.spawn
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from ..errors import FabricError, InvalidArgumentError

if TYPE_CHECKING:
    from .netns import TestBed

S = TypeVar("S")
R = TypeVar("R")
P = ParamSpec("P")

#: Seconds a call waits for its answer unless told otherwise.
DEFAULT_TIMEOUT = 60.0
# A rank waits this long for its next command before it takes the launcher for gone and exits.
IDLE_EXIT_S = 600.0
_CTX = mp.get_context("spawn")


class RankError(FabricError, RuntimeError):
    """A function raised in a rank (the message holds the rank's traceback), or the rank died or
    did not answer in time."""


@dataclass(frozen=True)
class RankInfo:
    """Who a rank is, and where its process group meets."""

    rank: int
    world_size: int
    #: ``torch.distributed`` rendezvous: ``tcp://HOST:PORT``, or ``env://`` under torchrun.
    init_method: str
    #: The rank's index among the ranks of its machine (its GPU, where it has one).
    local_rank: int


_this_rank: RankInfo | None = None


def this_rank() -> RankInfo:
    """This process's ``RankInfo``: the launcher's inside a launched rank, else the one a
    torchrun-style environment describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; ``env://``)."""
    if _this_rank is not None:
        return _this_rank
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank = int(os.environ["RANK"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        return RankInfo(rank, int(os.environ["WORLD_SIZE"]), "env://", local)
    raise RankError("not inside a launched rank, and no RANK / WORLD_SIZE in the environment")


# -- the launcher's side ------------------------------------------------------------------------
class _Process:
    """A rank's process, spawned (multiprocessing) or on a test-bed host (subprocess)."""

    def __init__(self, proc: mp.process.BaseProcess | subprocess.Popen[Any]) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        pid = self._proc.pid
        assert pid is not None, "the process was never started"
        return pid

    @property
    def exitcode(self) -> int | None:
        """None while running; negative: killed by that signal."""
        if isinstance(self._proc, subprocess.Popen):
            return self._proc.poll()
        return self._proc.exitcode

    def join(self, timeout: float) -> None:
        if isinstance(self._proc, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout)
        else:
            self._proc.join(timeout)

    def kill(self) -> None:
        """SIGKILL (a test-bed host's rank leads its own session: its children go too)."""
        if self.exitcode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if isinstance(self._proc, subprocess.Popen):
                os.killpg(self.pid, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)


class Pending(Generic[R]):
    """The answer a rank owes to one submitted call; ``result`` waits for it (bounded)."""

    def __init__(self, rank: Rank[Any], what: str) -> None:
        self.rank = rank
        self.what = what
        self.done = False
        self._value: Any = None
        self._error: RankError | None = None

    def result(self, timeout: float = DEFAULT_TIMEOUT) -> R:
        """The function's return value; raises RankError when it raised, or when the rank died
        or did not answer within ``timeout`` seconds."""
        self.rank._settle(self, timeout)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[no-any-return]


class Rank(Generic[S]):
    """One rank process, whose state (what its setup returned) has type ``S``."""

    def __init__(self, name: str, info: RankInfo, conn: Any, proc: _Process) -> None:
        self.name = name
        self.info = info
        self._conn = conn
        self._proc = proc
        self._owed: list[Pending[Any]] = []
        self.broken: str | None = None
        self.ready: Pending[None] = Pending(self, "<setup>")
        self._owed.append(self.ready)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def submit(self, fn: Callable[Concatenate[S, P], R], /, *args: P.args, **kwargs: P.kwargs) -> Pending[R]:
        """Sends ``fn(state, *args, **kwargs)`` to the rank without waiting for its answer."""
        if self.broken:
            raise RankError(f"{self.name}: unusable after an earlier failure ({self.broken})")
        pending: Pending[R] = Pending(self, getattr(fn, "__name__", repr(fn)))
        self._owed.append(pending)
        try:
            self._conn.send(("call", fn, args, kwargs))
        except (OSError, ValueError) as e:
            self._owed.remove(pending)
            raise RankError(f"{self.name}: cannot send {pending.what!r}: {e}") from None
        return pending

    def call(self, fn: Callable[Concatenate[S, P], R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Runs ``fn(state, *args, **kwargs)`` in the rank; waits at most DEFAULT_TIMEOUT."""
        return self.submit(fn, *args, **kwargs).result()

    def _settle(self, pending: Pending[Any], timeout: float) -> None:
        """Reads answers (they come in submission order) until ``pending`` has its own."""
        deadline = time.monotonic() + timeout
        while not pending.done:
            if not self._read_one(max(0.0, deadline - time.monotonic())):
                # A late answer would be taken for the next call's: the rank is out of step.
                self.broken = f"no answer to {self._owed[0].what!r} within {timeout:.1f}s"
                self._fail(self._owed[0], f"{self.name}: {self.broken}")

    def _read_one(self, wait: float) -> bool:
        """Settles the oldest owed answer when it arrives within ``wait`` seconds (or fails it
        when the rank is unusable); False when nothing came."""
        head = self._owed[0]
        if self.broken:
            self._fail(head, f"{self.name}: unusable after an earlier failure ({self.broken})")
            return True
        try:
            if not self._conn.poll(wait):
                return False
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(1)
            self.broken = f"died (exit code {self._proc.exitcode}) during {head.what!r}"
            return True
        self._owed.pop(0)
        head.done = True
        if status == "ok":
            head._value = payload
        else:
            head._error = RankError(f"{self.name}: {head.what!r} failed in the rank:\n{payload}")
        return True

    def _fail(self, head: Pending[Any], message: str) -> None:
        self._owed.remove(head)
        head.done = True
        head._error = RankError(message)

    def join(self, timeout: float) -> int | None:
        """Waits (at most ``timeout``) for the process to end; its exit code, None if running."""
        self._proc.join(timeout)
        return self._proc.exitcode

    def kill(self) -> None:
        """SIGKILL, then reap (bounded)."""
        self._proc.kill()
        self._proc.join(10)

    def close(self, timeout: float = 20.0) -> Any:
        """Asks the rank to run its teardown and exit; kills it when it is broken, busy, or not
        gone within ``timeout``. Returns what the teardown returned, or None when it was killed."""
        value = None
        try:
            if self._proc.exitcode is None and not self.broken:
                # Answers still owed (after a failed test) come first; skip those already there.
                while self._owed and self._conn.poll(0):
                    self._conn.recv()
                    self._owed.pop(0)
                if not self._owed:
                    bye: Pending[Any] = Pending(self, "<teardown>")
                    self._owed.append(bye)
                    self._conn.send(("exit",))
                    value = bye.result(timeout)
                    self._proc.join(timeout)
        except (OSError, ValueError, EOFError, RankError):
            value = None
        finally:
            if self._proc.exitcode is None:
                self.kill()
                value = None
            self._proc.join(5)
            self._conn.close()
        return value


def gather(pending: Sequence[Pending[Any]], timeout: float = DEFAULT_TIMEOUT) -> list[Any]:
    """Every answer, in order, within one deadline. A RankError is raised as soon as one call
    failed (the other ranks may be waiting for the failed one: closing them kills them), or at the
    deadline for the first call still unanswered."""
    deadline = time.monotonic() + timeout
    while True:
        for p in pending:
            if p.done and p._error is not None:
                raise p._error
        waiting = {id(p.rank): p.rank for p in pending if not p.done}
        if not waiting or time.monotonic() >= deadline:
            break
        broken = [r for r in waiting.values() if r.broken]
        for rank in broken:
            rank._read_one(0)
        if broken:
            continue
        conns: dict[Any, Rank[Any]] = {r._conn: r for r in waiting.values()}
        for conn in multiprocessing.connection.wait(
            list(conns), timeout=max(0.0, deadline - time.monotonic())
        ):
            conns[conn]._read_one(0)
    for p in pending:
        rank = p.rank
        if not p.done and not rank.broken:
            # As in Pending.result: a late answer would be taken for the next call's.
            rank.broken = f"no answer to {rank._owed[0].what!r} within {timeout:.1f}s"
            rank._fail(rank._owed[0], f"{rank.name}: {rank.broken}")
    return [p.result(0) for p in pending]


class Ranks(Sequence[Rank[S]]):
    """Ranks started together (rank i at index i); a context manager that always closes them."""

    def __init__(self, ranks: list[Rank[S]]) -> None:
        self._ranks = ranks

    def __getitem__(self, i: Any) -> Any:
        return self._ranks[i]

    def __len__(self) -> int:
        return len(self._ranks)

    def __iter__(self) -> Iterator[Rank[S]]:
        return iter(self._ranks)

    def submit_all(
        self, fn: Callable[Concatenate[S, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> list[Pending[R]]:
        """Sends the same call to every rank."""
        return [r.submit(fn, *args, **kwargs) for r in self._ranks]

    def call_all(self, fn: Callable[Concatenate[S, P], R], /, *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Runs the same call on every rank; returns the answers in rank order (DEFAULT_TIMEOUT)."""
        return gather(self.submit_all(fn, *args, **kwargs))

    def wait_ready(self, timeout: float) -> Ranks[S]:
        """Waits until every rank's setup returned; raises its RankError otherwise."""
        gather([r.ready for r in self._ranks], timeout)
        return self

    def close(self, timeout: float = 20.0) -> list[Any]:
        """Closes every rank (see ``Rank.close``); returns what each teardown returned."""
        return [r.close(timeout) for r in self._ranks]

    def __enter__(self) -> Ranks[S]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Setup = Callable[..., S]
Teardown = Callable[[S], Any]


def _per_rank(
    kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None, world: int
) -> list[dict[str, Any]]:
    if kwargs is None:
        return [{} for _ in range(world)]
    if isinstance(kwargs, Mapping):
        return [dict(kwargs) for _ in range(world)]
    if len(kwargs) != world:
        raise InvalidArgumentError(f"setup_kwargs has {len(kwargs)} entries for {world} ranks")
    return [dict(k) for k in kwargs]


@overload
def spawn_ranks(
    world: int,
    *,
    setup: None = None,
    setup_kwargs: None = None,
    teardown: None = None,
    names: Sequence[str] | None = None,
    init_method: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Ranks[None]: ...


@overload
def spawn_ranks(
    world: int,
    *,
    setup: Setup[S],
    setup_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    teardown: Teardown[S] | None = None,
    names: Sequence[str] | None = None,
    init_method: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Ranks[S]: ...


def spawn_ranks(
    world: int,
    *,
    setup: Setup[S] | None = None,
    setup_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    teardown: Teardown[S] | None = None,
    names: Sequence[str] | None = None,
    init_method: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Ranks[S]:
    """Starts ``world`` ranks as spawned children of this process, each running
    ``setup(**kwargs)`` (``setup_kwargs``: one mapping for all, or one per rank), and waits (at
    most ``timeout``) until every setup returned. Their process group meets at ``init_method``
    (default: a free port of 127.0.0.1). ``teardown(state)`` runs when a rank is closed."""
    from ..distributed import rendezvous_port

    if init_method is None:
        init_method = f"tcp://127.0.0.1:{rendezvous_port()}"
    labels = list(names) if names is not None else [f"rank{r}" for r in range(world)]
    started: list[Rank[S]] = []
    try:
        for r, kwargs in enumerate(_per_rank(setup_kwargs, world)):
            info = RankInfo(r, world, init_method, r)
            parent, child = _CTX.Pipe()
            proc = _CTX.Process(
                target=serve, args=(child, info, setup, kwargs, teardown), name=labels[r], daemon=True
            )
            proc.start()
            child.close()
            started.append(Rank(labels[r], info, parent, _Process(proc)))
        return Ranks(started).wait_ready(timeout)
    except BaseException:
        for rank in started:
            rank.close()
        raise


@overload
def host_ranks(
    bed: TestBed,
    *,
    hosts: Sequence[int] | None = None,
    setup: None = None,
    setup_kwargs: None = None,
    teardown: None = None,
    env: Mapping[str, str | None] | None = None,
    port: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Ranks[None]: ...


@overload
def host_ranks(
    bed: TestBed,
    *,
    hosts: Sequence[int] | None = None,
    setup: Setup[S],
    setup_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    teardown: Teardown[S] | None = None,
    env: Mapping[str, str | None] | None = None,
    port: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Ranks[S]: ...


def host_ranks(
    bed: TestBed,
    *,
    hosts: Sequence[int] | None = None,
    setup: Setup[S] | None = None,
    setup_kwargs: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
    teardown: Teardown[S] | None = None,
    env: Mapping[str, str | None] | None = None,
    port: int | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Ranks[S]:
    """Starts one rank on each of ``hosts`` of a test bed (default: all; rank = position in
    ``hosts``), inside the host's network namespace with the test bed's environment (see
    ``TestBed.spawn``) plus ``env``; otherwise as ``spawn_ranks``. Their process group meets on
    the first host's nic0 (``TestBed.init_method``)."""
    from .netns import DEFAULT_PORT

    chosen = list(range(bed.hosts)) if hosts is None else list(hosts)
    world = len(chosen)
    port = DEFAULT_PORT if port is None else port
    init_method = bed.init_method(port, host=chosen[0])
    started: list[Rank[S]] = []
    try:
        for r, (host, kwargs) in enumerate(zip(chosen, _per_rank(setup_kwargs, world), strict=True)):
            info = RankInfo(r, world, init_method, 0)
            parent, child = _CTX.Pipe()
            fd = child.fileno()
            proc = bed.spawn(
                host,
                [sys.executable, "-m", "fabric_lib.testing._host_rank", str(fd)],
                env=env,
                rank=r,
                world=world,
                port=port,
                pass_fds=(fd,),
                stdin=subprocess.DEVNULL,
            )
            child.close()
            rank: Rank[S] = Rank(f"host{host}", info, parent, _Process(proc))
            started.append(rank)
            # As multiprocessing's spawn does: sys.path, cwd and main module first, so that the
            # setup function (and every later one) can be found by reference. (The authkey goes
            # as bytes: its own type refuses to be pickled outside a spawn.)
            preparation = multiprocessing.spawn.get_preparation_data(rank.name)
            preparation["authkey"] = bytes(preparation["authkey"])
            parent.send(preparation)
            parent.send((info, setup, kwargs, teardown))
        return Ranks(started).wait_ready(timeout)
    except BaseException:
        for rank in started:
            rank.close()
        raise


# -- the rank's side ----------------------------------------------------------------------------
def _die_with_parent() -> None:
    """Asks the kernel to SIGKILL this process when its parent dies (no orphans after a crash)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def serve(
    conn: Any,
    info: RankInfo,
    setup: Setup[Any] | None,
    setup_kwargs: dict[str, Any],
    teardown: Teardown[Any] | None,
) -> None:
    """The rank's loop: setup, then every function sent until told to exit (or the launcher is
    gone), then teardown. Answers ("ok", value) or ("error", traceback)."""
    global _this_rank
    _die_with_parent()
    _this_rank = info
    try:
        state = setup(**setup_kwargs) if setup is not None else None
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the launcher
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            if not conn.poll(IDLE_EXIT_S):
                break
            message = conn.recv()
        except (EOFError, OSError):
            break
        except BaseException:  # noqa: BLE001 - a function that cannot be found here
            message = ("unreadable", traceback.format_exc())
        if message[0] == "exit":
            try:
                reply = ("ok", teardown(state) if teardown is not None else None)
            except BaseException:  # noqa: BLE001 - reported to the launcher
                reply = ("error", traceback.format_exc())
            with contextlib.suppress(OSError, ValueError):
                conn.send(reply)
            return
        if message[0] == "unreadable":
            reply = ("error", message[1])
        else:
            _, fn, args, kwargs = message
            try:
                reply = ("ok", fn(state, *args, **kwargs))
            except BaseException:  # noqa: BLE001 - reported to the launcher
                reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (OSError, ValueError):
            break
        except Exception:  # noqa: BLE001 - the answer does not pickle
            with contextlib.suppress(OSError, ValueError):
                conn.send(("error", traceback.format_exc()))
    if teardown is not None:
        with contextlib.suppress(Exception):
            teardown(state)


def serve_host(fd: int) -> None:
    """A test-bed host's rank (``python -m fabric_lib.testing._host_rank FD``): the launcher's
    preparation data, then the rank's loop on the connection inherited as ``fd``."""
    conn = multiprocessing.connection.Connection(fd)
    multiprocessing.spawn.prepare(conn.recv())
    info, setup, setup_kwargs, teardown = conn.recv()
    serve(conn, info, setup, setup_kwargs, teardown)
