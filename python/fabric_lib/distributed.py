"""Bootstrap over torch.distributed: exchange engine addresses and descriptors in one call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from .engine import EngineAddress, MrDescriptor, TransferEngine

__all__ = ["PeerInfo", "exchange"]


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
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")
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
