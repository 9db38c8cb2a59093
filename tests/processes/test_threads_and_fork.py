"""Cheap enforcement of the thread and fork rules (docs/threads-and-fork.md): blocking on a Future
inside a callback raises instead of deadlocking; an engine inherited across fork raises
EngineStoppedError naming fork instead of accepting work it never completes."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import fabric_lib
import pytest
from fabric_lib import errors


def test_waiting_on_a_pending_future_inside_on_done_raises(tcp_pair) -> None:
    a, b = tcp_pair
    src = a.register_buffer(bytearray(64))
    dst = b.register_buffer(bytearray(64))
    never = b.expect_imm_count(99, 1)  # nothing sends 99: stays pending
    seen: Future[BaseException | None] = Future()

    def on_done(error: BaseException | None) -> None:
        try:
            never.result(timeout=5)
            seen.set_result(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            seen.set_result(e)

    a.submit_write(src, dst.descriptor, on_done=on_done)
    raised = seen.result(timeout=20)
    assert isinstance(raised, errors.CallbackThreadError), raised
    assert "callback" in str(raised) and "add_done_callback" in str(raised)
    never.cancel()


def test_done_callback_may_read_a_finished_future_but_not_wait_on_a_pending_one(tcp_pair) -> None:
    a, b = tcp_pair
    src = a.register_buffer(bytearray(64))
    dst = b.register_buffer(bytearray(64))
    first = a.submit_write(src, dst.descriptor)
    first.result(timeout=20)
    pending = b.expect_imm_count(98, 1)
    outcome: Future[tuple[object, BaseException | None]] = Future()

    def chained(done: Future[None]) -> None:
        finished = first.result()  # already done: fine anywhere
        try:
            pending.exception(timeout=5)
            outcome.set_result((finished, None))
        except BaseException as e:  # noqa: BLE001
            outcome.set_result((finished, e))

    a.submit_write(src, dst.descriptor).add_done_callback(chained)
    finished, error = outcome.result(timeout=20)
    assert finished is None
    assert isinstance(error, errors.CallbackThreadError)
    pending.cancel()


def test_other_threads_still_block_normally(tcp_pair) -> None:
    a, _ = tcp_pair
    pending = a.expect_imm_count(97, 1)
    with pytest.raises(TimeoutError):
        pending.result(timeout=0.1)  # plain timeout, not CallbackThreadError
    pending.cancel()


def _in_forked_child(body) -> int:
    """Runs ``body()`` in a forked child; returns its exit status (0: body returned normally)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 1
        try:
            body()
            code = 0
        except BaseException as e:  # noqa: BLE001
            os.write(2, f"child failed: {e!r}\n".encode())
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_engine_used_in_forked_child_raises_naming_fork(tcp_pair) -> None:
    a, b = tcp_pair
    src = a.register_buffer(bytearray(64))
    dst = b.register_buffer(bytearray(64))
    counter = b.imm_counter(11)

    def child() -> None:
        for use in (
            lambda: a.submit_write(src, dst.descriptor, imm=11),
            lambda: a.main_address,
            lambda: b.imm_counter(12),
            lambda: counter.wait(1, timeout=1),
        ):
            try:
                use()
            except errors.EngineStoppedError as e:
                assert "fork" in str(e) and str(os.getppid()) in str(e), str(e)
            else:
                raise AssertionError("an inherited engine accepted work in a forked child")
        a.stop()  # a no-op in the child: stopping must not raise or hang
        with fabric_lib.TransferEngine("tcp", poll_mode="adaptive") as fresh:  # a new engine works
            assert fresh.main_address is not None

    assert _in_forked_child(child) == 0
    # The parent's engines are untouched by the child's exit.
    a.submit_write(src, dst.descriptor, imm=11).result(timeout=20)
    counter.wait(1, timeout=20)


def test_fork_guard_is_per_process_generation() -> None:
    from fabric_lib import _fork

    before = _fork.generation()
    done = threading.Event()

    def child() -> None:
        assert _fork.generation() == before + 1
        done.set()

    assert _in_forked_child(child) == 0
    assert _fork.generation() == before


CHILD_EXITS_NORMALLY = """
import os, sys
import fabric_lib
engine = fabric_lib.TransferEngine("tcp", poll_mode="adaptive")
pid = os.fork()
if pid == 0:
    try:
        engine.main_address
    except fabric_lib.EngineStoppedError:
        sys.exit(0)  # a normal interpreter shutdown in the child, with the inherited engine alive
    sys.exit(3)
_, status = os.waitpid(pid, 0)
engine.stop()
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_forked_child_shutdown_leaves_the_inherited_engine_alone() -> None:
    """The child must not tear the parent's engine down at exit: that would wait for threads the
    child does not have (the core logs "did not stop ... detaching it" after its stop timeout)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", CHILD_EXITS_NORMALLY], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "detaching" not in out.stderr and "did not stop" not in out.stderr, out.stderr
