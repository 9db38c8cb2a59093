"""The imm round trip from Python: a client of ``fabric-debug server`` that does what
``fabric-debug client --tests rtt`` does, through the Python API.

    python -m benchmarks.python_rtt --connect HOST:PORT [--provider tcp] [--wait counter|future]
                                    [--iters N] [--warmup-iters N] [--breakdown]

Each round trip is ``submit_imm(ping, server_address)`` (an immediate to the server's engine)
followed by ``ImmCounter.wait(1)`` on the pong (``--wait counter``) or by the Future of
``expect_imm_count(pong, 1)`` armed before the submit (``--wait future``); the server (armed with
one triggered pong per ping) answers.
``--breakdown`` turns the engine's latency probe on and reports p50/p99 per step, with the same
step names as ``fabric-debug client --breakdown``: ``app_to_enqueued`` and
``wait_returned_to_app`` here include the Python layer (argument conversion, releasing and taking
back the GIL). Each round trip then also waits for the ping's own Future before the next.

Prints one JSON line: ``{"rtt": {"iters", "wait", "p50_us", "p99_us", "min_us", "mean_us",
"max_us", "breakdown": [{"step", "p50_us", "p99_us", "samples"}]}}``. The bootstrap is the one
of fabric-debug (length-prefixed JSON over TCP; see fabric-lib/fabric-debug/src/bootstrap.rs);
every socket operation and wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import struct
import sys
import time
from concurrent.futures import Future

from fabric_lib import EngineAddress, MrDescriptor, TransferEngine

IMM_PING = 4
IMM_PONG = 5
MAX_FRAME = 1 << 20

#: (step, from stage, to stage); None is the application's own stamp (its call for a ``from``,
#: its return for a ``to``). Same as fabric-debug's latency.rs.
STEPS: list[tuple[str, str | None, str | None]] = [
    ("app_to_enqueued", None, "enqueued"),
    ("enqueued_to_dequeued", "enqueued", "dequeued"),
    ("dequeued_to_posted", "dequeued", "posted"),
    ("posted_to_imm_seen", "posted", "imm_seen"),
    ("imm_seen_to_imm_counted", "imm_seen", "imm_counted"),
    ("imm_counted_to_wait_returned", "imm_counted", "wait_returned"),
    ("wait_returned_to_app", "wait_returned", None),
    ("imm_counted_to_app", "imm_counted", None),
    ("posted_to_completed", "posted", "completed"),
    ("completed_to_callback_run", "completed", "callback_run"),
]


class BootstrapError(RuntimeError):
    """The fabric-debug server answered something unexpected, or not in time."""


class Channel:
    """fabric-debug's bootstrap framing: a big-endian u32 length, then JSON."""

    def __init__(self, address: str, connect_timeout: float, io_timeout: float) -> None:
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self.sock = socket.create_connection((host, int(port)), timeout=io_timeout)
                break
            except ConnectionRefusedError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, msg: dict) -> None:
        body = json.dumps(msg).encode()
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def _read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise BootstrapError("the server closed the bootstrap connection")
            data += chunk
        return data

    def recv(self) -> dict:
        (length,) = struct.unpack(">I", self._read(4))
        if length > MAX_FRAME:
            raise BootstrapError(f"bootstrap frame of {length} bytes: not a fabric-debug server?")
        msg = json.loads(self._read(length))
        if not isinstance(msg, dict):
            raise BootstrapError(f"malformed control message {msg!r}")
        return msg

    def expect_ok(self, what: str) -> None:
        reply = self.recv()
        if reply.get("type") != "reply" or not reply.get("ok"):
            raise BootstrapError(f"{what}: the server answered {reply!r}")


def percentile(values: list[float], p: float) -> float:
    """Nearest rank, as fabric-debug's report.rs."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = math.ceil(p / 100 * len(ordered))
    return ordered[min(max(rank, 1), len(ordered)) - 1]


def breakdown_of(samples: dict[str, list[float]]) -> list[dict]:
    return [
        {
            "step": step,
            "p50_us": percentile(samples[step], 50),
            "p99_us": percentile(samples[step], 99),
            "samples": len(samples[step]),
        }
        for step, _, _ in STEPS
        if samples[step]
    ]


def round_trips(a: argparse.Namespace) -> dict:
    engine = TransferEngine(a.provider, a.domain, poll_mode=a.poll, write_completion=a.write_completion)
    try:
        buf = bytearray(4096)
        region = engine.register_buffer(buf)
        ch = Channel(a.connect, a.connect_timeout, a.timeout)
        ch.send({"type": "attach", "engine": 0, "engines": 1})  # pairs with the server's engine 0
        hello = ch.recv()
        if hello.get("type") != "hello":
            raise BootstrapError(f"expected the server's hello, got {hello!r}")
        MrDescriptor.from_hex(hello["descriptor"])  # checked: a fabric-lib peer's hello
        server = EngineAddress.from_hex(hello["address"])
        ch.send(
            {
                "type": "hello",
                "address": engine.main_address.to_hex(),
                "descriptor": region.descriptor.to_hex(),
            }
        )
        total = a.warmup_iters + a.iters
        ch.send({"type": "echo", "ping": IMM_PING, "pong": IMM_PONG, "count": total})
        ch.expect_ok("arming the echo")
        counter = engine.imm_counter(IMM_PONG)
        engine.enable_latency_probe(a.breakdown)
        times: list[float] = []
        steps: dict[str, list[float]] = {step: [] for step, _, _ in STEPS}
        pings: list[Future[None]] = []
        for i in range(total):
            if a.wait == "future":
                pong = engine.expect_imm_count(IMM_PONG, 1)
                start = time.monotonic_ns()
                ping = engine.submit_imm(IMM_PING, server)
                pong.result(timeout=a.timeout)
                end = time.monotonic_ns()
            else:
                start = time.monotonic_ns()
                ping = engine.submit_imm(IMM_PING, server)
                counter.wait(1, a.timeout)
                end = time.monotonic_ns()
            if a.breakdown:
                ping.result(timeout=a.timeout)  # its stages belong to this round trip
                if i >= a.warmup_iters:
                    marks = engine.latency_marks()
                    for step, frm, to in STEPS:
                        t0 = start if frm is None else marks.get(frm, 0)
                        t1 = end if to is None else marks.get(to, 0)
                        if t0 >= start and t1 >= start:
                            steps[step].append((t1 - t0) / 1e3)
            else:
                pings.append(ping)
            if i >= a.warmup_iters:
                times.append((end - start) / 1e3)
        engine.enable_latency_probe(False)
        for ping in pings:
            ping.result(timeout=a.timeout)
        counter.close()
        ch.send({"type": "done"})
        ch.expect_ok("ending the session")
        return {
            "iters": a.iters,
            "wait": a.wait,
            "p50_us": percentile(times, 50),
            "p99_us": percentile(times, 99),
            "min_us": min(times),
            "mean_us": statistics.fmean(times),
            "max_us": max(times),
            "breakdown": breakdown_of(steps),
        }
    finally:
        engine.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--connect", required=True, help="the fabric-debug server's HOST:PORT")
    p.add_argument("--provider", default="tcp")
    p.add_argument("--domain", default=None)
    p.add_argument("--poll", choices=("busy", "adaptive"), default="busy")
    p.add_argument("--write-completion", choices=("auto", "delivery", "transmit"), default="auto")
    p.add_argument("--wait", choices=("counter", "future"), default="counter")
    p.add_argument("--iters", type=int, default=10_000)
    p.add_argument("--warmup-iters", type=int, default=1_000)
    p.add_argument("--breakdown", action="store_true", help="report p50/p99 per step (latency probe)")
    p.add_argument("--timeout", type=float, default=60, help="seconds any one wait may take")
    p.add_argument("--connect-timeout", type=float, default=30)
    a = p.parse_args(argv)
    if a.iters <= 0 or a.warmup_iters < 0:
        p.error("--iters must be positive and --warmup-iters non-negative")
    try:
        rtt = round_trips(a)
    except (BootstrapError, OSError) as e:
        print(f"python_rtt: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"rtt": rtt}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
