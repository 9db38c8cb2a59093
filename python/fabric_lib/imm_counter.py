"""A waitable ImmCounter: blocking and non-blocking access to immediate counts from Python."""

from __future__ import annotations

from typing import Any

from .errors import InvalidArgumentError


class ImmCounter:
    """Counts arrivals of one immediate value.

    While it exists the immediate is *claimed*: arrivals are counted even if a generic
    immediate callback is installed. ``wait`` consumes what it waited for.
    """

    def __init__(self, native: Any, imm: int) -> None:
        if not 0 <= imm < 2**32:
            raise InvalidArgumentError(f"imm must fit in 32 bits, got {imm}")
        self._native = native
        self.imm = imm
        self._claimed = True
        native.claim_imm(imm)

    @property
    def value(self) -> int:
        """Arrivals counted and not yet consumed (non-blocking)."""
        return self._native.imm_count(self.imm)

    def wait(self, count: int, timeout: float) -> None:
        """Blocks (GIL released) until ``count`` arrivals are there, then consumes them.

        Raises FabricTimeoutError after ``timeout`` seconds, EngineStoppedError on stop.
        """
        self._native.wait_imm_count(self.imm, count, timeout)

    def poll(self, count: int) -> bool:
        """Consumes ``count`` arrivals and returns True if they are there; else False at once."""
        return self._native.try_take_imm_count(self.imm, count)

    def close(self) -> None:
        """Releases the claim on the immediate."""
        if self._claimed:
            self._claimed = False
            self._native.unclaim_imm(self.imm)

    def __enter__(self) -> ImmCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ImmCounter(imm={self.imm}, value={self.value})"
