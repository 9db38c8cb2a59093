"""The Futures that ``submit_*`` and ``expect_imm_count`` return: ``concurrent.futures.Future``
semantics before and after completion (result, exception, done-callbacks, ``wait``,
``as_completed``, ``asyncio.wrap_future``), typed failures, and completion without Python on
the callback thread.

A request held back by a trigger (``after_imm``) stays pending until the test sends the
trigger's immediate: that is how "before completion" is reached without timing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import CancelledError, Future

import fabric_lib
import pytest
from fabric_lib.errors import EngineStoppedError, FabricTimeoutError

Pair = tuple[fabric_lib.TransferEngine, fabric_lib.TransferEngine]
TRIGGER = 0x5100
PING = 0x5200


def held_back(
    a: fabric_lib.TransferEngine, b: fabric_lib.TransferEngine, trigger: int = TRIGGER
) -> Future[None]:
    """A request of ``a`` posted only once ``trigger`` arrived at ``a``."""
    return a.submit_imm(PING, b.main_address, after_imm=(trigger, 1))


def release(a: fabric_lib.TransferEngine, b: fabric_lib.TransferEngine, trigger: int = TRIGGER) -> None:
    b.submit_imm(trigger, a.main_address).result(timeout=20)


def test_a_pending_request_future_behaves_as_a_running_future(tcp_pair: Pair) -> None:
    a, b = tcp_pair
    f = held_back(a, b)
    assert isinstance(f, Future)
    assert not f.done() and f.running() and not f.cancelled()
    assert not f.cancel(), "a request cannot be cancelled"
    with pytest.raises(concurrent.futures.InvalidStateError):
        f.set_result(None)  # the engine settles it
    with pytest.raises(concurrent.futures.TimeoutError):
        f.result(timeout=0.05)
    with pytest.raises(concurrent.futures.TimeoutError):
        f.exception(timeout=0)
    release(a, b)
    assert f.result(timeout=20) is None
    assert f.done() and not f.running() and not f.cancelled() and not f.cancel()
    assert f.exception() is None
    assert "finished" in repr(f)
    b.imm_counter(PING).wait(1, timeout=20)


def test_a_result_waited_on_from_another_thread_arrives(tcp_pair: Pair) -> None:
    a, b = tcp_pair
    f = held_back(a, b)
    outcome: Future[object] = Future()
    waiter = threading.Thread(target=lambda: outcome.set_result(f.exception(timeout=20)))
    waiter.start()
    time.sleep(0.05)  # the waiter is (most likely) blocked by now; either way it must return
    release(a, b)
    waiter.join(timeout=20)
    assert outcome.result(timeout=0) is None


def test_done_callbacks_run_on_the_callback_thread_before_and_inline_after(tcp_pair: Pair) -> None:
    a, b = tcp_pair
    f = held_back(a, b)
    ran: list[tuple[str, Future[None]]] = []
    main = threading.current_thread().name
    f.add_done_callback(lambda g: ran.append(("first", g)))
    f.add_done_callback(lambda g: ran.append((threading.current_thread().name, g)))
    assert ran == []
    release(a, b)
    f.result(timeout=20)
    deadline = time.monotonic() + 20
    while len(ran) < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert [r[0] for r in ran][0] == "first" and ran[1][0] != main, "in order, on the callback thread"
    assert all(g is f for _, g in ran)
    f.add_done_callback(lambda g: ran.append((threading.current_thread().name, g)))
    assert ran[2] == (main, f), "a callback added after completion runs at once, in the caller"


def test_a_raising_done_callback_is_logged_and_the_next_still_runs(
    tcp_pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = tcp_pair
    f = held_back(a, b)
    after: Future[None] = Future()

    def boom(_: Future[None]) -> None:
        raise RuntimeError("callback failure")

    f.add_done_callback(boom)
    f.add_done_callback(lambda _: after.set_result(None))
    with caplog.at_level(logging.ERROR, logger="concurrent.futures"):
        release(a, b)
        after.result(timeout=20)
    assert any("callback failure" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


def test_wait_and_as_completed_see_completions_that_happen_while_they_wait(tcp_pair: Pair) -> None:
    a, b = tcp_pair
    pending = [held_back(a, b, trigger) for trigger in (TRIGGER, TRIGGER + 1)]
    done, not_done = concurrent.futures.wait(pending, timeout=0.05)
    assert not done and len(not_done) == 2
    threading.Timer(0.05, release, (a, b)).start()
    done, not_done = concurrent.futures.wait(
        pending, timeout=20, return_when=concurrent.futures.FIRST_COMPLETED
    )
    assert done == {pending[0]} and not_done == {pending[1]}
    threading.Timer(0.05, release, (a, b, TRIGGER + 1)).start()
    assert list(concurrent.futures.as_completed(pending[1:], timeout=20)) == pending[1:]
    done, not_done = concurrent.futures.wait(pending, timeout=20)
    assert done == set(pending) and not not_done
    b.imm_counter(PING).wait(2, timeout=20)


def test_wait_on_futures_already_complete_returns_at_once(tcp_pair: Pair) -> None:
    a, b = tcp_pair
    finished = [a.submit_imm(PING, b.main_address) for _ in range(8)]
    b.imm_counter(PING).wait(8, timeout=20)  # arrived, so each Future completes (unobserved)
    done, not_done = concurrent.futures.wait(finished, timeout=20)
    assert done == set(finished) and not not_done
    assert sorted(map(id, concurrent.futures.as_completed(finished, timeout=20))) == sorted(map(id, finished))


def test_asyncio_awaits_request_futures_before_and_after_completion(tcp_pair: Pair) -> None:
    a, b = tcp_pair

    async def scenario() -> None:
        early = held_back(a, b)
        waiting = asyncio.ensure_future(asyncio.wrap_future(early))
        await asyncio.sleep(0.02)
        assert not waiting.done()
        await asyncio.get_running_loop().run_in_executor(None, release, a, b)
        await asyncio.wait_for(waiting, 20)
        assert waiting.result() is None
        late = a.submit_imm(PING, b.main_address)
        late.result(timeout=20)
        awaited = asyncio.ensure_future(asyncio.wrap_future(late))
        await asyncio.wait_for(awaited, 20)
        assert awaited.result() is None

    asyncio.run(scenario())
    b.imm_counter(PING).wait(2, timeout=20)


def test_a_failure_is_the_same_typed_exception_however_it_is_read(tcp_pair: Pair) -> None:
    a, b = tcp_pair
    unwatched = a.submit_imm(PING, b.main_address, after_imm=(TRIGGER, 1), after_timeout=0.1)
    watched = a.submit_imm(PING, b.main_address, after_imm=(TRIGGER, 1), after_timeout=0.1)
    seen: Future[BaseException | None] = Future()
    watched.add_done_callback(lambda g: seen.set_result(g.exception()))
    with pytest.raises(FabricTimeoutError) as raised:
        unwatched.result(timeout=20)
    assert unwatched.exception() is raised.value, "one exception object per Future"
    assert isinstance(seen.result(timeout=20), FabricTimeoutError)
    assert watched.exception() is seen.result()


def test_stop_fails_pending_futures_with_engine_stopped() -> None:
    a = fabric_lib.TransferEngine("tcp", poll_mode="adaptive")
    b = fabric_lib.TransferEngine("tcp", poll_mode="adaptive")
    try:
        unwatched = held_back(a, b)
        watched = held_back(a, b)
        seen: Future[BaseException | None] = Future()
        watched.add_done_callback(lambda g: seen.set_result(g.exception()))
        expectation = a.expect_imm_count(TRIGGER + 1, 1)
        a.stop()
        with pytest.raises(EngineStoppedError):
            unwatched.result(timeout=20)
        assert isinstance(seen.result(timeout=20), EngineStoppedError)
        assert not expectation.done()  # an expectation is not failed by stop (as before)
        assert expectation.cancel() and expectation.cancelled()
    finally:
        a.stop()
        b.stop()


def test_cancelling_an_expectation_wakes_a_blocked_result(tcp_pair: Pair) -> None:
    a, b = tcp_pair
    f = b.expect_imm_count(PING, 1)
    assert not f.running()
    raised: Future[BaseException | None] = Future()

    def wait() -> None:
        try:
            f.result(timeout=20)
            raised.set_result(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            raised.set_result(e)

    threading.Thread(target=wait).start()
    time.sleep(0.05)
    assert f.cancel() and f.cancelled() and f.done()
    assert isinstance(raised.result(timeout=20), CancelledError)
    with pytest.raises(CancelledError):
        f.exception()
    a.submit_imm(PING, b.main_address).result(timeout=20)
    b.imm_counter(PING).wait(1, timeout=20)  # the cancelled expectation did not consume it


def test_an_expectation_reached_cannot_be_cancelled(tcp_pair: Pair) -> None:
    a, b = tcp_pair
    f = b.expect_imm_count(PING, 2)
    for _ in range(2):
        a.submit_imm(PING, b.main_address)
    assert f.result(timeout=20) is None
    assert not f.cancel() and not f.cancelled()


def test_a_future_completes_while_the_submitting_thread_holds_the_gil(tcp_pair: Pair) -> None:
    """Completing a Future nobody watches needs no Python on the callback thread: it completes
    while this thread never lets the GIL go (no switch interval, no blocking call)."""
    if os.environ.get("FABRIC_LIB_LOG", "warn").lower() not in ("", "warn", "error", "off"):
        pytest.skip("verbose FABRIC_LIB_LOG: the engine's threads take the GIL to log")
    a, b = tcp_pair
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        f = a.submit_imm(PING, b.main_address)
        expected = b.expect_imm_count(PING + 1, 1)
        a.submit_imm(PING + 1, b.main_address)
        deadline = time.monotonic() + 20
        while not (f.done() and expected.done()) and time.monotonic() < deadline:
            pass  # spin holding the GIL
        completed = f.done() and expected.done()
    finally:
        sys.setswitchinterval(interval)
    assert completed
    assert f.result(timeout=0) is None and expected.result(timeout=0) is None


def test_callbacks_run_once_each_when_completion_races_with_readers(tcp_pair: Pair) -> None:
    """Done-callbacks added while requests complete, with other threads reading and waiting on
    the same Futures: none is lost, none runs twice, every wait returns."""
    a, b = tcp_pair
    n = 300
    futures = [a.submit_imm(PING, b.main_address) for _ in range(n)]
    calls = [0] * n
    lock = threading.Lock()

    def counted(i: int) -> None:
        def callback(_: Future[None]) -> None:
            with lock:
                calls[i] += 1

        futures[i].add_done_callback(callback)

    def add_callbacks() -> None:
        for i in range(n):
            counted(i)

    readers = [
        threading.Thread(target=add_callbacks),
        threading.Thread(target=lambda: concurrent.futures.wait(futures, timeout=20)),
        threading.Thread(target=lambda: [f.done() for f in futures]),
    ]
    for t in readers:
        t.start()
    for f in futures:
        f.result(timeout=20)
    for t in readers:
        t.join(timeout=20)
    deadline = time.monotonic() + 20
    while sum(calls) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    assert calls == [1] * n
    b.imm_counter(PING).wait(n, timeout=20)


class _Interrupted(Exception):
    pass


def test_a_signal_interrupts_a_long_result_wait(tcp_pair: Pair) -> None:
    """A wait on a pending Future runs the signal handlers meanwhile (Ctrl-C works)."""
    _, b = tcp_pair
    f = b.expect_imm_count(PING, 1)

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        start = time.monotonic()
        with pytest.raises(_Interrupted):
            f.result(timeout=20)
        assert time.monotonic() - start < 10
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert f.cancel()
