"""fabric_lib.kv_cache on a GPU: layers released by a kernel inside a CUDA graph that stores to a
UVM watcher (``LayerTrigger``), pages moved GPU -> GPU over the same-host CUDA path. Skips
without a CUDA GPU and the embedded kernels."""

from __future__ import annotations

import fabric_lib
import fabric_lib.cuda as fcuda
import pytest
import torch
from fabric_lib.errors import CudaUnavailableError
from fabric_lib.kv_cache import KvLayout, KvReceiver, KvSender, LayerTrigger


def _have_gpu() -> bool:
    try:
        return torch.cuda.is_available() and fcuda.device_count() > 0 and fcuda.kernels()[0]
    except CudaUnavailableError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _have_gpu(), reason="needs a CUDA GPU and kernels")]


@pytest.mark.timeout(120)
def test_cuda_graph_layer_trigger_streams_pages_same_host() -> None:
    layout = KvLayout("hnd", 4, 16, 8, 64, "bfloat16")
    L, n = layout.num_layers, 100
    with (
        fabric_lib.TransferEngine("tcp", poll_mode="adaptive", transfer_timeout=20.0) as e1,
        fabric_lib.TransferEngine("tcp", poll_mode="adaptive", transfer_timeout=20.0) as e2,
    ):
        pc = [torch.zeros(layout.layer_shape(32, 1), dtype=torch.bfloat16, device="cuda") for _ in range(L)]
        dc = [torch.zeros(layout.layer_shape(40, 1), dtype=torch.bfloat16, device="cuda") for _ in range(L)]
        src = [torch.randn(layout.layer_shape(32, 1), device="cuda").to(torch.bfloat16) for _ in range(L)]
        sender = KvSender(e1, layout, pc, instance="p")
        recv = KvReceiver(e2, layout, dc, instance="d")
        trigger = LayerTrigger(sender, device=0)
        try:
            recv.connect(e1.main_address)
            word = fcuda.word_tensor(trigger.ptr)
            vals = torch.zeros(L, dtype=torch.int64, device="cuda")
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), torch.cuda.graph(graph):
                for layer in range(L):  # the "layer's compute" writes its KV, then bumps the word
                    pc[layer].copy_(src[layer])
                    word.copy_(vals[layer])
            nb = layout.blocks_for(n)
            for rnd, rid in enumerate(["a", "b"]):
                d_blocks = list(range(rnd * nb, (rnd + 1) * nb))[::-1]
                p_blocks = list(range(3, 3 + nb))
                req = recv.request(rid, "p", d_blocks, n)
                done = sender.add_request(rid, p_blocks, n)
                fwd = sender.begin_forward({rid: n})
                trigger.arm(fwd)
                vals.copy_(torch.tensor(trigger.values(), dtype=torch.int64))
                graph.replay()
                req.wait(30)
                done.result(30)
                for layer in range(L):
                    assert torch.equal(dc[layer][d_blocks], src[layer][p_blocks]), (rid, layer)
        finally:
            trigger.close()
            sender.close()
            recv.close()
