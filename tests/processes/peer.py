"""A peer: a rank (``fabric_lib.testing``) that owns one TransferEngine and one registered buffer,
plus the operations that more than one test file runs in peers.

A peer opens an engine with ``poll_mode="adaptive"`` (CI machines have 2 cores), registers one
uint8 numpy buffer (``register_memory``; peers do not import torch, which keeps start-up fast and
RSS small) and counts the digests of the messages it receives. A test drives it with functions
(``rx.call(fill, seed=1)``); each bounds every wait by a timeout.

Deterministic data: ``pattern(seed, n)`` gives the same bytes in every process, so a receiver
rebuilds the exact buffer it expects from the plan and the seeds alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
from fabric_lib.testing import Pending, Rank, spawn_ranks

P = ParamSpec("P")
R = TypeVar("R")

# A write in a plan: (sender, src_offset, dst_offset, length, imm); length None = submit_imm.
WriteOp = tuple[int, int, int, "int | None", int]


def pattern(seed: int, n: int) -> np.ndarray:
    """``n`` pseudo-random bytes (a uint8 numpy array), identical in every process for one seed."""
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


_PATTERNS: dict[tuple[int, int], np.ndarray] = {}


def cached_pattern(seed: int, n: int) -> np.ndarray:
    key = (seed, n)
    if key not in _PATTERNS:
        if len(_PATTERNS) > 8:
            _PATTERNS.clear()
        _PATTERNS[key] = pattern(seed, n)
    return _PATTERNS[key]


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def expected_imm_counts(ops: Sequence[WriteOp]) -> dict[int, int]:
    return dict(Counter(op[4] for op in ops))


# -- the peer process ---------------------------------------------------------------------------
class PeerState:
    """What a peer process holds: its engine, buffer and region, plus received messages."""

    def __init__(self, engine: Any, buf: np.ndarray, region: Any) -> None:
        self.engine = engine
        self.buf = buf
        self.region = region
        self.extra: dict[str, Any] = {}
        self.msg_lock = threading.Condition()
        self.messages: list[bytes] = []  # digests of received messages

    def on_message(self, data: bytes) -> None:
        d = digest(data)
        with self.msg_lock:
            self.messages.append(d)
            self.msg_lock.notify_all()


def open_peer(provider: str, buf_size: int, engine_kwargs: dict[str, Any]) -> PeerState:
    """The peer's setup: engine, buffer, region and message callback."""
    import fabric_lib

    engine = fabric_lib.TransferEngine(provider, poll_mode="adaptive", **engine_kwargs)
    buf = np.zeros(buf_size, dtype=np.uint8)
    region = engine.register_memory(buf.ctypes.data, buf.nbytes, owner=buf)
    state = PeerState(engine, buf, region)
    engine.set_recv_callback(state.on_message)
    return state


def stop_peer(state: PeerState) -> float:
    """The peer's teardown: stops the engine; returns the seconds ``stop()`` took."""
    t0 = time.monotonic()
    state.engine.stop()
    return time.monotonic() - t0


def describe(state: PeerState) -> tuple[bytes, bytes, str]:
    return state.engine.main_address.to_bytes(), state.region.descriptor.to_bytes(), state.engine.provider


@dataclass
class Peer:
    """The test's handle on a peer: its rank and what others need to reach it."""

    rank: Rank[PeerState]
    address: bytes
    descriptor: bytes
    provider: str

    @property
    def pid(self) -> int:
        return self.rank.pid

    @property
    def exitcode(self) -> int | None:
        return self.rank.exitcode

    def submit(
        self, fn: Callable[Concatenate[PeerState, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> Pending[R]:
        return self.rank.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[Concatenate[PeerState, P], R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self.rank.call(fn, *args, **kwargs)

    def join(self, timeout: float) -> int | None:
        return self.rank.join(timeout)

    def kill(self) -> None:
        self.rank.kill()

    def close(self) -> float | None:
        """Stops the peer; the seconds its ``engine.stop()`` took, or None when it was killed."""
        stop_s: float | None = self.rank.close()
        return stop_s


@contextlib.contextmanager
def peers(
    provider: str,
    names: Sequence[str],
    *,
    buf_size: int | Sequence[int] = 1 << 20,
    engine_kwargs: dict[str, Any] | None = None,
    timeout: float = 60.0,
) -> Iterator[list[Peer]]:
    """Starts one peer per name (``buf_size``: one size, or one per name), waits until all are
    ready, and always closes them."""
    sizes = [buf_size] * len(names) if isinstance(buf_size, int) else list(buf_size)
    kwargs = [
        {"provider": provider, "buf_size": size, "engine_kwargs": dict(engine_kwargs or {})} for size in sizes
    ]
    with spawn_ranks(
        len(names), setup=open_peer, setup_kwargs=kwargs, teardown=stop_peer, names=names, timeout=timeout
    ) as ranks:
        infos = [p.result(timeout) for p in ranks.submit_all(describe)]
        yield [Peer(rank, *info) for rank, info in zip(ranks, infos, strict=True)]


def sigstop(pid: int) -> None:
    """SIGSTOPs ``pid`` and waits until the kernel reports it stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "T":
        assert time.monotonic() < deadline, "the peer never stopped"
        time.sleep(0.005)


# -- operations run in peers --------------------------------------------------------------------
def fill(state: PeerState, seed: int | None = None, value: int = 0) -> None:
    """Fills the buffer with ``pattern(seed)``, or with ``value`` when seed is None."""
    if seed is None:
        state.buf[:] = value
    else:
        state.buf[:] = cached_pattern(seed, state.buf.size)


def imm_value(engine: Any, imm: int) -> int:
    """Arrivals of ``imm`` counted and not yet consumed."""
    with engine.imm_counter(imm) as c:
        return int(c.value)


def stale_immediates(state: PeerState) -> int:
    """Immediates the peer dropped for belonging to a writer's ended epoch."""
    return int(state.engine.stale_immediates)


def wait_imms(
    state: PeerState, counts: dict[int, int], timeout: float = 30.0, settle: float = 0.05
) -> dict[int, int]:
    """Waits until each imm arrived exactly ``counts[imm]`` times: waits for the count, then
    checks (after ``settle`` seconds) that nothing more arrived. Returns leftover counts (all
    zero when exact)."""
    deadline = time.monotonic() + timeout
    for imm, n in counts.items():
        with state.engine.imm_counter(imm) as c:
            c.wait(n, timeout=max(0.0, deadline - time.monotonic()))
    if settle:
        time.sleep(settle)
    return {imm: imm_value(state.engine, imm) for imm in counts}


def write_plan(
    state: PeerState,
    dst: bytes,
    ops: Sequence[WriteOp],
    sender: int = 0,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Submits this sender's ops of the plan (all at once) and waits for every future."""
    from fabric_lib import MrDescriptor

    engine, region = state.engine, state.region
    desc = MrDescriptor.from_bytes(dst)
    futures = []
    for who, src_off, dst_off, length, imm in ops:
        if who != sender:
            continue
        if length is None:
            futures.append(engine.submit_imm(imm, desc))
        else:
            futures.append(
                engine.submit_write(region, desc, length, src_offset=src_off, dst_offset=dst_off, imm=imm)
            )
    deadline = time.monotonic() + timeout
    for f in futures:
        f.result(timeout=max(0.0, deadline - time.monotonic()))
    return {"submitted": len(futures)}


def apply_plan(init: np.ndarray, src_by_sender: dict[int, np.ndarray], ops: Sequence[WriteOp]) -> np.ndarray:
    expected = init.copy()
    for who, src_off, dst_off, length, _imm in ops:
        if length:
            expected[dst_off : dst_off + length] = src_by_sender[who][src_off : src_off + length]
    return expected


def check_plan(
    state: PeerState,
    ops: Sequence[WriteOp],
    init_seed: int,
    src_seeds: dict[int, int],
    src_size: int,
    timeout: float = 30.0,
    span: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Receiver: waits for the exact imm counts of the plan, then compares every byte of the
    buffer (or of ``buf[span[0]:span[1]]``) with the one rebuilt from the seeds and the plan."""
    leftover = wait_imms(state, expected_imm_counts(ops), timeout=timeout)
    init = cached_pattern(init_seed, state.buf.size)
    srcs = {who: cached_pattern(seed, src_size) for who, seed in src_seeds.items()}
    expected = apply_plan(init, srcs, ops)
    lo, hi = span if span is not None else (0, state.buf.size)
    got, expected = state.buf[lo:hi], expected[lo:hi]
    mismatch = None
    if not np.array_equal(got, expected):
        bad = np.flatnonzero(got != expected)
        first = lo + int(bad[0])
        culprit = [i for i, op in enumerate(ops) if op[3] and op[2] <= first < op[2] + op[3]]
        mismatch = {"first": first, "count": int(bad.size), "ops": culprit}
    return {"leftover": leftover, "mismatch": mismatch}
