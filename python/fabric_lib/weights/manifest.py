"""What an inference rank publishes once: its engine address and, per registered parameter, the
local shape, dtype and memory descriptor. Plain JSON bytes; the controller hands them to the
trainers however it likes (a store, an RPC, a file)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..engine import EngineAddress, MrDescriptor
from .errors import ScheduleError

SCHEMA = "fabric-lib-weights-manifest/1"


@dataclass(frozen=True)
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    descriptor: MrDescriptor


@dataclass(frozen=True)
class Manifest:
    rank: int
    address: EngineAddress
    tensors: dict[str, TensorEntry]

    def to_bytes(self) -> bytes:
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "rank": self.rank,
            "address": self.address.to_hex(),
            "tensors": {
                n: {"shape": list(e.shape), "dtype": e.dtype, "descriptor": e.descriptor.to_hex()}
                for n, e in sorted(self.tensors.items())
            },
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | str) -> Manifest:
        try:
            doc = json.loads(data)
            if doc.get("schema") != SCHEMA:
                raise ScheduleError(f"not a weight-receiver manifest ({SCHEMA})")
            return cls(
                int(doc["rank"]),
                EngineAddress.from_hex(doc["address"]),
                {
                    n: TensorEntry(
                        tuple(int(x) for x in e["shape"]),
                        str(e["dtype"]),
                        MrDescriptor.from_hex(e["descriptor"]),
                    )
                    for n, e in doc["tensors"].items()
                },
            )
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ScheduleError):
                raise
            raise ScheduleError(f"malformed manifest: {e!r}") from None

    def check_against(self, expected: dict[str, tuple[tuple[int, ...], str]]) -> None:
        """Raises ``ScheduleError`` unless this rank registered exactly what the schedule writes."""
        missing = sorted(set(expected) - set(self.tensors))
        if missing:
            raise ScheduleError(f"inference rank {self.rank} registered no tensor {missing[:5]}")
        for name, (shape, dtype) in expected.items():
            e = self.tensors[name]
            if e.shape != tuple(shape) or e.dtype != dtype:
                raise ScheduleError(
                    f"inference rank {self.rank}: {name} is {e.dtype}{list(e.shape)}, the schedule writes {dtype}{list(shape)}"
                )
