"""Test and benchmark support for fabric_lib (as ``numpy.testing`` is for numpy): the one rank
launcher (``spawn_ranks``, ``host_ranks``), the one process-group set-up (``init_process_group``)
and the network-namespace test bed (``netns.TestBed``; root and iproute2 only).

Importing this module loads neither torch nor the compiled extension.
"""

from __future__ import annotations

from .process_group import init_process_group
from .ranks import (
    DEFAULT_TIMEOUT,
    Pending,
    Rank,
    RankError,
    RankInfo,
    Ranks,
    gather,
    host_ranks,
    spawn_ranks,
    this_rank,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "Pending",
    "Rank",
    "RankError",
    "RankInfo",
    "Ranks",
    "gather",
    "host_ranks",
    "init_process_group",
    "spawn_ranks",
    "this_rank",
]
