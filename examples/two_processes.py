"""Two processes, one write: the receiver registers a buffer and counts immediate 7; the writer
writes 1 MiB into it with that immediate. The only thing exchanged out of band is the
receiver's memory descriptor, as a hex string (any channel works: here a pipe).

    python examples/two_processes.py [--provider tcp]

Needs only fabric_lib (no torch, no GPU).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
from multiprocessing.connection import Connection

import fabric_lib

SIZE = 1 << 20
IMM = 7


def receiver(provider: str, conn: Connection) -> None:
    with fabric_lib.TransferEngine(provider, poll_mode="adaptive") as engine:
        buffer = bytearray(SIZE)
        region = engine.register_buffer(buffer)
        counter = engine.imm_counter(IMM)  # count IMM from now on
        conn.send(region.descriptor.to_hex())  # tell the writer where to write
        counter.wait(1, timeout=30)  # the write's bytes are in `buffer` now
        conn.send(buffer == bytes(i % 251 for i in range(SIZE)))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--provider", default="tcp", help="libfabric provider (tcp, udp;ofi_rxd, shm, efa, ...)"
    )
    args = parser.parse_args()

    ctx = mp.get_context("spawn")  # engines do not survive fork: start children fresh
    mine, theirs = ctx.Pipe()
    child = ctx.Process(target=receiver, args=(args.provider, theirs))
    child.start()
    try:
        with fabric_lib.TransferEngine(args.provider, poll_mode="adaptive") as engine:
            source = engine.register_buffer(bytearray(i % 251 for i in range(SIZE)))
            if not mine.poll(60):
                raise SystemExit("the receiver did not start within 60 s")
            destination = fabric_lib.MrDescriptor.from_hex(mine.recv())
            engine.submit_write(source, destination, imm=IMM).result(timeout=30)
            if not mine.poll(60):
                raise SystemExit("the receiver did not report within 60 s")
            intact = mine.recv()
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    print(f"wrote {SIZE} bytes over {args.provider}; receiver saw them {'intact' if intact else 'CORRUPTED'}")
    raise SystemExit(0 if intact and child.exitcode == 0 else 1)


if __name__ == "__main__":
    main()
