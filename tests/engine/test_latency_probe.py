"""The latency probe (``enable_latency_probe`` / ``latency_marks``) and polling waits
(``wait_spin``): stage times of a round trip in order and on the application's clock, nothing
recorded while off, and waits that poll still count exactly, stay bounded and end on stop."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import fabric_lib
import pytest
from fabric_lib.errors import EngineStoppedError, FabricTimeoutError
from providers import provider_params

Pair = tuple[fabric_lib.TransferEngine, fabric_lib.TransferEngine]


@pytest.fixture(scope="module", params=provider_params())
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    # The receiver polls before it sleeps whatever the machine (wait_spin), so that path runs.
    a = fabric_lib.TransferEngine(request.param, poll_mode="adaptive", transfer_timeout=20.0)
    b = fabric_lib.TransferEngine(request.param, poll_mode="adaptive", transfer_timeout=20.0, wait_spin=0.05)
    yield a, b
    a.stop()
    b.stop()


def test_a_round_trip_passes_every_stage_in_order(pair: Pair) -> None:
    a, b = pair
    region = b.register_buffer(bytearray(64))
    counter = b.imm_counter(77)
    a.enable_latency_probe()
    b.enable_latency_probe()
    try:
        for _ in range(3):
            start = time.monotonic_ns()
            a.submit_imm(77, region.descriptor).result(timeout=20)
            counter.wait(1, timeout=20)
            end = time.monotonic_ns()
            sent, got = a.latency_marks(), b.latency_marks()
            assert start <= sent["enqueued"] <= sent["dequeued"] <= sent["posted"] <= end
            assert sent["posted"] <= sent["completed"] <= sent["callback_run"] <= end
            assert sent["posted"] <= got["imm_seen"] <= got["imm_counted"] <= got["wait_returned"] <= end
            assert "imm_seen" not in sent and "enqueued" not in got
    finally:
        a.enable_latency_probe(False)
        b.enable_latency_probe(False)
        counter.close()
        b.unregister_memory(region)


def test_nothing_is_recorded_while_off_and_enabling_clears(pair: Pair) -> None:
    a, b = pair
    region = b.register_buffer(bytearray(64))
    counter = b.imm_counter(78)
    try:
        a.enable_latency_probe()
        a.submit_imm(78, region.descriptor).result(timeout=20)
        counter.wait(1, timeout=20)
        assert "posted" in a.latency_marks()
        a.enable_latency_probe(False)
        a.enable_latency_probe(True)
        assert a.latency_marks() == {}
        a.enable_latency_probe(False)
        kept = b.latency_marks()  # turning off keeps the marks, and adds none
        a.submit_imm(78, region.descriptor).result(timeout=20)
        counter.wait(1, timeout=20)
        assert a.latency_marks() == {} and b.latency_marks() == kept
    finally:
        counter.close()
        b.unregister_memory(region)


def test_polling_waits_count_exactly_and_stay_bounded(pair: Pair) -> None:
    a, b = pair
    region = b.register_buffer(bytearray(64))
    counter = b.imm_counter(79)
    try:
        sent = [a.submit_imm(79, region.descriptor) for _ in range(200)]
        for f in sent:
            f.result(timeout=20)
        counter.wait(150, timeout=20)
        counter.wait(50, timeout=20)
        assert counter.value == 0
        started = time.monotonic()
        with pytest.raises(FabricTimeoutError):
            counter.wait(1, timeout=0.01)  # shorter than the engine's 50 ms of polling
        assert time.monotonic() - started < 5
    finally:
        counter.close()
        b.unregister_memory(region)


def test_stop_ends_a_polling_wait() -> None:
    engine = fabric_lib.TransferEngine("tcp", poll_mode="adaptive", wait_spin=10.0)
    counter = engine.imm_counter(5)
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            counter.wait(1, timeout=30)
        except BaseException as e:  # noqa: BLE001 - recorded for the assertion below
            errors.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    engine.stop()
    waiter.join(timeout=20)
    assert not waiter.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], EngineStoppedError)
