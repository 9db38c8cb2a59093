"""A waitable ImmCounter: blocking, non-blocking and asyncio access to immediate counts."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import TYPE_CHECKING

from . import _fork
from ._futures import guarded
from .errors import EngineStoppedError, FabricError, FabricTimeoutError, InvalidArgumentError

if TYPE_CHECKING:
    from ._rust import TransferEngine as NativeEngine


def _resolve(reached: asyncio.Future[None]) -> None:
    if not reached.done():  # not already cancelled
        reached.set_result(None)


class ImmCounter:
    """Counts arrivals of one immediate value.

    While it exists the immediate is *claimed*: arrivals are counted even if a generic
    immediate callback is installed. ``wait`` and ``wait_async`` consume what they waited for.
    """

    def __init__(self, native: NativeEngine, imm: int) -> None:
        if not 0 <= imm < 2**32:
            raise InvalidArgumentError(f"imm must fit in 32 bits, got {imm}")
        self._native_engine = native
        self._created_in = _fork.generation()
        self._creator_pid = os.getpid()
        self.imm = imm
        self._claimed = True
        native.claim_imm(imm)

    @property
    def _native(self) -> NativeEngine:
        _fork.check(self._created_in, self._creator_pid, "counter's engine")
        return self._native_engine

    @property
    def value(self) -> int:
        """Arrivals counted and not yet consumed (non-blocking)."""
        return self._native.imm_count(self.imm)

    def wait(self, count: int, timeout: float) -> None:
        """Blocks (GIL released) until ``count`` arrivals are there, then consumes them.

        Raises FabricTimeoutError after ``timeout`` seconds, EngineStoppedError on stop.
        """
        self._native.wait_imm_count(self.imm, count, timeout)

    async def wait_async(self, count: int, timeout: float) -> None:
        """``await``-able ``wait``: no thread is blocked while waiting.

        Raises FabricTimeoutError after ``timeout`` seconds (EngineStoppedError if the engine was
        stopped meanwhile: nothing can arrive after a stop). If the awaiting task is cancelled
        (or times out), the pending expectation is removed and nothing is consumed, unless the
        count was reached at that very moment (then the arrivals are consumed and the cancellation
        still propagates).
        """
        if count < 0:
            raise InvalidArgumentError(f"count must be non-negative, got {count}")
        if not (timeout >= 0 and timeout != float("inf")):
            raise InvalidArgumentError(
                f"timeout must be a finite, non-negative number of seconds, got {timeout}"
            )
        native = self._native
        loop = asyncio.get_running_loop()
        reached: asyncio.Future[None] = loop.create_future()
        fired = threading.Event()

        def on_reached() -> None:
            fired.set()
            loop.call_soon_threadsafe(_resolve, reached)

        native.set_imm_count_expected(self.imm, count, guarded(on_reached))
        try:
            await asyncio.wait_for(reached, timeout)
        except TimeoutError:
            self._remove_expectation(native, fired)
            if fired.is_set():  # reached just as the time ran out: the arrivals were consumed
                return
            if native.stopped:
                raise EngineStoppedError(
                    f"the engine stopped while waiting for immediate {self.imm}"
                ) from None
            raise FabricTimeoutError(
                f"immediate {self.imm}: {count} arrivals not reached within {timeout:g}s"
            ) from None
        except BaseException:  # cancelled: the expectation must not outlive the task
            self._remove_expectation(native, fired)
            raise

    def _remove_expectation(self, native: NativeEngine, fired: threading.Event) -> None:
        if fired.is_set():
            return
        try:
            native.remove_imm_count(self.imm)
        except FabricError:  # engine stopped: nothing will fire any more
            pass

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
