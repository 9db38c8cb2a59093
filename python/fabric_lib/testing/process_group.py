"""The one torch.distributed process-group set-up of the tests and benchmarks."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from .ranks import RankInfo, this_rank

__all__ = ["init_process_group"]

# NVLink multicast (NVLS) stays off: it needs fabric-manager support that single-host machines
# often lack, and NCCL, torch's symmetric memory and NVSHMEM would each try to set it up.
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def init_process_group(backend: str = "gloo", *, timeout: float = 60.0, info: RankInfo | None = None) -> None:
    """Joins the process group of this rank's world (``this_rank()`` unless ``info`` is given).

    ``"gloo"`` for CPU ranks; ``"nccl"`` also binds the rank to GPU ``local_rank`` (the current
    device and the group's ``device_id``) and keeps NVLink multicast off. ``timeout`` bounds the
    rendezvous and every collective.
    """
    import torch
    import torch.distributed as dist

    me = this_rank() if info is None else info
    extra: dict[str, Any] = {}
    if backend == "nccl":
        for key, value in _NCCL_ENV.items():
            os.environ.setdefault(key, value)
        torch.cuda.set_device(me.local_rank)
        extra["device_id"] = torch.device("cuda", me.local_rank)
    dist.init_process_group(
        backend,
        init_method=me.init_method,
        rank=me.rank,
        world_size=me.world_size,
        timeout=timedelta(seconds=timeout),
        **extra,
    )
