"""asyncio waits on immediate counts: ``ImmCounter.wait_async`` and ``expect_imm_count`` through
``asyncio.wrap_future``; a timeout or a cancelled task removes the expectation, so arrivals after
it are counted, not swallowed by an expectation nobody awaits any more."""

from __future__ import annotations

import asyncio

import fabric_lib
import pytest
from fabric_lib import errors


def _send_imms(a: fabric_lib.TransferEngine, b: fabric_lib.TransferEngine, imm: int, n: int) -> None:
    for _ in range(n):
        a.submit_imm(imm, b.main_address).result(timeout=20)


def test_wait_async_returns_when_the_count_is_reached(tcp_pair) -> None:
    a, b = tcp_pair

    async def scenario() -> int:
        with b.imm_counter(21) as counter:
            waiter = asyncio.create_task(counter.wait_async(3, timeout=20))
            await asyncio.sleep(0.05)
            assert not waiter.done()
            await asyncio.to_thread(_send_imms, a, b, 21, 4)
            await waiter
            return counter.value  # 3 consumed, 1 left

    assert asyncio.run(scenario()) == 1


def test_wait_async_timeout_is_typed_and_consumes_nothing(tcp_pair) -> None:
    a, b = tcp_pair

    async def scenario() -> int:
        with b.imm_counter(22) as counter:
            with pytest.raises(errors.FabricTimeoutError, match="within 0.1s"):
                await counter.wait_async(1, timeout=0.1)
            await asyncio.to_thread(_send_imms, a, b, 22, 1)
            await asyncio.sleep(0.2)
            return counter.value

    assert asyncio.run(scenario()) == 1  # the late arrival is counted, not eaten by a dead expectation


def test_cancelled_wait_async_removes_its_expectation(tcp_pair) -> None:
    a, b = tcp_pair

    async def scenario() -> tuple[int, int]:
        with b.imm_counter(23) as counter:
            waiter = asyncio.create_task(counter.wait_async(1, timeout=60))
            await asyncio.sleep(0.05)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            await asyncio.to_thread(_send_imms, a, b, 23, 1)
            await asyncio.sleep(0.2)
            seen = counter.value
            await counter.wait_async(1, timeout=5)  # a new wait on the same immediate works
            return seen, counter.value

    assert asyncio.run(scenario()) == (1, 0)


def test_cancelled_expect_imm_count_removes_its_expectation(tcp_pair) -> None:
    a, b = tcp_pair

    async def scenario() -> int:
        waiter = asyncio.ensure_future(asyncio.wrap_future(b.expect_imm_count(24, 1)))
        await asyncio.sleep(0.05)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await asyncio.to_thread(_send_imms, a, b, 24, 1)
        await asyncio.sleep(0.2)
        with b.imm_counter(24) as counter:
            return counter.value

    assert asyncio.run(scenario()) == 1


def test_wait_async_rejects_bad_arguments(tcp_pair) -> None:
    _, b = tcp_pair

    async def scenario() -> None:
        with b.imm_counter(25) as counter:
            with pytest.raises(errors.InvalidArgumentError, match="timeout"):
                await counter.wait_async(1, timeout=float("nan"))
            with pytest.raises(errors.InvalidArgumentError, match="count"):
                await counter.wait_async(-1, timeout=1)

    asyncio.run(scenario())


def test_wait_async_on_a_stopped_engine_says_so() -> None:
    engine = fabric_lib.TransferEngine("tcp", poll_mode="adaptive")

    async def scenario() -> None:
        counter = engine.imm_counter(26)
        waiter = asyncio.create_task(counter.wait_async(1, timeout=0.5))
        await asyncio.sleep(0.05)
        engine.stop()
        with pytest.raises(errors.EngineStoppedError, match="stopped"):
            await waiter

    asyncio.run(scenario())
