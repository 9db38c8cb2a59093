"""Errors of the weight-transfer module (all ``fabric_lib.errors.FabricError`` subclasses)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import FabricError, FabricTimeoutError, InvalidArgumentError, TransferError


class WeightsError(FabricError):
    """Base class of the errors this module adds to the engine's."""


class ScheduleError(WeightsError, InvalidArgumentError):
    """Parameter descriptions that cannot be scheduled (shapes that do not split evenly, FP8
    blocks that would straddle two sources), or a manifest, schedule or tensor that does not match
    the schedule; nothing was sent."""


class WeightsPeerLostError(WeightsError, TransferError):
    """An inference rank refused or did not complete writes, or a trainer rank failed a gather or
    did not reach a barrier within its timeout: the update failed. ``ranks`` names the ranks
    (inference ranks for a write failure, trainer ranks where known for a trainer failure)."""

    def __init__(self, message: str, *, role: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.role = role
        self.ranks = tuple(ranks)


class UpdateIncompleteError(WeightsError, FabricTimeoutError):
    """The inference side did not receive every write of ``version`` within the timeout.

    ``received`` of ``expected`` writes arrived. Whenever this is raised the registered weights
    may be partially overwritten (a write can land before its immediate is counted): the receiver
    marks itself not intact until a later version completes."""

    def __init__(self, message: str, *, version: int, received: int, expected: int) -> None:
        super().__init__(message)
        self.version = version
        self.received = received
        self.expected = expected

    @property
    def partial(self) -> bool:
        """Whether some, but not all, of the version's writes were counted."""
        return 0 < self.received < self.expected
