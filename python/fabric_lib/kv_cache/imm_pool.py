"""Immediate values owned by a decoder endpoint: one per request in flight, reused FIFO."""

from __future__ import annotations

import threading
from collections import deque

from ..errors import InvalidArgumentError
from .errors import KvCapacityError


class ImmPool:
    """Hands out ``[base, base + size)``. Values come back in FIFO order, so a value whose
    request failed (where a late arrival cannot be ruled out) is reused as late as possible."""

    def __init__(self, base: int, size: int) -> None:
        if size < 1 or base < 0 or base + size > 2**32:
            raise InvalidArgumentError(f"immediate range [{base}, {base + size}) must lie in [0, 2**32)")
        self.base, self.size = base, size
        self._free = deque(range(base, base + size))
        self._lock = threading.Lock()

    def acquire(self) -> int:
        with self._lock:
            if not self._free:
                raise KvCapacityError(f"all {self.size} immediate values are in use by requests in flight")
            return self._free.popleft()

    def release(self, imm: int) -> None:
        with self._lock:
            self._free.append(imm)

    @property
    def available(self) -> int:
        with self._lock:
            return len(self._free)
