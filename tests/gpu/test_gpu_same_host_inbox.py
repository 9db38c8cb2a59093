"""Same-host GPU writes announce their immediate through the receiver's shared-memory inbox.

One GPU, two processes: the writer (this process) writes GPU → GPU, host → GPU and GPU → host
into a receiver process on the same device. With the receiver's inbox nothing is posted on a
domain (``domain_stats``), whatever ``write_completion`` says; with ``same_host_inbox_slots=0``
every immediate is one zero-byte write over the provider. Bytes and counts exact either way.
Skips without CUDA.
"""

from __future__ import annotations

from typing import Any, Literal

import fabric_lib
import fabric_lib.cuda as fcuda
import pytest
import torch
from fabric_lib.errors import CudaUnavailableError
from fabric_lib.testing import spawn_ranks


def _num_gpus() -> int:
    if not torch.cuda.is_available():
        return 0
    try:
        return fcuda.device_count()
    except CudaUnavailableError:
        return 0


needs_gpu = pytest.mark.skipif(_num_gpus() < 1, reason="needs a CUDA GPU (none visible)")

TIMEOUT = 30.0
NBYTES = 1 << 20
WRITES = 200


class _Receiver:
    def __init__(self, options: dict[str, Any]) -> None:
        torch.cuda.set_device(0)
        self.engine = fabric_lib.TransferEngine("tcp", "lo", transfer_timeout=TIMEOUT, **options)
        self.dst = {
            "gpu": torch.zeros(NBYTES, dtype=torch.uint8, device="cuda:0"),
            "host": torch.zeros(NBYTES, dtype=torch.uint8),
        }
        self.regions = {which: self.engine.register_tensor(t) for which, t in self.dst.items()}
        torch.cuda.synchronize()


def open_receiver(options: dict[str, Any]) -> _Receiver:
    return _Receiver(options)


def stop_receiver(rx: _Receiver) -> None:
    rx.engine.stop()


def descriptors(rx: _Receiver) -> dict[str, bytes]:
    return {which: r.descriptor.to_bytes() for which, r in rx.regions.items()}


def take(rx: _Receiver, imm: int, n: int, which: str) -> tuple[bytes, int]:
    """Waits for ``n`` arrivals of ``imm``; the ``which`` tensor's bytes (then zeroed) and the
    arrivals beyond ``n``."""
    rx.engine.imm_counter(imm).wait(n, timeout=TIMEOUT)
    extra = rx.engine.imm_counter(imm).value
    torch.cuda.synchronize()
    data = rx.dst[which].cpu().numpy().tobytes()
    rx.dst[which].zero_()
    torch.cuda.synchronize()
    return data, extra


@needs_gpu
@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("completion", ["auto", "transmit"])
@pytest.mark.parametrize("inbox_slots", [4096, 16, 0], ids=["inbox", "small-inbox", "no-inbox"])
def test_same_host_gpu_immediates_take_the_inbox(
    completion: Literal["auto", "transmit"], inbox_slots: int
) -> None:
    options = {"same_host_inbox_slots": inbox_slots}
    with spawn_ranks(
        1, setup=open_receiver, setup_kwargs={"options": options}, teardown=stop_receiver, timeout=120
    ) as (rx,):
        descs = {k: fabric_lib.MrDescriptor.from_bytes(v) for k, v in rx.call(descriptors).items()}
        torch.manual_seed(7)
        src = {
            "gpu": torch.randint(0, 256, (NBYTES,), dtype=torch.uint8, device="cuda:0"),
            "host": torch.randint(0, 256, (NBYTES,), dtype=torch.uint8),
        }
        with fabric_lib.TransferEngine(
            "tcp", "lo", transfer_timeout=TIMEOUT, write_completion=completion
        ) as w:
            regions = {k: w.register_tensor(t) for k, t in src.items()}
            torch.cuda.synchronize()
            chunk = NBYTES // WRITES
            for n, (s, d) in enumerate([("gpu", "gpu"), ("host", "gpu"), ("gpu", "host")]):
                imm = 900 + n
                arrived = rx.submit(take, imm, WRITES, d)
                futures = [
                    w.submit_write(
                        regions[s], descs[d], chunk, src_offset=i * chunk, dst_offset=i * chunk, imm=imm
                    )
                    for i in range(WRITES)
                ]
                for f in futures:
                    f.result(TIMEOUT)
                data, extra = arrived.result(TIMEOUT + 10)
                want = src[s].cpu()[: WRITES * chunk]
                got = torch.frombuffer(bytearray(data), dtype=torch.uint8)[: WRITES * chunk]
                assert torch.equal(got, want), f"{s} -> {d}: bytes differ"
                assert extra == 0, f"{s} -> {d}: an immediate was counted twice"
            posted = sum(ops for ops, _ in w.domain_stats())
            if inbox_slots:
                assert posted == 0, "same-host immediates went over the provider"
            else:
                assert posted == 3 * WRITES, "each immediate is one write over the provider"
