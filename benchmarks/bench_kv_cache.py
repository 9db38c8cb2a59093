"""KV-cache transfer against prefill compute (fabric_lib.kv_cache), on CPU over tcp or on a GPU.

    python -m benchmarks.bench_kv_cache [--device cpu|cuda] [--path same-host|network]
                                        [--layers N] [--prompts 4096,8192] [--block-sizes 16,128]
                                        [--layout hnd] [--block-order contiguous|shuffled]
                                        [--json-out PATH]

Per-rank cache shape of Qwen3-235B at TP4 as the issue states it (4 KV heads per rank, head dim
128, bf16; 2 KiB of K+V per token per layer). The prefiller (this process) and the decoder (a
spawned process) each own a tcp engine. For every block size and prompt length:

- **transfer only**: every layer released back to back; per-layer transfer time = time until
  the decoder's immediate count completes / layers; pages/s and GB/s from the same run.
- **pipelined with compute**: a real model (transformers Llama layers, random weights, fp32 on
  CPU; 8 query heads and 4 KV heads of dim 128, hidden 1024, MLP 2048) prefills the prompt;
  after each layer a forward hook pages its K/V (bf16) into the cache and releases the layer.
  Per-layer compute time is the mean time between hooks; **TTFT added** is the time from the
  end of the last layer's compute to the decoder holding every page and the context.

On CPU (default) it is scaled down for a small machine, and says so in the output: 6 of 94
layers by default (per-layer numbers are what matter; a full request is 94x the bytes), prompts
of 4K and 8K tokens by default (16K and 32K with ``--prompts``), a model layer far smaller than
Qwen3-235B's.

With ``--device cuda`` the prefiller's cache lives on GPU 0 and the decoder's (another process)
on ``--decoder-gpu`` (default 0, the same GPU), the model is bf16 with a per-rank stand-in for a Qwen3-235B TP4 layer (hidden 4096, 16
query heads and 4 KV heads of dim 128, a dense MLP of 3072 for its 8 active experts of 1536 split
four ways) and all 94 layers by default. Layers are released from the GPU: after each layer a
kernel stores to a UVM watcher (``LayerTrigger``), so a layer goes out when the GPU finished it.
Per-layer compute comes from CUDA events. ``--path same-host`` moves pages by CUDA IPC;
``--path network`` forces them through ``shm`` with FI_HMEM (the CUDA-enabled libfabric of
``scripts/build_libfabric.sh`` on ``LD_LIBRARY_PATH``), every byte through the provider as
between two hosts.

``--block-order shuffled`` draws each request's blocks at random from a pool twice the size a
request needs, independently on both sides (a fragmented block pool: pages adjacent on both sides,
which the engine merges into one write, become rare); ``contiguous`` (default) uses blocks
``0..n`` on both sides. Results go to ``bench-results/bench_kv_cache[_<device>_<path>].json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

from fabric_lib.testing import spawn_ranks

REPO = Path(__file__).resolve().parent.parent
KV_HEADS, HEAD_DIM = 4, 128


def engine_options(device: str, path: str) -> dict[str, Any]:
    """TransferEngine arguments for a run: tcp, or on a GPU with ``path == "network"`` shm with
    GPU memory registered with the provider and CUDA IPC turned off."""
    if device != "cpu" and path == "network":
        return {"provider": "shm", "gpu_network": True, "force_network": True}
    return {"provider": "tcp"}


class Decoder:
    """The decode rank's state: an engine and a KvReceiver with its caches."""

    def __init__(self, layout_dict: dict[str, Any], num_blocks: int, device: str, path: str) -> None:
        import fabric_lib
        import torch
        from fabric_lib.kv_cache import KvLayout, KvReceiver

        torch.set_num_threads(1)
        layout = KvLayout.from_dict(layout_dict)
        self.engine = fabric_lib.TransferEngine(
            poll_mode="busy", transfer_timeout=60.0, **engine_options(device, path)
        )
        caches = [
            torch.zeros(layout.layer_shape(num_blocks, 1), dtype=torch.bfloat16, device=device)
            for _ in range(layout.num_layers)
        ]
        self.receiver = KvReceiver(
            self.engine, layout, caches, instance="decode", request_timeout=300.0, context_bytes=1 << 16
        )
        self.requests: dict[str, Any] = {}

    def close(self) -> None:
        self.receiver.close()
        self.engine.stop()


def connect(d: Decoder, address: bytes) -> None:
    d.receiver.connect(address)


def ask(d: Decoder, rid: str, blocks: list[int], n: int, ctx: int) -> None:
    """Asks the prefiller for request ``rid`` (the decoder is asked first)."""
    d.requests[rid] = d.receiver.request(rid, "prefill", blocks, n, context_bytes=ctx)


def completed_at(d: Decoder, rid: str) -> float:
    """Waits for request ``rid``; the time (CLOCK_MONOTONIC, shared by the processes of one
    host) it completed."""
    d.requests.pop(rid).wait(300)
    return time.monotonic()


def _model(layers: int, device: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    gpu = device == "cuda"
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=4096 if gpu else 1024,
        intermediate_size=3072 if gpu else 2048,
        num_hidden_layers=layers,
        num_attention_heads=16 if gpu else 8,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=65536,
    )
    if not gpu:
        return LlamaForCausalLM(cfg).eval()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):  # random weights made on the GPU: seconds, not minutes
            return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def _page_kv(layout: Any, cache: Any, blocks: Any, k: Any, v: Any) -> None:
    """One layer's K/V ``[1, heads, n, dim]`` into the paged cache (vectorized)."""
    import torch

    nb, bs = len(blocks), layout.block_size
    kv = torch.stack([k[0], v[0]]).to(torch.bfloat16)  # [2, H, n, D]
    pad = nb * bs - kv.shape[2]
    if pad:
        kv = torch.nn.functional.pad(kv, (0, 0, 0, pad))
    kv = kv.reshape(2, kv.shape[1], nb, bs, kv.shape[3])  # [2, H, nb, bs, D]
    cache[blocks] = kv.permute(2, 0, 3, 1, 4) if layout.kind == "nhd" else kv.permute(2, 0, 1, 3, 4)


def _block_ids(order: str, needed: int, pool: int, rng: random.Random) -> list[int]:
    """A request's block ids: ``0..needed`` or a random sample of the pool."""
    return list(range(needed)) if order == "contiguous" else rng.sample(range(pool), needed)


def _pipelined(
    model: Any,
    sender: Any,
    layout: Any,
    caches: list[Any],
    rid: str,
    block_ids: list[int],
    n: int,
    device: str,
) -> tuple[float, list[float], list[float]]:
    """Prefills ``n`` tokens; after each layer its K/V are paged into the cache and the layer is
    released (on CPU by the hook, on a GPU by a kernel storing to a UVM watcher); the last
    hidden state goes as the context as soon as it is computed. Returns the end of the last
    layer's compute (monotonic clock) and per-layer compute and paging seconds."""
    import torch
    from fabric_lib.kv_cache import LayerTrigger
    from transformers import DynamicCache

    gpu = device == "cuda"
    blocks = torch.tensor(block_ids, device=device)
    cache = DynamicCache()
    fwd = sender.begin_forward({rid: n})
    trigger = None
    if gpu:
        import fabric_lib.cuda as fcuda

        trigger = LayerTrigger(sender, device=0)
        trigger.arm(fwd)
        word = fcuda.word_tensor(trigger.ptr)
        vals = torch.tensor(trigger.values(), dtype=torch.int64, device=device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * model.config.num_hidden_layers + 1)]
    stamps: list[float] = []
    page_s: list[float] = []

    def hook(layer: int) -> Any:
        def after(module: Any, a: Any, out: Any) -> None:
            lay: Any = cache.layers[layer]  # a full-attention layer: .keys, .values
            if gpu:
                events[2 * layer + 1].record()
                _page_kv(layout, caches[layer], blocks, lay.keys, lay.values)
                word.copy_(vals[layer])  # the GPU releases the layer once it got here
                events[2 * layer + 2].record()
                return
            t = time.monotonic()
            _page_kv(layout, caches[layer], blocks, lay.keys, lay.values)
            page_s.append(time.monotonic() - t)
            fwd.layer_ready(layer)
            stamps.append(time.monotonic())

        return after

    handles = [b.register_forward_hook(hook(i)) for i, b in enumerate(model.model.layers)]
    ids = torch.randint(0, 1000, (1, n), device=device)
    try:
        with torch.no_grad():
            if gpu:
                torch.cuda.synchronize()
                events[0].record()
            t_start = time.monotonic()
            out = model.model(ids, past_key_values=cache, use_cache=True)
            if gpu:
                events[-1].synchronize()  # the CPU is idle: returns when the last layer is done
                t_last = time.monotonic()
            else:
                t_last = stamps[-1]
            sender.send_context(rid, out.last_hidden_state[0, -1].cpu().contiguous())
            if gpu:
                ms = [events[i].elapsed_time(events[i + 1]) for i in range(len(events) - 1)]
                compute = [x / 1e3 for x in ms[0::2]]
                page_s = [x / 1e3 for x in ms[1::2]]
            else:
                compute = [stamps[0] - t_start] + [b - a for a, b in zip(stamps, stamps[1:])]
    finally:
        for h in handles:
            h.remove()
        if trigger is not None:
            deadline = time.monotonic() + 60
            while fwd.layers_done < layout.num_layers and time.monotonic() < deadline:
                time.sleep(1e-4)  # the watcher's callback releases the last layers
            fwd.wait(300)
            trigger.close()
    return t_last, compute, page_s


def run(args: argparse.Namespace) -> dict[str, Any]:
    import fabric_lib
    import torch
    from fabric_lib.kv_cache import KvLayout, KvSender

    torch.set_num_threads(1)
    model = _model(args.layers, args.device)
    results = []
    for bs in args.block_sizes:
        layout = KvLayout(args.layout, args.layers, bs, KV_HEADS, HEAD_DIM, "bfloat16")
        pool = layout.blocks_for(max(args.prompts))
        num_blocks = pool if args.block_order == "contiguous" else 2 * pool
        rng = random.Random(bs)
        ranks = spawn_ranks(
            1,
            setup=Decoder,
            setup_kwargs={
                "layout_dict": layout.to_dict(),
                "num_blocks": num_blocks,
                "device": f"cuda:{args.decoder_gpu}" if args.device == "cuda" else "cpu",
                "path": args.path,
            },
            teardown=Decoder.close,
            names=["decoder"],
            timeout=300,
        )
        (decoder,) = ranks
        engine = fabric_lib.TransferEngine(
            poll_mode="busy", transfer_timeout=60.0, **engine_options(args.device, args.path)
        )
        caches = [
            torch.zeros(layout.layer_shape(num_blocks, 1), dtype=torch.bfloat16, device=args.device)
            for _ in range(args.layers)
        ]
        sender = KvSender(
            engine, layout, caches, instance="prefill", request_timeout=300.0, context_bytes=1 << 16
        )
        try:
            decoder.call(connect, engine.main_address.to_bytes())  # the decoder joins the prefiller
            for n in args.prompts:
                nb = layout.blocks_for(n)
                page_bytes = layout.page_bytes(1)
                # 1. transfer only
                d_blocks = _block_ids(args.block_order, nb, num_blocks, rng)
                p_blocks = _block_ids(args.block_order, nb, num_blocks, rng)
                decoder.call(ask, f"t{bs}-{n}", d_blocks, n, 0)
                done = decoder.submit(completed_at, f"t{bs}-{n}")
                time.sleep(0.05)  # the REQUEST reaches the prefiller
                sender.add_request(f"t{bs}-{n}", p_blocks, n)
                t0 = time.monotonic()
                fwd = sender.begin_forward({f"t{bs}-{n}": n})
                for layer in range(args.layers):
                    fwd.layer_ready(layer)
                t_done = done.result(300)
                transfer_s = t_done - t0
                nbytes = nb * page_bytes * args.layers
                # 2. pipelined with the model's prefill
                rid = f"p{bs}-{n}"
                hidden = model.config.hidden_size
                hidden_bytes = hidden * (2 if args.device == "cuda" else 4)
                d_blocks = _block_ids(args.block_order, nb, num_blocks, rng)
                p_blocks = _block_ids(args.block_order, nb, num_blocks, rng)
                decoder.call(ask, rid, d_blocks, n, hidden_bytes)
                done = decoder.submit(completed_at, rid)
                time.sleep(0.05)
                sender.add_request(rid, p_blocks, n)
                t_last, compute, page_s = _pipelined(
                    model, sender, layout, caches, rid, p_blocks, n, args.device
                )
                t_decoded = done.result(300)
                per_layer_compute = sum(compute[1:]) / max(1, len(compute) - 1)
                row = {
                    "block_size": bs,
                    "block_order": args.block_order,
                    "prompt_tokens": n,
                    "layers": args.layers,
                    "pages_per_layer": nb,
                    "page_bytes": page_bytes,
                    "bytes": nbytes,
                    "transfer_s": transfer_s,
                    "per_layer_transfer_ms": 1e3 * transfer_s / args.layers,
                    "per_layer_compute_ms": 1e3 * per_layer_compute,
                    "per_layer_paging_ms": 1e3 * sum(page_s) / len(page_s),
                    "ttft_added_ms": 1e3 * (t_decoded - t_last),
                    "pages_per_s": nb * args.layers / transfer_s,
                    "gb_per_s": nbytes / transfer_s / 1e9,
                    "transfer_hidden": transfer_s / args.layers < per_layer_compute,
                }
                row["ttft_added_below_one_layer"] = row["ttft_added_ms"] < row["per_layer_compute_ms"]
                results.append(row)
                print(
                    f"block {bs:4d}  prompt {n:6d}  layer: transfer {row['per_layer_transfer_ms']:8.2f} ms"
                    f"  compute {row['per_layer_compute_ms']:8.2f} ms  TTFT+ {row['ttft_added_ms']:7.2f} ms"
                    f"  {row['pages_per_s']:9.0f} pages/s  {row['gb_per_s']:6.2f} GB/s",
                    flush=True,
                )
        finally:
            sender.close()
            ranks.close()
            engine.stop()
    gpu = args.device == "cuda"
    where = {
        ("cpu", "same-host"): "tcp (loopback, two processes)",
        ("cuda", "same-host"): "GPU 0 -> GPU 0, two processes, same-host CUDA IPC path",
        ("cuda", "network"): "GPU 0 -> GPU 0, two processes, forced network path (shm, FI_HMEM)",
    }
    model_desc = (
        "hidden 4096, 16 query heads, 4 KV heads x 128, MLP 3072, bf16 on the GPU"
        if gpu
        else "hidden 1024, 8 query heads, 4 KV heads x 128, MLP 2048, fp32 on CPU (1 thread)"
    )
    return {
        "benchmark": "bench_kv_cache",
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "provider": where.get((args.device, args.path), args.path).replace(
            "GPU 0 -> GPU 0", f"GPU 0 -> GPU {args.decoder_gpu}"
        ),
        "shape": f"Qwen3-235B TP4 per rank as the issue states: {KV_HEADS} KV heads, head dim {HEAD_DIM}, bf16",
        "layout": args.layout,
        "scaled_down": f"{args.layers} of 94 layers; prompts {args.prompts}; model layer: {model_desc}; "
        f"{os.cpu_count()} CPUs",
        "host": platform.node(),
        "results": results,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where caches and model live")
    p.add_argument(
        "--path",
        choices=["same-host", "network"],
        default="same-host",
        help="on a GPU: CUDA IPC, or forced through shm with FI_HMEM (CPU runs use tcp)",
    )
    p.add_argument("--layers", type=int, help="model layers (default: 6 on CPU, 94 on a GPU)")
    p.add_argument("--decoder-gpu", type=int, default=0, help="the decoder's GPU (the prefiller uses GPU 0)")
    p.add_argument(
        "--prompts", type=ints, default=[4096, 8192], help="prompt lengths in tokens, comma-separated"
    )
    p.add_argument("--block-sizes", type=ints, default=[16, 128], help="tokens per KV block, comma-separated")
    p.add_argument("--layout", choices=["nhd", "hnd"], default="hnd", help="paged-cache layout")
    p.add_argument(
        "--block-order",
        choices=["contiguous", "shuffled"],
        default="contiguous",
        help="block ids 0..n on both sides, or drawn at random from a pool twice that size",
    )
    p.add_argument("--json-out", type=Path, help="result file (default under bench-results/)")
    args = p.parse_args()
    if args.device == "cpu" and args.path == "network":
        p.error("--path network needs --device cuda (CPU runs already go through tcp)")
    if args.layers is None:
        args.layers = 94 if args.device == "cuda" else 6
    if args.json_out is None:
        tail = "" if args.device == "cpu" else f"_{args.device}_{args.path.replace('-', '_')}"
        tail += "" if args.block_order == "contiguous" else "_shuffled"
        args.json_out = REPO / "bench-results" / f"bench_kv_cache{tail}.json"
    result = run(args)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.json_out}")


if __name__ == "__main__":
    main()
