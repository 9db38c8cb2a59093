"""Local tensors under a schedule's placements: what a trainer rank holds of whole tensors, and
zeroed inference-side tensors of the shapes and dtypes the schedule writes. For tests,
benchmarks, and frameworks that do not own such tensors already."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .schedule import Schedule
from .transforms import slice_box, torch_dtype


def trainer_shards(schedule: Schedule, rank: int, full: Mapping[str, Any]) -> dict[str, Any]:
    """The local tensors trainer ``rank`` holds under the schedule's placements, cut from whole
    tensors ``full`` (name -> global tensor): tests, benchmarks, and frameworks that keep full
    copies. FSDP shards are returned unpadded."""
    out = {}
    for s in schedule.sources.values():
        for piece in s.placement.pieces(s.shape, s.name):
            if piece.rank != rank:
                continue
            t = slice_box(full[s.name], tuple((0, n) for n in s.shape), piece.box)
            if piece.flat is not None:
                t = t.reshape(-1)[piece.flat[0] : piece.flat[1]]
            elif piece.rows is not None:
                t = t[piece.rows[0] : piece.rows[1]]
            out[s.name] = t.contiguous()
    return out


def inference_params(schedule: Schedule, rank: int, device: Any = "cpu") -> dict[str, Any]:
    """Zeroed tensors of every shape and dtype the schedule writes on inference ``rank`` (what a
    receiver registers when the inference engine does not own them already)."""
    import torch

    return {
        name: torch.zeros(shape, dtype=torch_dtype(dtype), device=device)
        for name, (shape, dtype) in schedule.tensors_of(rank).items()
    }
