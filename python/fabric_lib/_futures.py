"""Bridging native completion callbacks to concurrent.futures.Future and safe user callbacks.

Callbacks (``on_done``, receive and immediate callbacks, a Future's done-callbacks) run on the
engine's callback thread. That thread also settles every Future, so a callback that blocks on a
pending Future would wait on itself forever: ``EngineFuture.result``/``exception`` refuse that
with ``CallbackThreadError`` instead.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

from .errors import CallbackThreadError, FabricError

_log = logging.getLogger("fabric_lib")
_state = threading.local()


def on_callback_thread() -> bool:
    """True while this thread is running a fabric_lib callback."""
    return getattr(_state, "depth", 0) > 0


class _InCallback:
    """Marks the current thread as running a fabric_lib callback (re-entrant)."""

    def __enter__(self) -> None:
        _state.depth = getattr(_state, "depth", 0) + 1

    def __exit__(self, *exc: object) -> None:
        _state.depth -= 1


_IN_CALLBACK = _InCallback()


class EngineFuture(Future[None]):
    """A Future settled by the engine; blocking on it from a callback raises instead of hanging."""

    def result(self, timeout: float | None = None) -> None:
        self._refuse_self_wait("result")
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._refuse_self_wait("exception")
        return super().exception(timeout)

    def _refuse_self_wait(self, method: str) -> None:
        if not self.done() and on_callback_thread():
            raise CallbackThreadError(
                f"Future.{method}() called inside a fabric_lib callback: the callback thread settles "
                "this Future and would wait on itself. Chain work with add_done_callback or on_done, "
                "or hand the wait to another thread."
            )


def completion_future() -> tuple[EngineFuture, Callable[[BaseException | None], None]]:
    """A running Future plus the native callback that settles it (result None, or the error)."""
    future = EngineFuture()
    future.set_running_or_notify_cancel()

    def settle(error: BaseException | None) -> None:
        with _IN_CALLBACK:  # done-callbacks run here, on the callback thread
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    return future, settle


class ExpectationFuture(EngineFuture):
    """A pending Future for an immediate-count expectation; ``cancel()`` removes the expectation
    (``asyncio.wrap_future`` cancels it when the awaiting task is cancelled)."""

    def __init__(self, remove: Callable[[], object]) -> None:
        super().__init__()
        self._remove = remove

    def cancel(self) -> bool:
        if self.done():
            return False
        try:
            self._remove()  # the expectation will not fire (or has fired: then cancel fails below)
        except FabricError:  # engine stopped: nothing will fire any more
            pass
        return super().cancel()

    def settle(self) -> None:
        with _IN_CALLBACK:
            try:
                self.set_result(None)
            except InvalidStateError:  # cancelled while the count was being reached
                pass


def guarded(callback: Callable[..., Any]) -> Callable[..., None]:
    """Wraps a user callback so an exception it raises is logged instead of escaping."""

    def run(*args: Any) -> None:
        with _IN_CALLBACK:
            try:
                callback(*args)
            except Exception:  # noqa: BLE001 - user code: log, never fatal
                _log.exception("exception in fabric_lib callback %r", callback)

    return run
