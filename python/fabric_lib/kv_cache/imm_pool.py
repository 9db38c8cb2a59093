"""Immediate values owned by a decoder endpoint: one slot per request in flight, reused FIFO."""

from __future__ import annotations

import threading
from collections import deque

from ..errors import InvalidArgumentError
from .errors import KvCapacityError


class ImmPool:
    """Hands out ``slots`` slots of ``width`` consecutive values from ``base`` (a slot's first
    value identifies it). Slots come back in FIFO order, so a slot whose request failed (where a
    late arrival cannot be ruled out) is reused as late as possible."""

    def __init__(self, base: int, slots: int, width: int = 1) -> None:
        if slots < 1 or width < 1 or base < 0 or base + slots * width > 2**32:
            raise InvalidArgumentError(
                f"{slots} immediate slots of {width} values from {base} must lie in [0, 2**32)"
            )
        self.base, self.size, self.width = base, slots, width
        self._free = deque(range(base, base + slots * width, width))
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise KvCapacityError(f"all {self.size} immediate slots are in use by requests in flight")
            return self._free.popleft()

    def release(self, imm: int) -> None:
        with self._lock:
            self._free.append(imm)

    @property
    def available(self) -> int:
        with self._lock:
            return len(self._free)
