"""Two engines in one process over each loopback provider: data, immediates, messages, errors."""

from __future__ import annotations

import pickle
import threading

import fabric_lib
import pytest
import torch
from fabric_lib import MrDescriptor


def test_write_with_imm_lands_every_byte(engine_pair) -> None:
    a, b = engine_pair
    src = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    rs, rd = a.register_tensor(src), b.register_tensor(dst)
    with b.imm_counter(77) as counter:
        futures = [
            a.submit_write(rs, rd.descriptor, 4096, src_offset=i * 4096 + 3, dst_offset=i * 4099, imm=77)
            for i in range(200)
        ]
        for f in futures:
            f.result(timeout=30)
        counter.wait(200, timeout=30)
        assert counter.value == 0
    for i in range(200):
        assert torch.equal(dst[i * 4099 : i * 4099 + 4096], src[i * 4096 + 3 : i * 4096 + 4099])


def test_imm_only_and_expectation_callback(engine_pair) -> None:
    a, b = engine_pair
    dst = torch.zeros(64, dtype=torch.uint8)
    rd = b.register_tensor(dst)
    reached = threading.Event()
    b.set_imm_count_expected(9, 3, reached.set)
    for _ in range(3):
        a.submit_imm(9, rd.descriptor).result(timeout=30)
    assert reached.wait(30)
    assert b.remove_imm_count(9) == 0


def test_messages_arrive_with_their_bytes(engine_pair) -> None:
    a, b = engine_pair
    got: list[bytes] = []
    done = threading.Event()

    def on_msg(m: bytes) -> None:
        got.append(m)
        if len(got) == 50:
            done.set()

    b.set_recv_callback(on_msg)
    for i in range(50):
        a.submit_send(b.main_address.to_bytes(), f"message {i}".encode() * (i + 1))
    assert done.wait(30)
    assert sorted(got) == sorted(f"message {i}".encode() * (i + 1) for i in range(50))


def test_descriptor_and_address_round_trip(engine_pair) -> None:
    a, _ = engine_pair
    region = a.register_tensor(torch.zeros(10))
    d = region.descriptor
    assert MrDescriptor.from_bytes(d.to_bytes()) == d
    assert pickle.loads(pickle.dumps(d)) == d
    assert d.length == 40 and d.kind == "host"
    addr = a.main_address
    assert fabric_lib.EngineAddress.from_hex(addr.to_hex()) == addr
    assert fabric_lib.EngineAddress.from_bytes(addr.to_bytes()) == addr


@pytest.mark.parametrize(
    "mangle",
    [
        lambda b: b[:-1],
        lambda b: b + b"\0",
        lambda b: b"XXXX" + b[4:],
        lambda b: b[:4] + b"\x09\x00" + b[6:],
        lambda b: b[:10] + bytes(len(b) - 10),
        lambda b: b"",
    ],
    ids=["truncated", "trailing", "magic", "version", "zeroed-payload", "empty"],
)
def test_corrupt_descriptor_bytes_are_rejected(engine_pair, mangle) -> None:
    a, _ = engine_pair
    good = a.register_tensor(torch.zeros(16)).descriptor.to_bytes()
    with pytest.raises(fabric_lib.InvalidDescriptorError):
        MrDescriptor.from_bytes(mangle(good))


def test_bad_input_raises_specific_errors_and_engine_survives(engine_pair) -> None:
    a, b = engine_pair
    src = a.register_tensor(torch.zeros(1024, dtype=torch.uint8))
    dst_tensor = torch.zeros(512, dtype=torch.uint8)
    dst = b.register_tensor(dst_tensor)
    with pytest.raises(fabric_lib.InvalidArgumentError, match="source range"):
        a.submit_write(src, dst.descriptor, 100, src_offset=1000)
    with pytest.raises(fabric_lib.InvalidArgumentError, match="destination range"):
        a.submit_write(src, dst.descriptor, 600)
    with pytest.raises(fabric_lib.InvalidArgumentError, match="destination range"):
        a.submit_write(src, dst.descriptor, 16, dst_offset=2**63)
    with pytest.raises(fabric_lib.InvalidArgumentError, match="contiguous"):
        a.register_tensor(torch.zeros(8, 8).t())
    with pytest.raises(fabric_lib.InvalidArgumentError):
        a.register_memory(0, 100)
    with pytest.raises(fabric_lib.InvalidArgumentError):
        a.submit_write(src, dst.descriptor, 8, imm=2**32)
    a.unregister_memory(src)
    with pytest.raises(fabric_lib.InvalidArgumentError, match="not registered"):
        a.submit_write(src, dst.descriptor, 8)
    with pytest.raises(fabric_lib.InvalidArgumentError, match="not registered"):
        a.unregister_memory(src)
    with pytest.raises(fabric_lib.InvalidArgumentError, match="max_message_size"):
        a.submit_send(b.main_address, bytes(a._native.max_message_size + 1))
    # Still works afterwards.
    src2 = a.register_tensor(torch.ones(64, dtype=torch.uint8))
    a.submit_write(src2, dst.descriptor, 64, imm=1).result(timeout=30)
    b.imm_counter(1).wait(1, timeout=30)
    assert int(dst_tensor[:64].sum()) == 64 and int(dst_tensor[64:].sum()) == 0


def test_descriptor_of_other_provider_is_rejected(engine_pair) -> None:
    a, _ = engine_pair
    other_provider = "shm" if not a.provider.startswith("shm") else "tcp"
    with fabric_lib.TransferEngine(other_provider, poll_mode="adaptive") as other:
        foreign = other.register_tensor(torch.zeros(16)).descriptor
        src = a.register_tensor(torch.zeros(16))
        with pytest.raises(fabric_lib.InvalidDescriptorError, match="engine uses"):
            a.submit_write(src, foreign, 16)


def test_submit_after_stop_and_stop_is_idempotent(engine_pair) -> None:
    a, b = engine_pair
    dst = b.register_tensor(torch.zeros(16))
    a.stop()
    a.stop()
    assert a.stopped
    with pytest.raises(fabric_lib.EngineStoppedError):
        a.submit_imm(1, dst.descriptor)
    with pytest.raises(fabric_lib.EngineStoppedError):
        a.register_tensor(torch.zeros(4))
    with pytest.raises(fabric_lib.EngineStoppedError):
        a.imm_counter(3).wait(1, timeout=5)


def test_wait_times_out(engine_pair) -> None:
    _, b = engine_pair
    with pytest.raises(fabric_lib.FabricTimeoutError, match="counted 0 of 1"):
        b.imm_counter(12345).wait(1, timeout=0.05)


def test_callback_exception_is_logged_not_fatal(engine_pair, caplog) -> None:
    a, b = engine_pair
    dst = b.register_tensor(torch.zeros(16))
    ran = threading.Event()

    def bad(_err) -> None:
        ran.set()
        raise RuntimeError("boom from user callback")

    with caplog.at_level("ERROR", logger="fabric_lib"):
        a.submit_imm(5, dst.descriptor, on_done=bad)
        assert ran.wait(30)
        a.submit_imm(5, dst.descriptor).result(timeout=30)  # engine still healthy
    assert any("boom from user callback" in r.getMessage() or r.exc_info for r in caplog.records)


def test_futures_work_with_asyncio(engine_pair) -> None:
    import asyncio

    a, b = engine_pair
    src = a.register_tensor(torch.arange(256, dtype=torch.uint8))
    dst_tensor = torch.zeros(256, dtype=torch.uint8)
    dst = b.register_tensor(dst_tensor)

    async def main() -> None:
        writes = [
            asyncio.wrap_future(
                a.submit_write(src, dst.descriptor, 16, src_offset=i * 16, dst_offset=i * 16, imm=33)
            )
            for i in range(16)
        ]
        await asyncio.gather(*writes)
        await asyncio.wrap_future(b.expect_imm_count(33, 16))

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert torch.equal(dst_tensor, torch.arange(256, dtype=torch.uint8))


def test_generic_imm_callback_gets_unclaimed_immediates(engine_pair) -> None:
    a, b = engine_pair
    dst = b.register_tensor(torch.zeros(8))
    seen: list[int] = []
    got = threading.Event()

    def on_imm(imm: int) -> None:
        seen.append(imm)
        if len(seen) == 3:
            got.set()

    b.set_imm_callback(on_imm)
    with b.imm_counter(1000) as claimed:
        for imm in (7, 1000, 8, 9):
            a.submit_imm(imm, b.main_address if imm == 9 else dst.descriptor).result(timeout=30)
        claimed.wait(1, timeout=30)
    assert got.wait(30)
    assert sorted(seen) == [7, 8, 9]
    b.set_imm_callback(None)
