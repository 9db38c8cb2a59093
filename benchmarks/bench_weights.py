"""RL weight update (fabric_lib.weights) against the wire floor measured in the same run, per-stage
times, submit cost per request, and the Kimi-K2 scale model fed with what was measured.

    python -m benchmarks.bench_weights [--trainers 2] [--inference 2] [--device cpu|cuda]
                                       [--provider tcp] [--force-network] [--rounds 3] [--json-out PATH]

A Llama-shaped model (transformers config, random BF16 weights; 4 layers of hidden 1024 by
default) is FSDP-sharded over the trainer processes (FSDP1 flat shards for attention, FSDP2 rows
for the MLP, vocabulary shards for the embeddings) and TP-split over the inference processes
(fused qkv and gate_up), as BF16 and as block FP8. Rounds alternate between:

- **floor**: each trainer writes, with the raw engine, exactly the bytes the schedule makes it
  send to each inference rank (one registered source, writes of the schedule's largest size,
  one immediate each), into registered memory; the time until every inference rank counted
  every write. Also the local device copy of the same bytes (``copy``).
- **update bf16 / fp8**: ``WeightSender.update`` on every trainer, ``wait_for_update`` on every
  inference rank; the time from the first trainer's start to the last inference rank's return.

Reported: medians over rounds; GB/s of the bytes the inference side receives; the ratio of the
floor's time to the update's; per-stage seconds (the slowest trainer's, median over rounds; with
``--profile`` the stages synchronize the device); submit µs per request. The stage rates then
feed ``benchmarks.weights_scale_model`` (submit cost always; gather and quantize rates when run
on a GPU). Results go to ``bench-results/bench_weights.json`` (+ a PNG of the stages).
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib
from pathlib import Path
from typing import Any

from fabric_lib.testing import gather, spawn_ranks

from benchmarks import weights_scale_model as scale
from benchmarks.report import write_result

REPO = Path(__file__).resolve().parent.parent


def model_config(a: argparse.Namespace) -> dict[str, Any]:
    return {
        "vocab_size": a.vocab,
        "hidden_size": a.hidden,
        "intermediate_size": a.intermediate,
        "num_hidden_layers": a.layers,
        "num_attention_heads": a.hidden // 64,
        "num_key_value_heads": a.hidden // 128,
        "head_dim": 64,
    }


def schedules(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from fabric_lib.weights import build_schedule, dense_transformer, flat_sharded, fsdp_sharded, sharded
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**model_config(a)))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ranks = list(range(a.trainers))

    def place(name: str, shape: tuple[int, ...]) -> Any:
        if "embed_tokens" in name or "lm_head" in name:
            return sharded(0, ranks)
        return fsdp_sharded(ranks) if ".mlp." in name else flat_sharded(ranks)

    out = {}
    for variant in a.variants:
        sources, targets = dense_transformer(
            shapes, trainer_placement=place, inference_groups=[list(range(a.inference))], fp8=variant == "fp8"
        )
        out[variant] = build_schedule(
            sources, targets, num_trainers=a.trainers, num_inference=a.inference,
            max_write_bytes=a.max_write_bytes, group_bytes=a.group_bytes,
        )  # fmt: skip
    return out


def _engine(provider: str, force_network: bool, poll: str) -> Any:
    import fabric_lib

    opts: dict[str, Any] = {"poll_mode": poll, "transfer_timeout": 60.0}
    if force_network:
        opts.update(gpu_network=True, force_network=True)
    return fabric_lib.TransferEngine(provider, **opts)


def _device(kind: str) -> Any:
    import torch
    from fabric_lib.testing import this_rank

    if kind == "cuda":
        index = this_rank().local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


# -- trainer processes ----------------------------------------------------------------------------
class Trainer:
    def __init__(self, device: str, provider: str, force_network: bool, poll: str) -> None:
        import torch
        import torch.distributed as dist
        from fabric_lib.testing import init_process_group

        torch.set_num_threads(1)
        self.device = _device(device)
        init_process_group("gloo", timeout=120)
        self.rank = dist.get_rank()
        self.engine = _engine(provider, force_network, poll)
        self.senders: dict[str, Any] = {}
        self.floor: dict[str, Any] = {}

    def close(self) -> None:
        self.engine.stop()


def open_trainer(**kw: Any) -> Trainer:
    return Trainer(**kw)


def close_trainer(t: Trainer) -> None:
    t.close()


def make_sender(
    t: Trainer, variant: str, index: int, text: str, manifests: list[bytes], staging: int, profile: bool
) -> None:
    import torch
    from fabric_lib.weights import DEFAULT_IMM_BASE, Schedule, WeightSender
    from fabric_lib.weights.sender import DEFAULT_BARRIER_IMM_BASE

    sched = Schedule.from_json(text)
    params = {}
    for s in sched.sources.values():
        piece = s.placement.piece_of(s.shape, t.rank, s.name)
        if piece is not None:
            gen = torch.Generator().manual_seed(zlib.crc32(f"{s.name}@{t.rank}".encode()))
            params[s.name] = (
                torch.randn(s.placement.local_shape(piece), generator=gen).to(torch.bfloat16).to(t.device)
            )
    t.senders[variant] = WeightSender(
        t.engine, sched, t.rank, params, manifests, device=t.device, staging_bytes=staging,
        imm_base=DEFAULT_IMM_BASE + (index << 16), barrier_imm_base=DEFAULT_BARRIER_IMM_BASE + (index << 20),
        barrier_timeout=120.0, gather_timeout=120.0, profile=profile,
    )  # fmt: skip


def make_floor(t: Trainer, text: str, landing: list[bytes], write_bytes: int) -> int:
    """The raw-engine floor: this trainer's bytes per inference rank, from the schedule."""
    import torch
    from fabric_lib.engine import MrDescriptor
    from fabric_lib.weights import Schedule

    sched = Schedule.from_json(text)
    per_rank = [0] * sched.num_inference
    for w in sched.writes_by(t.rank):
        per_rank[w.rank] += sched.write_bytes(w)
    src = torch.ones(max(per_rank + [1]), dtype=torch.uint8, device=t.device)
    t.floor = {
        "src": src,
        "region": t.engine.register_tensor(src),
        "per_rank": per_rank,
        "dst": [MrDescriptor.from_bytes(d) for d in landing],
        "write_bytes": write_bytes,
        "copy_dst": torch.empty_like(src),
    }
    return sum(per_rank)


def run_floor(t: Trainer, offsets: list[int], imm: int) -> dict[str, float]:
    """Writes this trainer's share into each inference rank's landing buffer at ``offsets[r]``;
    each write carries ``imm`` (the inference rank counts them)."""
    f = t.floor
    start = time.monotonic()
    futures = []
    for r, total in enumerate(f["per_rank"]):
        for off in range(0, total, f["write_bytes"]):
            n = min(f["write_bytes"], total - off)
            futures.append(
                t.engine.submit_write(
                    f["region"], f["dst"][r], n, src_offset=0, dst_offset=offsets[r] + off, imm=imm
                )
            )
    for fut in futures:
        fut.result(timeout=120)
    end = time.monotonic()
    # the local copy floor of the same bytes
    total = sum(f["per_rank"])
    src, dst = f["src"], f["copy_dst"]
    c0 = time.perf_counter()
    left = total
    while left > 0:
        n = min(left, src.numel())
        dst[:n].copy_(src[:n])
        left -= n
    if t.device.type == "cuda":
        import torch

        torch.cuda.synchronize(t.device)
    return {"start": start, "end": end, "writes": len(futures), "copy_s": time.perf_counter() - c0}


def run_update(t: Trainer, variant: str, version: int) -> dict[str, Any]:
    start = time.monotonic()
    stats = t.senders[variant].update(version, timeout=300.0)
    return {"start": start, "end": time.monotonic(), **stats.__dict__}


# -- inference processes ------------------------------------------------------------------------
class Inference:
    def __init__(self, device: str, provider: str, force_network: bool, poll: str) -> None:
        import torch
        from fabric_lib.testing import this_rank

        torch.set_num_threads(1)
        self.device = _device(device)
        self.rank = this_rank().rank
        self.engine = _engine(provider, force_network, poll)
        self.receivers: dict[str, Any] = {}
        self.landing: Any = None

    def close(self) -> None:
        self.engine.stop()


def open_inference(**kw: Any) -> Inference:
    return Inference(**kw)


def close_inference(i: Inference) -> None:
    i.close()


def make_receiver(i: Inference, variant: str, index: int, text: str) -> bytes:
    from fabric_lib.weights import DEFAULT_IMM_BASE, Schedule, WeightReceiver, inference_params

    sched = Schedule.from_json(text)
    r = WeightReceiver(
        i.engine, inference_params(sched, i.rank, i.device), i.rank, imm_base=DEFAULT_IMM_BASE + (index << 16)
    )
    r.set_schedule(sched)
    i.receivers[variant] = r
    return r.manifest()


def make_landing(i: Inference, nbytes: int) -> bytes:
    import torch

    i.landing = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=i.device)
    return i.engine.register_tensor(i.landing).descriptor.to_bytes()


def wait_floor(i: Inference, imm: int, count: int) -> float:
    with i.engine.imm_counter(imm) as c:
        c.wait(count, 120)
    if i.device.type == "cuda":
        import torch

        torch.cuda.synchronize(i.device)
    return time.monotonic()


def wait_update(i: Inference, variant: str, version: int) -> float:
    i.receivers[variant].wait_for_update(version, 300)
    return time.monotonic()


# -- the run ------------------------------------------------------------------------------------
def backend(a: argparse.Namespace) -> str:
    """NCCL for GPU trainers when each has a GPU of its own (NCCL allows one rank per GPU);
    otherwise gloo, whose gathers of GPU tensors go through host memory."""
    if a.device != "cuda":
        return "gloo"
    import torch

    return "nccl" if torch.cuda.device_count() >= a.trainers else "gloo"


def run(a: argparse.Namespace) -> dict[str, Any]:
    scheds = schedules(a)
    poll = a.poll or ("busy" if a.device == "cuda" else "adaptive")
    kw = {"device": a.device, "provider": a.provider, "force_network": a.force_network, "poll": poll}
    inference = spawn_ranks(
        a.inference, setup=open_inference, setup_kwargs=kw, teardown=close_inference, timeout=180
    )
    trainers = None
    try:
        trainers = spawn_ranks(
            a.trainers, setup=open_trainer, setup_kwargs=kw, teardown=close_trainer, timeout=180
        )
        for index, (variant, sched) in enumerate(scheds.items()):
            text = sched.to_json()
            manifests = inference.call_all(make_receiver, variant, index, text)
            gather(
                trainers.submit_all(make_sender, variant, index, text, manifests, a.staging_bytes, a.profile),
                300,
            )
        # the floor moves the bf16 schedule's bytes (the larger variant) per (trainer, inference rank)
        floor_sched = scheds[a.variants[0]]
        text = floor_sched.to_json()
        per_pair = [[0] * a.inference for _ in range(a.trainers)]
        for w in floor_sched.writes:
            per_pair[w.writer][w.rank] += floor_sched.write_bytes(w)
        landing = [inference[r].call(make_landing, sum(p[r] for p in per_pair)) for r in range(a.inference)]
        for t in trainers:
            t.call(make_floor, text, landing, a.max_write_bytes)
        offsets = [
            [sum(per_pair[s][r] for s in range(w)) for r in range(a.inference)] for w in range(a.trainers)
        ]
        counts = [
            sum(-(-per_pair[w][r] // a.max_write_bytes) for w in range(a.trainers))
            for r in range(a.inference)
        ]
        rounds: dict[str, list[dict[str, Any]]] = {"floor": [], **{v: [] for v in a.variants}}
        order = ["floor", *a.variants]
        version = 0
        for rnd in range(a.rounds + 1):  # round 0 warms up
            for kind in order[rnd % len(order) :] + order[: rnd % len(order)]:
                version += 1
                if kind == "floor":
                    imm = 0x46000000 + version
                    waits = [inference[r].submit(wait_floor, imm, counts[r]) for r in range(a.inference)]
                    sent = [t.submit(run_floor, offsets[t.rank], imm) for t in trainers]
                    tr = gather(sent, 300)
                    done = gather(waits, 300)
                    row = {"s": max(done) - min(x["start"] for x in tr), "copy_s": max(x["copy_s"] for x in tr),
                           "writes": sum(x["writes"] for x in tr)}  # fmt: skip
                else:
                    waits = [i.submit(wait_update, kind, version) for i in inference]
                    tr = gather([t.submit(run_update, kind, version) for t in trainers], 600)
                    done = gather(waits, 600)
                    slowest = max(tr, key=lambda x: x["total_s"])
                    row = {
                        "s": max(done) - min(x["start"] for x in tr),
                        "stages": slowest["seconds"],
                        "submit_s": sum(x["seconds"]["submit"] for x in tr),
                        "requests": sum(x["requests"] for x in tr),
                        "gather_s": max(x["seconds"]["gather"] for x in tr),
                        "quantize_s": max(x["seconds"]["quantize"] for x in tr),
                        "staging_peak": max(x["staging_peak"] for x in tr),
                    }
                if rnd > 0:
                    rounds[kind].append(row)
        return summarize(a, scheds, rounds, per_pair)
    finally:
        if trainers is not None:
            trainers.close()
        inference.close()


def summarize(
    a: argparse.Namespace, scheds: dict[str, Any], rounds: dict[str, Any], per_pair: list[list[int]]
) -> dict[str, Any]:
    from benchmarks.weights_scale_model import per_rank_work

    med = statistics.median
    floor_bytes = sum(map(sum, per_pair))
    floor_s = med(r["s"] for r in rounds["floor"])
    out: dict[str, Any] = {
        "floor": {
            "bytes": floor_bytes,
            "s": floor_s,
            "gb_per_s": floor_bytes / floor_s / 1e9,
            "copy_s": med(r["copy_s"] for r in rounds["floor"]),
            "writes": rounds["floor"][0]["writes"],
        },
        "variants": {},
    }
    print(
        f"floor (raw engine writes of the bf16 schedule's bytes): {floor_bytes / 1e6:.1f} MB in {1e3 * floor_s:.1f} ms "
        f"= {out['floor']['gb_per_s']:.2f} GB/s; local copy {1e3 * out['floor']['copy_s']:.1f} ms"
    )
    measured: dict[str, float] = {}
    for v in a.variants:
        rs = rounds[v]
        sched = scheds[v]
        nbytes = sched.stats()["bytes"]
        s = med(r["s"] for r in rs)
        stages = {k: med(r["stages"][k] for r in rs) for k in rs[0]["stages"]}
        submit_us = 1e6 * med(r["submit_s"] / max(1, r["requests"]) for r in rs)
        work = per_rank_work(sched)
        gather_s, quant_s = med(r["gather_s"] for r in rs), med(r["quantize_s"] for r in rs)
        gather_rate = max(work["bytes_gathered_in"]) / gather_s / 1e9 if gather_s else None
        quant_rate = max(work["bytes_quantized"]) / quant_s / 1e9 if quant_s else None
        # the slowest stage's own floor: the wire (same bytes share as the floor run) or a compute stage
        wire_s = floor_s * nbytes / floor_bytes
        slowest_stage = max(("wire", wire_s), ("gather", gather_s), ("quantize", quant_s), key=lambda x: x[1])
        row = {
            "bytes": nbytes,
            "requests": rs[0]["requests"],
            "s": s,
            "gb_per_s": nbytes / s / 1e9,
            "floor_ratio": wire_s / s,
            "slowest_stage": slowest_stage[0],
            "slowest_stage_ratio": slowest_stage[1] / s,
            "stages_s": stages,
            "submit_us_per_request": submit_us,
            "gather_gb_per_s": gather_rate,
            "quantize_gb_per_s": quant_rate,
            "staging_peak": max(r["staging_peak"] for r in rs),
        }
        out["variants"][v] = row
        print(
            f"update {v}: {nbytes / 1e6:.1f} MB, {row['requests']} requests in {1e3 * s:.1f} ms = {row['gb_per_s']:.2f} GB/s; "
            f"wire floor for these bytes {1e3 * wire_s:.1f} ms (ratio {row['floor_ratio']:.2f}); slowest stage "
            f"{slowest_stage[0]} at {row['slowest_stage_ratio']:.2f} of the update"
        )
        print(
            "  stages (slowest trainer, ms): "
            + ", ".join(f"{k} {1e3 * x:.1f}" for k, x in stages.items())
            + f"; submit {submit_us:.1f} us/request"
            + (f"; gather {gather_rate:.2f} GB/s" if gather_rate else "")
            + (f"; quantize {quant_rate:.2f} GB/s (bf16 in)" if quant_rate else "")
        )
        measured["submit_us"] = submit_us
        if a.device == "cuda" and gather_rate and backend(a) == "nccl":  # gloo's host staging says nothing
            measured["gather_gbs"] = gather_rate
    if a.device == "cuda":
        # The update's own quantize stage is launch-bound on this small model's slices; the scale
        # model needs the rate on Kimi-K2-sized expert slices, measured on the device here.
        measured["quantize_gbs"] = quantize_rate_large()
        out["quantize_gb_per_s_large"] = measured["quantize_gbs"]
        print(
            f"quantizer on 7168 x 2048 bf16 slices (device-synchronized): {measured['quantize_gbs']:.1f} GB/s"
        )
    rates = {**scale.DEFAULT_RATES, **measured}
    model = scale.run(rates, 64 << 30, 64 << 20)
    print(f"scale model with the measured {sorted(measured)} (others assumed: {scale.DEFAULT_RATES}):")
    scale.print_model(model)
    out["scale_model"] = model
    out["throughput"] = {
        "raw engine write (floor)": [{"size": floor_bytes, "gbytes_per_s": out["floor"]["gb_per_s"]}],
        **{
            f"update {v}": [{"size": r["bytes"], "gbytes_per_s": r["gb_per_s"]}]
            for v, r in out["variants"].items()
        },
    }
    return out


def plot_stages(path: Path, result: dict[str, Any]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(result["variants"])
    bottoms = [0.0] * len(names)
    for stage in ("h2d", "gather", "fuse", "quantize", "submit", "wait"):
        vals = [1e3 * result["variants"][n]["stages_s"][stage] for n in names]
        ax.bar(names, vals, bottom=bottoms, label=stage)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.bar(
        [f"{n} (end to end)" for n in names], [1e3 * result["variants"][n]["s"] for n in names], color="grey"
    )
    ax.bar(["floor"], [1e3 * result["floor"]["s"]], color="black")
    ax.set_ylabel("ms (slowest trainer; medians)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def quantize_rate_large(rows: int = 7168, cols: int = 2048, reps: int = 20) -> float:
    """GB/s (bf16 in) of the block FP8 quantizer on one Kimi-K2 expert matrix, on the GPU."""
    import torch
    from fabric_lib.weights.transforms import quantize_fp8_blocks

    x = torch.randn(rows, cols, device="cuda").to(torch.bfloat16)
    quantize_fp8_blocks(x, (128, 128))  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        quantize_fp8_blocks(x, (128, 128))
    torch.cuda.synchronize()
    return reps * x.numel() * 2 / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--inference", type=int, default=2)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--provider", default="tcp")
    p.add_argument(
        "--poll", choices=["busy", "adaptive"], default=None,
        help="engine polling (default: busy on cuda, adaptive on cpu, where 4 processes share few cores)",
    )  # fmt: skip
    p.add_argument("--force-network", action="store_true", help="GPU memory over the provider, not CUDA IPC")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--variants", type=lambda s: s.split(","), default=["bf16", "fp8"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-write-bytes", type=int, default=4 << 20)
    p.add_argument("--group-bytes", type=int, default=32 << 20)
    p.add_argument("--staging-bytes", type=int, default=64 << 20)
    p.add_argument("--profile", action="store_true", help="synchronize the device after each stage")
    p.add_argument("--json-out", type=Path, default=REPO / "bench-results" / "bench_weights.json")
    a = p.parse_args()
    result = run(a)
    write_result(a.json_out, "bench_weights", a.provider, vars(a), result)
    plot_stages(a.json_out.with_name(a.json_out.stem + "-stages.png"), result)


if __name__ == "__main__":
    main()
