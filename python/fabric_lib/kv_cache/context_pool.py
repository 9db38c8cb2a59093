"""Fixed-size slots in one registered host buffer, for the per-request context (the prompt's
last hidden state or logits): the decoder receives it there, the prefiller stages it there."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError
from .errors import KvCapacityError


class ContextPool:
    def __init__(self, engine: Any, slots: int, slot_bytes: int) -> None:
        if slots < 1 or slot_bytes < 1:
            raise InvalidArgumentError(
                f"context pool needs slots >= 1 and slot_bytes >= 1, got {slots}, {slot_bytes}"
            )
        self.slots, self.slot_bytes = slots, slot_bytes
        self.buffer = np.zeros(slots * slot_bytes, dtype=np.uint8)
        self.region = engine.register_memory(self.buffer.ctypes.data, self.buffer.nbytes, owner=self.buffer)
        self._free = list(range(slots - 1, -1, -1))
        self._lock = threading.Lock()

    def acquire(self, nbytes: int) -> int:
        """A free slot's byte offset in the buffer."""
        if not 0 <= nbytes <= self.slot_bytes:
            raise InvalidArgumentError(
                f"context of {nbytes} bytes does not fit a {self.slot_bytes}-byte slot"
            )
        with self._lock:
            if not self._free:
                raise KvCapacityError(f"all {self.slots} context slots are in use")
            return self._free.pop() * self.slot_bytes

    def release(self, offset: int) -> None:
        with self._lock:
            self._free.append(offset // self.slot_bytes)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.buffer[offset : offset + nbytes]
