"""Futures settled by the engine, and safe user callbacks.

Callbacks (``on_done``, receive and immediate callbacks, a Future's done-callbacks) run on the
engine's callback thread. That thread also settles every Future, so a callback that blocks on a
pending Future would wait on itself forever: ``EngineFuture.result``/``exception`` refuse that
with ``CallbackThreadError`` instead.

An ``EngineFuture`` is a ``concurrent.futures.Future`` whose outcome lives in a native
``Completion``: the engine records it there without taking the GIL, and the Future reads it
when it is next looked at (``done``, ``result``, ...). The callback thread runs Python for a
Future only once something must happen at completion: a done-callback was added, or
``concurrent.futures.wait``/``as_completed`` (which read the private ``_state`` and install
waiters) is watching it. A Future nobody watches thus costs the callback thread no GIL, which
would otherwise contend with the thread that submitted the request.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures._base import LOGGER as _FUTURES_LOG
from typing import TYPE_CHECKING, Any, Callable

from .errors import CallbackThreadError, FabricError, FabricTimeoutError

if TYPE_CHECKING:
    from ._rust import Completion

_log = logging.getLogger("fabric_lib")
_state = threading.local()

# concurrent.futures' state names (module-private there, stable since Python 3.2)
_PENDING = "PENDING"
_RUNNING = "RUNNING"
_CANCELLED = "CANCELLED"
_CANCELLED_AND_NOTIFIED = "CANCELLED_AND_NOTIFIED"
_FINISHED = "FINISHED"
_UNSETTLED = (_PENDING, _RUNNING)
_CANCELLED_STATES = (_CANCELLED, _CANCELLED_AND_NOTIFIED)


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
    """A Future settled by the engine (see the module's docstring); blocking on it from a
    callback raises instead of hanging.

    ``Future.__init__`` is not called: the condition is made on first use (most Futures of a
    latency-bound loop are only ever asked ``result()`` after they completed), and ``_state`` is
    a property that brings the native outcome in when code outside this class reads it.
    """

    def __init__(self, native: Completion, initial: str = _RUNNING) -> None:
        self._native = native
        self._st = initial  # the Python-side state; RUNNING/PENDING until synced from native
        self._armed = False  # native calls _settle on completion
        self._result = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Callable[[Future[None]], object]] = []

    # -- Future's private attributes, as concurrent.futures.wait/as_completed use them --------
    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        cond = self.__dict__.get("_cond")
        if cond is None:  # setdefault is atomic: racing threads end up with the same condition
            cond = self.__dict__.setdefault("_cond", threading.Condition())
        return cond

    @property
    def _state(self) -> str:
        """The state for code that reads Future internals (``wait``, ``as_completed``): it
        holds the condition and may install a waiter next, so the native side is armed to
        settle this Future (and notify waiters) on the callback thread."""
        if self._st in _UNSETTLED:
            with self._condition:
                if self._st in _UNSETTLED:
                    self._arm()
        return self._st

    @_state.setter
    def _state(self, value: str) -> None:
        self._st = value

    # -- settling -------------------------------------------------------------------------------
    def _sync(self) -> None:
        """Brings a finished (or cancelled) native outcome in; the caller saw it done."""
        cond = self.__dict__.get("_cond")
        if cond is None:
            # Nobody made the condition, so nobody armed the native side or installed a waiter,
            # and nobody can any more (arming fails once the native side is done): under the
            # GIL, setting the fields (the exception before the state) needs no lock.
            if self._st in _UNSETTLED:
                self._take_outcome()
            return
        with cond:
            if self._st not in _UNSETTLED:
                return
            self._take_outcome()
            if self._st == _FINISHED:
                for waiter in self._waiters:
                    if self._exception is None:
                        waiter.add_result(self)
                    else:
                        waiter.add_exception(self)
            cond.notify_all()

    def _take_outcome(self) -> None:
        native = self._native
        if native.cancelled():  # only ever under the condition (ExpectationFuture.cancel)
            self._st = _CANCELLED
            return
        self._exception = native.error()
        self._st = _FINISHED

    def _arm(self) -> bool:
        """Under the condition, while unsettled: makes the native side call ``_settle`` once
        done. False if it already is done (then this Future is synced now)."""
        if self._armed:
            return True
        if self._native.call_when_done(self._settle):
            self._armed = True
            return True
        self._sync()
        return False

    def _settle(self) -> None:
        """Called by the native side on the callback thread once done (when armed)."""
        with _IN_CALLBACK:  # done-callbacks run here, on the callback thread
            with self._condition:
                self._sync()
                callbacks, self._done_callbacks = self._done_callbacks, []
            self._run_callbacks(callbacks)

    def _run_callbacks(self, callbacks: list[Callable[[Future[None]], object]]) -> None:
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - as concurrent.futures does: log, never fatal
                _FUTURES_LOG.exception("exception calling callback for %r", self)

    def _settled_state(self) -> str:
        st = self._st
        if st in _UNSETTLED and self._native.done():
            self._sync()
            st = self._st
        return st

    def _wait_settled(self, method: str, timeout: float | None) -> str:
        st = self._settled_state()
        if st in _UNSETTLED:
            if on_callback_thread():
                raise CallbackThreadError(
                    f"Future.{method}() called inside a fabric_lib callback: the callback thread "
                    "settles this Future and would wait on itself. Chain work with "
                    "add_done_callback or on_done, or hand the wait to another thread."
                )
            if not self._native.wait(timeout):
                # a TimeoutError, as concurrent.futures raises
                raise FabricTimeoutError(f"Future.{method}() timed out after {timeout}s")
            self._sync()
            st = self._st
        return st

    # -- the public Future interface ------------------------------------------------------------
    def done(self) -> bool:
        return self._settled_state() not in _UNSETTLED

    def running(self) -> bool:
        return self._settled_state() == _RUNNING

    def cancelled(self) -> bool:
        return self._settled_state() in _CANCELLED_STATES

    def cancel(self) -> bool:
        """A request's Future runs from the start: it cannot be cancelled (False)."""
        return self._settled_state() in _CANCELLED_STATES

    def result(self, timeout: float | None = None) -> None:
        st = self._wait_settled("result", timeout)
        if st in _CANCELLED_STATES:
            raise CancelledError()
        error = self._exception
        if error is not None:
            try:
                raise error
            finally:
                error = None  # no frame-exception cycle
        return None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        st = self._wait_settled("exception", timeout)
        if st in _CANCELLED_STATES:
            raise CancelledError()
        return self._exception

    def add_done_callback(self, fn: Callable[[Future[None]], object]) -> None:
        if self._settled_state() in _UNSETTLED:
            with self._condition:
                if self._st in _UNSETTLED and self._arm():
                    self._done_callbacks.append(fn)
                    return
        self._run_callbacks([fn])

    def set_running_or_notify_cancel(self) -> bool:
        raise InvalidStateError("the engine settles this Future")

    def set_result(self, result: None) -> None:
        raise InvalidStateError("the engine settles this Future")

    def set_exception(self, exception: BaseException | None) -> None:
        raise InvalidStateError("the engine settles this Future")


class ExpectationFuture(EngineFuture):
    """A pending Future for an immediate-count expectation; ``cancel()`` removes the expectation
    (``asyncio.wrap_future`` cancels it when the awaiting task is cancelled)."""

    def __init__(self, native: Completion, remove: Callable[[], object]) -> None:
        super().__init__(native, _PENDING)
        self._remove = remove

    def cancel(self) -> bool:
        st = self._settled_state()
        if st in _CANCELLED_STATES:
            return True
        if st not in _UNSETTLED:
            return False
        try:
            self._remove()  # the expectation will not fire (or has fired: then cancel fails below)
        except FabricError:  # engine stopped: nothing will fire any more
            pass
        with self._condition:
            if self._st in _CANCELLED_STATES:
                return True
            if self._st not in _UNSETTLED or not self._native.cancel():
                self._sync()  # reached meanwhile
                return self._st in _CANCELLED_STATES
            self._st = _CANCELLED
            self._condition.notify_all()
            callbacks, self._done_callbacks = self._done_callbacks, []
        self._run_callbacks(callbacks)
        return True


def guarded(callback: Callable[..., Any]) -> Callable[..., None]:
    """Wraps a user callback so an exception it raises is logged instead of escaping."""

    def run(*args: Any) -> None:
        with _IN_CALLBACK:
            try:
                callback(*args)
            except Exception:  # noqa: BLE001 - user code: log, never fatal
                _log.exception("exception in fabric_lib callback %r", callback)

    return run
