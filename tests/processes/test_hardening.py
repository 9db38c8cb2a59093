"""What a faulty caller or peer can do to an engine from Python: extreme configuration, memory
that is not there, engines dropped without stop(), forged bytes, a peer that stops answering.
Every case must end in a typed FabricError (never a crash, a hang or a PanicException)."""

from __future__ import annotations

import gc
import math
import mmap
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fabric_lib
import numpy as np
import pytest
from fabric_lib.errors import (
    EngineStoppedError,
    FabricError,
    FabricTimeoutError,
    InvalidArgumentError,
    InvalidDescriptorError,
    PeerFencedError,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .peer import peers, sigstop, stale_immediates, wait_imms

BAD_OPTIONS: list[dict[str, Any]] = [
    {"transfer_timeout": 1e19},
    {"transfer_timeout": 1e20},
    {"transfer_timeout": -1.0},
    {"transfer_timeout": math.nan},
    {"transfer_timeout": math.inf},
    {"transfer_timeout": 0.0},
    {"command_timeout": 1e300},
    {"wait_spin": -1.0},
    {"wait_spin": math.nan},
    {"max_message_size": 2**30},
    {"max_message_size": 0},
    {"max_message_size": -5},
    {"send_buffers": 10**9},
    {"recv_buffers": 0},
    {"recv_buffers": 65536, "max_message_size": 65536},
    {"queue_depth": 0},
    {"queue_depth": 2**40},
    {"paged_copy_blocks": 0},
    {"paged_copy_blocks": 2**32},
    {"worker_cpu": 10**6},
    {"worker_cpu": -1},
    {"uvm_watcher_cpu": 2**63},
    {"cuda_device": -1},
    {"cuda_device": "cuda:0"},
    {"poll_mode": "sometimes"},
    {"write_completion": "eventually"},
    {"shard_min_bytes": -1},
    {"max_message_size": "big"},
]


@pytest.mark.parametrize("options", BAD_OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_bad_configuration_is_a_typed_error(options: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        fabric_lib.TransferEngine("tcp", **options)


def test_bad_domain_argument_is_a_typed_error() -> None:
    with pytest.raises(InvalidArgumentError):
        fabric_lib.TransferEngine("tcp", 42)  # type: ignore[arg-type]


def test_defaults_are_listed_once() -> None:
    defaults = fabric_lib.engine_defaults()
    assert defaults["transfer_timeout"] == 30.0 and defaults["write_completion"] == "auto"
    options: dict[str, Any] = {k: v for k, v in defaults.items() if v is not None}
    with fabric_lib.TransferEngine("tcp", **options) as e:
        assert e.main_address.provider.startswith("tcp")


@pytest.mark.parametrize("timeout", [1e20, -1.0, math.nan])
def test_extreme_wait_timeouts_are_typed_errors(timeout: float) -> None:
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive") as e:
        counter = e.imm_counter(1)
        with pytest.raises(InvalidArgumentError):
            counter.wait(1, timeout=timeout)


def test_memory_that_is_not_there_cannot_be_registered() -> None:
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive") as e:
        with pytest.raises(InvalidArgumentError, match="not mapped"):
            e.register_memory(0x1000, 4096, device=-1)
        ro = mmap.mmap(-1, 8192, prot=mmap.PROT_READ)
        ptr = np.frombuffer(ro, dtype=np.uint8).ctypes.data
        with pytest.raises(InvalidArgumentError, match="not writable"):
            e.register_memory(ptr, 8192, device=-1)
        rw = np.zeros(8192, dtype=np.uint8)
        region = e.register_memory(rw.ctypes.data, rw.nbytes, rw)
        e.unregister_memory(region)


def test_engine_dropped_without_stop_while_a_counter_lives() -> None:
    """The native engine must not keep registrations of freed memory: the engine stops itself when
    collected, the counter reports the stop, and a peer's large write lands nowhere."""
    writer = fabric_lib.TransferEngine("tcp", poll_mode="adaptive", transfer_timeout=3.0)
    receiver = fabric_lib.TransferEngine("tcp", poll_mode="adaptive", transfer_timeout=3.0)
    buf = np.zeros(64 << 20, dtype=np.uint8)
    descriptor = receiver.register_memory(buf.ctypes.data, buf.nbytes, buf).descriptor
    counter = receiver.imm_counter(9)
    del receiver, buf
    gc.collect()
    with pytest.raises(EngineStoppedError):
        counter.wait(1, timeout=1.0)
    src = np.ones(64 << 20, dtype=np.uint8)
    region = writer.register_memory(src.ctypes.data, src.nbytes, src)
    with pytest.raises(FabricError):
        writer.submit_write(region, descriptor, imm=9).result(timeout=20)
    writer.stop()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=400), cut=st.integers(0, 400), flip=st.integers(0, 8 * 400))
def test_forged_address_and_descriptor_bytes_are_typed_errors(data: bytes, cut: int, flip: int) -> None:
    real = _REAL_BYTES
    flipped = bytearray(real)
    if flip < 8 * len(real):
        flipped[flip // 8] ^= 1 << (flip % 8)
    candidates = [data, real[:cut], bytes(flipped)]
    for raw in candidates:
        for cls in (fabric_lib.EngineAddress, fabric_lib.MrDescriptor):
            try:
                cls.from_bytes(bytes(raw))
            except InvalidDescriptorError:
                continue
            assert bytes(raw) == real and cls is fabric_lib.EngineAddress, "forged bytes decoded"


def _real_address_bytes() -> bytes:
    with fabric_lib.TransferEngine("tcp", poll_mode="adaptive") as e:
        return e.main_address.to_bytes()


_REAL_BYTES = _real_address_bytes()


# -- a peer that stops answering --------------------------------------------------------------
def test_timed_out_peer_is_fenced_until_readmitted() -> None:
    with peers("tcp", ["receiver"]) as (receiver,):
        peer = fabric_lib.EngineAddress.from_bytes(receiver.address)
        dst = fabric_lib.MrDescriptor.from_bytes(receiver.descriptor)
        with fabric_lib.TransferEngine("tcp", poll_mode="adaptive", transfer_timeout=2.0) as e:
            src = np.ones(1 << 20, dtype=np.uint8)
            region = e.register_memory(src.ctypes.data, src.nbytes, src)
            e.submit_write(region, dst, imm=3).result(timeout=10)
            os.kill(receiver.pid, signal.SIGSTOP)
            try:
                with pytest.raises(FabricTimeoutError) as timed_out:
                    for _ in range(64):  # fill the socket buffers until a write stalls
                        e.submit_write(region, dst, imm=3).result(timeout=10)
                assert not isinstance(timed_out.value, PeerFencedError)
                t = time.monotonic()
                with pytest.raises(PeerFencedError):
                    e.submit_write(region, dst, imm=3).result(timeout=10)
                assert time.monotonic() - t < 1.0, "a fenced peer fails at once"
            finally:
                os.kill(receiver.pid, signal.SIGCONT)
            assert e.readmit_peer(peer).fenced
            assert not e.readmit_peer(peer), "re-admitting a peer that is not fenced does nothing"
            e.submit_write(region, dst, imm=3).result(timeout=10)


REQUESTS = 100


def _readmit(e: fabric_lib.TransferEngine, peer: fabric_lib.EngineAddress) -> fabric_lib.Readmission:
    """``readmit_peer``, repeated (up to 3 times) if the peer did not answer in time, as the API
    allows: a repeated handshake gets the same report."""
    for _ in range(2):
        try:
            return e.readmit_peer(peer)
        except FabricTimeoutError:
            continue
    return e.readmit_peer(peer)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("provider", "domains"),
    [
        pytest.param("tcp", None, id="tcp"),
        pytest.param("shm", None, id="shm"),
        pytest.param("udp;ofi_rxd", None, id="udp-rxd"),
        # Writes on the second domain, handshake on the first, re-admission started while the
        # receiver sleeps. The 100 MiB of writes do not fit in the socket buffers: most are still
        # queued at the writer when the handshake ends their epoch, so they arrive late.
        pytest.param("tcp", ["lo", "lo"], id="tcp-late-deliveries"),
    ],
)
def test_timed_out_requests_are_counted_once_after_readmission(
    provider: str, domains: list[str] | None
) -> None:
    """100 requests time out while the receiver is stopped; it resumes; the writer re-admits it,
    learns what was counted and resends the rest. Every immediate is counted exactly once:
    nothing of the ended epoch is counted after the handshake."""
    imms = range(1000, 1000 + REQUESTS)
    late = domains is not None
    with peers(provider, ["receiver"], engine_kwargs={"domain": domains} if late else None) as (receiver,):
        peer = fabric_lib.EngineAddress.from_bytes(receiver.address)
        dst = fabric_lib.MrDescriptor.from_bytes(receiver.descriptor)
        # Delivery completion: a write is done once it landed, so every provider times out on a
        # stopped receiver (shm's transmit completion would report small writes done at once).
        options: dict[str, Any] = {"transfer_timeout": 2.0, "write_completion": "delivery"}
        with fabric_lib.TransferEngine(provider, domains, poll_mode="adaptive", **options) as e:
            src = np.ones(1 << 20, dtype=np.uint8)
            region = e.register_memory(src.ctypes.data, src.nbytes, src)
            n_domains = len(domains or [None])
            for d in range(n_domains):  # connects every domain before the receiver stops
                e.submit_write(region, dst, 4096, imm=1, domain=d).result(timeout=10)
            pinned = n_domains - 1
            size = src.nbytes if late else 4096

            def write(imm: int) -> Future[None]:
                offset = size * imm % dst.length
                return e.submit_write(region, dst, size, dst_offset=offset, imm=imm, domain=pinned)

            sigstop(receiver.pid)
            try:
                futures = [write(i) for i in imms]
                for f in futures:
                    with pytest.raises(FabricTimeoutError):  # timed out, or failed by the fence
                        f.result(timeout=30)
                with ThreadPoolExecutor(1) as pool:
                    pending = pool.submit(_readmit, e, peer)
                    if late:
                        time.sleep(0.3)  # the handshake waits at the stopped receiver
                    os.kill(receiver.pid, signal.SIGCONT)
                    readmission = pending.result(timeout=30)
            finally:
                os.kill(receiver.pid, signal.SIGCONT)
            assert readmission.fenced and readmission.counted is not None
            counted = readmission.counted
            assert counted.get(1) == n_domains, "the report covers the whole epoch that ended"
            assert all(counted.get(i, 0) <= 1 for i in imms)
            missing = [i for i in imms if i not in counted]
            for f in [write(i) for i in missing]:
                f.result(timeout=10)
            expected = {1: n_domains, **{i: 1 for i in imms}}
            # Waits for every count, then checks that nothing more arrives (leftovers are zero).
            left = receiver.call(wait_imms, expected, timeout=30.0, settle=1.0)
            assert left == dict.fromkeys(expected, 0), "an immediate was counted twice"
            stale = receiver.call(stale_immediates)
            assert stale <= len(missing), "only requests missing from the report can arrive late"
            if late:
                assert stale > 0, "the late deliveries reached the receiver after the handshake"
            print(
                f"{provider}: {REQUESTS - len(missing)} counted, {len(missing)} resent, {stale} dropped late"
            )
