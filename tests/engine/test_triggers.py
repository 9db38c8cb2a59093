"""Triggered requests (``after_imm=(imm, count)`` on ``submit_write``, ``submit_imm`` and
``submit_send``): posted by the worker once the count is reached, byte- and count-exact over
every loopback provider (``udp;ofi_rxd`` delivers in any order), under hypothesis."""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import fabric_lib
import numpy as np
import pytest
from fabric_lib.errors import FabricTimeoutError, InvalidArgumentError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from providers import provider_params

Trio = tuple[fabric_lib.TransferEngine, fabric_lib.TransferEngine, fabric_lib.TransferEngine]


@pytest.fixture(scope="module", params=provider_params())
def trio(request: pytest.FixtureRequest) -> Iterator[Trio]:
    engines = [
        fabric_lib.TransferEngine(request.param, poll_mode="adaptive", transfer_timeout=20.0)
        for _ in range(3)
    ]
    yield engines[0], engines[1], engines[2]
    for e in engines:
        e.stop()


_IMM = iter(range(1000, 2**31))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    pages=st.integers(1, 32),
    page_len=st.sampled_from([1, 100, 4096, 20000]),
    early=st.integers(0, 32),
    seed=st.integers(0, 2**31),
)
def test_a_proxy_forwards_what_it_counted(
    trio: Trio, pages: int, page_len: int, early: int, seed: int
) -> None:
    """A writes ``pages`` pages to B with immediate X (``early`` of them before B arms); B's
    worker forwards its buffer to C with immediate Y once it counted all of them."""
    a, b, c = trio
    x, y = next(_IMM), next(_IMM)
    n = pages * page_len
    src = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    hop, dst = np.zeros(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    rs, rh, rd = a.register_buffer(src), b.register_buffer(hop), c.register_buffer(dst)
    try:
        early = min(early, pages)
        sent = [
            a.submit_write(rs, rh, page_len, src_offset=p * page_len, dst_offset=p * page_len, imm=x)
            for p in range(early)
        ]
        deadline = time.monotonic() + 30
        while b.imm_counter(x).value < early:  # counted before the trigger exists (not consumed)
            assert time.monotonic() < deadline, "early writes did not arrive"
            time.sleep(0.001)
        forwarded = b.submit_write(rh, rd, imm=y, after_imm=(x, pages), after_timeout=30)
        sent += [
            a.submit_write(rs, rh, page_len, src_offset=p * page_len, dst_offset=p * page_len, imm=x)
            for p in range(early, pages)
        ]
        for f in sent:
            f.result(timeout=30)
        forwarded.result(timeout=30)
        with c.imm_counter(y) as counter:
            counter.wait(1, timeout=30)
            time.sleep(0.02)
            assert counter.value == 0, "one immediate per forward"
        assert np.array_equal(dst, src)
        assert b.imm_counter(x).value == 0, "the trigger consumed every arrival it needed"
    finally:
        a.unregister_memory(rs)
        b.unregister_memory(rh)
        c.unregister_memory(rd)


def test_an_echo_answers_each_ping_once(trio: Trio) -> None:
    a, b, _ = trio
    ping, pong = next(_IMM), next(_IMM)
    pings = 200
    answered = [b.submit_imm(pong, a.main_address, after_imm=(ping, 1)) for _ in range(pings)]
    with a.imm_counter(pong) as pongs:
        for i in range(pings):
            a.submit_imm(ping, b.main_address).result(timeout=30)
            pongs.wait(1, timeout=30)
        time.sleep(0.02)
        assert pongs.value == 0, "exactly one pong per ping"
    for f in answered:
        f.result(timeout=30)
    assert b.imm_counter(ping).value == 0


def test_a_triggered_message_and_a_timeout(trio: Trio) -> None:
    a, b, _ = trio
    x = next(_IMM)
    got: queue.Queue[bytes] = queue.Queue()
    a.set_recv_callback(got.put)
    try:
        sent = b.submit_send(a.main_address, b"go", after_imm=(x, 2))
        a.submit_imm(x, b.main_address).result(timeout=30)
        with pytest.raises(queue.Empty):
            got.get(timeout=0.3)
        a.submit_imm(x, b.main_address).result(timeout=30)
        assert got.get(timeout=30) == b"go"
        sent.result(timeout=30)
    finally:
        a.set_recv_callback(None)
    late = b.submit_imm(7, a.main_address, after_imm=(x, 5), after_timeout=0.3)
    a.submit_imm(x, b.main_address).result(timeout=30)
    with pytest.raises(FabricTimeoutError):
        late.result(timeout=30)
    b.imm_counter(x).wait(1, timeout=30)  # a timed-out trigger returns what it took to the counter


def test_bad_triggers_are_refused(trio: Trio) -> None:
    a, b, _ = trio
    buf = a.register_buffer(bytearray(64))
    try:
        for bad in [(1,), (1, 0), (-1, 1), (2**32, 1), "x"]:
            with pytest.raises(InvalidArgumentError):
                a.submit_imm(1, b.main_address, after_imm=bad)  # type: ignore[call-overload]
        with pytest.raises(InvalidArgumentError):
            a.submit_imm(1, b.main_address, after_timeout=1.0)
        with pytest.raises(InvalidArgumentError):
            a.submit_imm(1, b.main_address, after_imm=(1, 1), after_timeout=-1.0)
        with pytest.raises(InvalidArgumentError):  # checked when armed, not when it fires
            a.submit_write(buf, b.register_buffer(bytearray(8)), 64, after_imm=(1, 1))
    finally:
        a.unregister_memory(buf)
