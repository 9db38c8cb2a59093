"""asyncio: await immediates instead of blocking a thread, and time out or cancel cleanly.

    python examples/asyncio_counter.py [--provider tcp]

Two engines in one process for brevity; across processes only the descriptor travels (see
two_processes.py).
"""

from __future__ import annotations

import argparse
import asyncio

import fabric_lib


async def run(provider: str) -> None:
    with (
        fabric_lib.TransferEngine(provider, poll_mode="adaptive") as writer,
        fabric_lib.TransferEngine(provider, poll_mode="adaptive") as reader,
    ):
        source = writer.register_buffer(bytearray(b"x" * 4096))
        destination = reader.register_buffer(bytearray(4096))
        with reader.imm_counter(42) as counter:
            for _ in range(3):  # each write carries immediate 42
                await asyncio.wrap_future(writer.submit_write(source, destination.descriptor, imm=42))
            await counter.wait_async(3, timeout=10)  # all three have landed
            print("three writes landed")
            try:
                await counter.wait_async(1, timeout=0.2)  # nothing more is coming
            except fabric_lib.FabricTimeoutError:
                print("a fourth did not arrive within 0.2 s (as expected)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--provider", default="tcp", help="libfabric provider (tcp, udp;ofi_rxd, shm, ...)")
    asyncio.run(run(parser.parse_args().provider))


if __name__ == "__main__":
    main()
