"""End to end on a GPU with a real model: a transformers Llama (random weights, bf16, a larger
config than the CPU test) prefills a prompt inside a CUDA graph. After each decoder layer the
graph pages the layer's K/V into the prefiller's cache and stores the layer's trigger value to a
UVM watcher (``LayerTrigger``), which releases the layer's paged writes. A layerwise decoder
waits for each layer (``wait_for_layer``; the engine also sets one GPU flag per layer), rebuilds
its cache from the received pages and decodes: its logits for every step equal, bit for bit,
those of the model decoding from the prefiller's own cache.

Two paths: the same-host CUDA path, and the forced network path (``shm`` with FI_HMEM from
``scripts/build_libfabric.sh``: every byte goes through the provider as between two hosts).
Skips without a CUDA GPU, the embedded kernels, or (network path) a CUDA-enabled ``shm``.
"""

from __future__ import annotations

import random
from typing import Any

import fabric_lib
import fabric_lib.cuda as fcuda
import pytest
import torch
from fabric_lib.kv_cache import KvLayout, KvReceiver, KvSender, LayerTrigger

from .nodes import _greedy_steps, _raw, kv_from_pages, layer_kv, pages_from_kv
from .test_kv_cache_gpu import _have_gpu

pytest.importorskip("transformers")

CONFIG: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=4096,
)
PROMPT, BLOCK, STEPS, TIMEOUT = 1000, 16, 6, 60.0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _have_gpu(), reason="needs a CUDA GPU and kernels")]


def _engines(path: str) -> tuple[Any, Any]:
    if path == "same-host":
        opts: dict[str, Any] = {"provider": "tcp"}
    else:
        opts = {"provider": "shm", "gpu_network": True, "force_network": True}
    engines = [
        fabric_lib.TransferEngine(poll_mode="adaptive", transfer_timeout=TIMEOUT, **opts) for _ in range(2)
    ]
    if path == "network" and not engines[0].gpu_network:
        for e in engines:
            e.stop()
        pytest.skip("this libfabric's shm has no FI_HMEM for CUDA (scripts/build_libfabric.sh)")
    return engines[0], engines[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", ["same-host", "network"])
def test_graph_prefill_streams_layers_and_decode_matches(path: str) -> None:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    L = CONFIG["num_hidden_layers"]
    layout = KvLayout("hnd", L, BLOCK, CONFIG["num_key_value_heads"], CONFIG["head_dim"], "bfloat16")
    nb = layout.blocks_for(PROMPT)
    rng = random.Random(1)
    p_blocks, d_blocks = rng.sample(range(nb + 20), nb), rng.sample(range(nb + 40), nb)
    pc = [torch.zeros(layout.layer_shape(nb + 20, 1), dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    dc = [torch.zeros(layout.layer_shape(nb + 40, 1), dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    ids = torch.tensor([[rng.randrange(CONFIG["vocab_size"]) for _ in range(PROMPT)]], device="cuda")
    ctx_bytes = CONFIG["vocab_size"] * 2
    e1, e2 = _engines(path)
    sender = KvSender(e1, layout, pc, instance="p", context_bytes=ctx_bytes)
    recv = KvReceiver(e2, layout, dc, instance="d", context_bytes=ctx_bytes, layerwise=True)
    trigger = LayerTrigger(sender, device=0)
    flags = [e2.alloc_gpu_flag(0) for _ in range(L)]
    try:
        recv.connect(e1.main_address)
        word = fcuda.word_tensor(trigger.ptr)
        vals = torch.zeros(L, dtype=torch.int64, device="cuda")
        blocks_dev = torch.tensor(p_blocks, device="cuda")
        state: dict[str, Any] = {}

        def hook(layer: int) -> Any:
            def after(module: Any, args: Any, output: Any) -> None:
                keys, values = layer_kv(state["cache"], layer)
                pages_from_kv(layout, pc[layer], blocks_dev, keys, values, 0, PROMPT)
                word.copy_(vals[layer])  # the layer's KV is in its pages: release it

            return after

        def prefill() -> Any:
            state["cache"] = DynamicCache()
            return model(ids, past_key_values=state["cache"], use_cache=True).logits[0, -1]

        handles = [blk.register_forward_hook(hook(i)) for i, blk in enumerate(model.model.layers)]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(stream):
            prefill()  # warm-up outside the capture (library handles, kernels)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                logits = prefill()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for h in handles:
            h.remove()

        req = recv.request("m", "p", d_blocks, PROMPT, context_bytes=ctx_bytes, layer_flags=flags)
        done = sender.add_request("m", p_blocks, PROMPT)
        fwd = sender.begin_forward({"m": PROMPT})
        trigger.arm(fwd)
        vals.copy_(torch.tensor(trigger.values(), dtype=torch.int64))
        torch.cuda.synchronize()
        graph.replay()
        for layer in range(L):  # layer by layer, as a decoder starting early would
            req.wait_for_layer(layer, TIMEOUT)
            assert flags[layer].get() == 1, f"layer {layer}'s GPU flag was not set"
        torch.cuda.synchronize()
        sender.send_context("m", logits.to(torch.bfloat16).cpu().contiguous())
        first_bytes = req.wait(TIMEOUT)
        done.result(TIMEOUT)
        torch.cuda.synchronize()  # shm's device copies run on the default stream (docs/gpu.md)
        for layer in range(L):
            assert torch.equal(dc[layer][d_blocks], pc[layer][p_blocks]), f"layer {layer} pages differ"

        first = torch.frombuffer(bytearray(first_bytes), dtype=torch.bfloat16).to("cuda")
        assert torch.equal(first, logits), "the context (last prompt logits) differs"
        cache = DynamicCache()
        for layer in range(L):
            k, v = kv_from_pages(layout, dc[layer], d_blocks, PROMPT)
            cache.update(k, v, layer)
        got = _greedy_steps(model, cache, first, STEPS)
        ref = _greedy_steps(model, state["cache"], logits.clone(), STEPS)
        for i, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert _raw(a.cpu()) == _raw(b.cpu()), f"decode step {i}: logits differ from the local decode"
    finally:
        trigger.close()
        sender.close()
        recv.close()
        e1.stop()
        e2.stop()
