"""The trainer's staging memory: one registered buffer that packed and quantized slices are written
from. Its size is the watermark on temporary transfer memory: a slice waits for space until
earlier writes completed (bounded by the update's deadline)."""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any

from ..engine import MemoryRegion, TransferEngine
from ..errors import FabricTimeoutError, InvalidArgumentError

#: Slot offsets are aligned to this many bytes (vectorized copies, FP8 scale alignment).
ALIGN = 256


class StagingPool:
    """First-fit allocator over a registered tensor of ``nbytes`` bytes on ``device``."""

    def __init__(self, engine: TransferEngine, nbytes: int, device: Any) -> None:
        import torch

        if nbytes < ALIGN:
            raise InvalidArgumentError(f"staging memory must be at least {ALIGN} bytes, got {nbytes}")
        self.nbytes = nbytes - nbytes % ALIGN
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.region: MemoryRegion = engine.register_tensor(self.buffer)
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, length), sorted
        self._sizes: dict[int, int] = {}
        self._cond = threading.Condition()
        self.peak = 0

    def alloc(self, nbytes: int, deadline: float) -> int:
        """The offset of ``nbytes`` free bytes; waits (until ``deadline``, monotonic) for space."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        if size > self.nbytes:
            raise InvalidArgumentError(
                f"a {nbytes}-byte slice does not fit the {self.nbytes}-byte staging memory"
            )
        with self._cond:
            while True:
                for i, (off, length) in enumerate(self._free):
                    if length >= size:
                        if length == size:
                            del self._free[i]
                        else:
                            self._free[i] = (off + size, length - size)
                        self._sizes[off] = size
                        self.peak = max(self.peak, self.in_use)
                        return off
                left = deadline - time.monotonic()
                if left <= 0:
                    raise FabricTimeoutError(
                        f"no {nbytes} bytes of staging memory freed in time ({self.in_use} of {self.nbytes} in flight)"
                    )
                self._cond.wait(left)

    def release(self, offset: int) -> None:
        with self._cond:
            size = self._sizes.pop(offset)
            i = bisect.bisect(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            # coalesce with the neighbours
            if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
                self._free[i] = (self._free[i][0], self._free[i][1] + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        return sum(self._sizes.values())
