"""RL weight transfer: trainer ranks write new weights straight into inference ranks' registered
parameter memory on a static schedule, on the TransferEngine's public API (docs/weights.md).

A controller describes the parameters on both sides (``SourceParam`` / ``TargetParam`` with
placements: replicated, TP/EP shards, FSDP shards; fused projections; FP8 with block scales) and
computes a ``Schedule`` once. Each inference rank registers its parameters in a
``WeightReceiver`` and publishes its manifest; each trainer rank builds a ``WeightSender`` from
the schedule and the manifests and calls ``update(version)`` after every training step. The
inference side calls ``wait_for_update(version, timeout)``: complete means every scheduled write
of that version was counted.
"""

from __future__ import annotations

from .errors import ScheduleError, UpdateIncompleteError, WeightsError, WeightsPeerLostError
from .layout import (
    DTYPE_SIZES,
    FP8,
    Piece,
    Placement,
    SourceParam,
    TargetParam,
    expert_sharded,
    flat_sharded,
    fsdp_sharded,
    grouped,
    replicated,
    scale_shape,
    sharded,
    source,
    target,
)
from .manifest import Manifest
from .receiver import DEFAULT_IMM_BASE, WeightReceiver
from .recipes import dense_transformer
from .schedule import Schedule, Unit, Write, build_schedule, check_exclusive_cover
from .sender import STAGES, UpdateStats, WeightSender
from .shards import inference_params, trainer_shards
from .transforms import quantize_fp8_blocks

__all__ = [
    "DEFAULT_IMM_BASE",
    "DTYPE_SIZES",
    "FP8",
    "STAGES",
    "Manifest",
    "Piece",
    "Placement",
    "Schedule",
    "ScheduleError",
    "SourceParam",
    "TargetParam",
    "Unit",
    "UpdateIncompleteError",
    "UpdateStats",
    "WeightReceiver",
    "WeightSender",
    "WeightsError",
    "WeightsPeerLostError",
    "Write",
    "build_schedule",
    "check_exclusive_cover",
    "dense_transformer",
    "expert_sharded",
    "flat_sharded",
    "fsdp_sharded",
    "grouped",
    "inference_params",
    "quantize_fp8_blocks",
    "replicated",
    "scale_shape",
    "sharded",
    "source",
    "target",
    "trainer_shards",
]
