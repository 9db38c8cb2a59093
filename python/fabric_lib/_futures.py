"""Bridging native completion callbacks to concurrent.futures.Future and safe user callbacks."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any, Callable

_log = logging.getLogger("fabric_lib")


def completion_future() -> tuple[Future[None], Callable[[BaseException | None], None]]:
    """A pending Future plus the native callback that settles it (result None, or the error)."""
    future: Future[None] = Future()
    future.set_running_or_notify_cancel()

    def settle(error: BaseException | None) -> None:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    return future, settle


def guarded(callback: Callable[..., Any]) -> Callable[..., None]:
    """Wraps a user callback so an exception it raises is logged instead of escaping."""

    def run(*args: Any) -> None:
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - user code: log, never fatal
            _log.exception("exception in fabric_lib callback %r", callback)

    return run
