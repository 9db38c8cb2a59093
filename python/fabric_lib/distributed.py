"""Bootstrap over torch.distributed: exchange engine addresses and descriptors in one call."""

from __future__ import annotations

import random
import socket
from dataclasses import dataclass, field
from typing import Any, Sequence

from .engine import EngineAddress, MrDescriptor, TransferEngine
from .errors import InvalidArgumentError

__all__ = ["PeerInfo", "exchange", "rendezvous_port"]


@dataclass(frozen=True)
class PeerInfo:
    """What one rank published: its engine address and its descriptors (in the order given)."""

    rank: int
    address: EngineAddress
    descriptors: list[MrDescriptor] = field(default_factory=list)


def exchange(
    engine: TransferEngine,
    descriptors: Sequence[MrDescriptor] = (),
    group: Any = None,
) -> list[PeerInfo]:
    """All-gathers every rank's engine address and descriptors over ``group`` (default: world).

    Works with any torch.distributed backend that supports ``all_gather_object`` (gloo on CPU).
    Returns one ``PeerInfo`` per rank of the group, indexed by group rank.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise InvalidArgumentError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group first"
        )
    mine = (engine.main_address.to_bytes(), [d.to_bytes() for d in descriptors])
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    return [
        PeerInfo(
            rank=rank,
            address=EngineAddress.from_bytes(address),
            descriptors=[MrDescriptor.from_bytes(d) for d in descs],
        )
        for rank, (address, descs) in enumerate(gathered)
    ]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def rendezvous_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host`` for a ``tcp://`` rendezvous, taken below the ephemeral range.

    A port found by binding to port 0 comes from the ephemeral range, so the kernel may give it
    to another socket's outgoing connection before the store listens on it (a rank connecting
    early), and the store then fails with EADDRINUSE: seen once in a few dozen benchmark runs.
    Falls back to such a port when no lower one can be bound.
    """
    low = _ephemeral_low()
    rng = random.SystemRandom()
    if low > 2048:
        for _ in range(100):
            port = rng.randrange(max(1024, low - 20000), low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
