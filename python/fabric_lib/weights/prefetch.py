"""Gathers ahead: a thread loads the trainer's units in schedule order (host->device copy, FSDP
all-gather) while the caller packs, quantizes and submits earlier ones. One thread keeps the
collectives in the same order on every rank; ``budget_bytes`` bounds what is held ahead (a unit
larger than the budget is loaded alone)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from ..errors import FabricTimeoutError

T = TypeVar("T")


class Prefetcher(Generic[T]):
    def __init__(
        self,
        items: Sequence[T],
        load: Callable[[T], Any],
        size: Callable[[T], int],
        budget_bytes: int,
        name: str = "weights-gather",
    ) -> None:
        self._items = list(items)
        self._load, self._size, self._budget = load, size, budget_bytes
        self._ready: deque[tuple[T, Any, BaseException | None]] = deque()
        self._held = 0
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for item in self._items:
            n = self._size(item)
            with self._cond:
                while not self._stop and self._held and self._held + n > self._budget:
                    self._cond.wait()
                if self._stop:
                    return
                self._held += n
            try:
                value, error = self._load(item), None
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                value, error = None, e
            with self._cond:
                self._ready.append((item, value, error))
                self._cond.notify_all()
            if error is not None:
                return

    def get(self, deadline: float) -> tuple[T, Any]:
        """The next item and its loaded value; raises what loading it raised."""
        with self._cond:
            while not self._ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FabricTimeoutError("the next unit was not gathered before the update's deadline")
                self._cond.wait(left)
            item, value, error = self._ready.popleft()
        if error is not None:
            raise error
        return item, value

    def release(self, item: T) -> None:
        """The consumer is done with ``item``'s value: its bytes no longer count."""
        with self._cond:
            self._held -= self._size(item)
            self._cond.notify_all()

    def close(self, timeout: float = 1.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout)
