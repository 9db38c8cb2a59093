"""fabric_lib.weights on GPU memory: 2 trainer and 2 inference processes on the GPUs present (one
GPU is enough: processes share it), a larger Llama config, BF16 and block FP8, three updates each,
then a killed inference rank and a killed trainer; over the same-host CUDA path and over the
provider (``force_network``: ``shm`` with FI_HMEM from a CUDA-enabled libfabric,
``scripts/build_libfabric.sh``; skipped with a reason without it). Skips without CUDA."""

from __future__ import annotations

import fabric_lib
import pytest
import torch
from fabric_lib.errors import CudaUnavailableError
from weights import cluster as c


def _have_gpu() -> bool:
    try:
        import fabric_lib.cuda as fcuda

        return torch.cuda.is_available() and fcuda.device_count() > 0
    except CudaUnavailableError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _have_gpu(), reason="needs a CUDA GPU")]

#: Larger than the CPU test's: 4 layers of hidden 2048 (TP2 shards stay whole 128-blocks), 309 M
#: parameters, 0.6 GB in BF16.
CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
}
#: name -> FP8; "fp8-offload" keeps the trainers' shards in host memory (the host->device stage)
VARIANTS = {"bf16": False, "fp8": True, "fp8-offload": True}
PATHS = {
    "same-host": {"provider": "tcp", "force_network": False},
    "network": {"provider": "shm", "force_network": True},
}


def _network_path_available() -> bool:
    with fabric_lib.TransferEngine("shm", poll_mode="adaptive", gpu_network=True) as e:
        return e.gpu_network


@pytest.fixture(scope="module", params=list(PATHS))
def cluster(request):
    path = PATHS[request.param]
    if path["force_network"] and not _network_path_available():
        pytest.skip("shm has no FI_HMEM here: point LD_LIBRARY_PATH at a CUDA-enabled libfabric")
    # gloo (gathers staged through host memory): NCCL needs a GPU per trainer, and its watchdog
    # ends the surviving process instead of raising when a trainer dies.
    cl = c.Cluster(
        VARIANTS, config=CONFIG, device="cuda", backend="gloo", max_write_bytes=8 << 20,
        group_bytes=128 << 20, staging_bytes=64 << 20, offloaded=("fp8-offload",), **path,
    )  # fmt: skip
    yield cl
    cl.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_three_updates_on_gpu_memory_are_exact(cluster, variant) -> None:
    for version in (1, 2, 3):
        trainers, inference = cluster.update(variant, version, wait=120)
        assert all("stats" in r for r in trainers), trainers
        offloaded = variant == "fp8-offload"
        assert all((r["stats"]["seconds"]["h2d"] > 0) == offloaded for r in trainers), trainers
        assert inference == [{"version": version, "intact": True}] * cluster.tp
        for rank in range(cluster.tp):
            assert cluster.check(variant, rank, version) == [], f"inference rank {rank}, version {version}"


@pytest.mark.timeout(600)
def test_killed_ranks_on_gpu_fail_with_typed_errors(cluster, request) -> None:
    if cluster.net["provider"] == "shm":
        # A shm endpoint reads its answers from one in-order queue for all peers, so once the
        # killed rank's write timed out, the live rank's writes queued behind it may too
        # (docs/gpu.md): whether rank 0 is reported lost as well depends on the order of writes.
        request.applymarker(pytest.mark.xfail(reason="shm couples peers after one died", strict=False))
    cluster.inference[1].kill()
    trainers, inference = cluster.update("fp8", 4, wait=60)
    assert {(r["error"], r["role"], tuple(r["ranks"])) for r in trainers} == {
        ("WeightsPeerLostError", "inference", (1,))
    }, trainers
    assert inference == [{"version": 4, "intact": True}]
    assert cluster.check("fp8", 0, 4) == []
    trainers, inference = cluster.update("fp8", 5, die_after_group={1: 0}, wait=20)
    alive = [r for r in trainers if "died" not in r]
    assert len(alive) == 1 and (alive[0]["error"], alive[0]["role"]) == ("WeightsPeerLostError", "trainer"), (
        trainers
    )
    (seen,) = inference
    assert seen["error"] == "UpdateIncompleteError" and seen["partial"] and not seen["intact"], seen
