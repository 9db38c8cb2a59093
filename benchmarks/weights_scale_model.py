"""A model of a weight update at scale: Kimi-K2 (1.03 T parameters) from 256 BF16 trainer GPUs
(PP 2 x EP 8 x FSDP 16) to 128 FP8 inference GPUs (4 instances of EP 32), from the schedule
``fabric_lib.weights`` computes for the real parameter shapes (metadata only: no tensor is
allocated) and per-stage rates.

    python -m benchmarks.weights_scale_model [--nic-gbps 400] [--quantize-gbs 1000] ...

Shapes (the published config: 61 layers, the first dense; hidden 7168; 384 routed experts of
moe_intermediate 2048 and one shared expert per MoE layer; MLA with q_lora_rank 1536,
kv_lora_rank 512, 64 heads, qk_nope 128, qk_rope 64, v_head 128; vocab 163840; untied
embeddings). Assumptions, each an option:

- Trainers (rank = pp*128 + ep*16 + fsdp): stage 0 holds layers 0-30 and the embeddings, stage
  1 layers 31-60, the final norm and lm_head. Routed experts are stacked per layer
  (``[384, out, in]``, grouped GEMM): EP group ``ep`` holds experts ``[48 ep, 48 ep + 48)``,
  each of its 16 ranks 3 whole experts (no gather needed). Every other parameter is HSDP: FSDP2
  rows over the 16 ranks of an EP group, replicated over the 8 EP groups (gathered before use).
- Inference (rank = instance*32 + j): routed experts of an instance split over its 32 ranks
  (12 per rank), gate and up fused into ``w13 [12, 4096, 7168]``; attention (DP attention),
  shared experts, the dense layer and the router replicated on every rank, ``q_a_proj`` and
  ``kv_a_proj_with_mqa`` fused, gate/up fused; embeddings and lm_head split over the vocabulary.
  Linear weights are FP8 with 128x128 block scales; norms, router, embeddings stay BF16.
- Time: the trainers' stages overlap (a pipeline), so a trainer needs the longest of: its
  writes at the NIC rate, its FSDP gathers (bytes it receives at ``gather_gbs``), its
  quantization (BF16 bytes at ``quantize_gbs``), its submit calls (``submit_us`` each); an
  inference rank needs its received bytes at the NIC rate. The update takes the longest of all
  of these plus one barrier per parameter group (``barrier_us``) and the pipeline's fill (the
  largest unit's gather and quantization). With ``--shared-nic`` the gathers share the
  trainer's NIC with the writes (FSDP groups spanning hosts).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from fabric_lib.weights import (
    DTYPE_SIZES,
    FP8,
    Schedule,
    build_schedule,
    grouped,
    source,
    target,
)
from fabric_lib.weights.layout import box_numel

LAYERS, HIDDEN, VOCAB = 61, 7168, 163840
EXPERTS, MOE_INTER, DENSE_INTER, SHARED_INTER = 384, 2048, 18432, 2048
HEADS, Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_HEAD = 64, 1536, 512, 128, 64, 128
PP, EP, FSDP = 2, 8, 16
INSTANCES, INF_EP = 4, 32
PUBLISHED_S = 1.3


def kimi_k2_layout(
    layers: int = LAYERS,
    pp: int = PP,
    ep: int = EP,
    fsdp: int = FSDP,
    instances: int = INSTANCES,
    inf_ep: int = INF_EP,
) -> tuple[list[Any], list[Any], int, int]:
    """Trainer and inference descriptions of Kimi-K2 under the assumptions above."""
    per_stage = -(-layers // pp)
    stage_ranks = ep * fsdp

    def ep_groups(stage: int) -> list[list[int]]:
        return [[stage * stage_ranks + e * fsdp + f for f in range(fsdp)] for e in range(ep)]

    def hsdp(stage: int) -> Any:
        return grouped(ep_groups(stage), outer_dim=None, inner="fsdp")

    def experts(stage: int) -> Any:
        return grouped(ep_groups(stage), outer_dim=0, inner="shard", dim=0)

    inst = [[i * inf_ep + j for j in range(inf_ep)] for i in range(instances)]
    everywhere = grouped(inst, outer_dim=None, inner="replicate")
    vocab = grouped(inst, outer_dim=None, inner="shard", dim=0)
    expert_split = grouped(inst, outer_dim=None, inner="shard", dim=0)
    bf16 = "bfloat16"
    sources: list[Any] = [source("model.embed_tokens.weight", (VOCAB, HIDDEN), bf16, hsdp(0))]
    targets: list[Any] = [target("model.embed_tokens.weight", "model.embed_tokens.weight", vocab)]

    def add(name: str, shape: tuple[int, ...], stage: int, placement: Any = None) -> None:
        sources.append(source(name, shape, bf16, placement or hsdp(stage)))

    for layer in range(layers):
        stage = min(layer // per_stage, pp - 1)
        p = f"model.layers.{layer}."
        a = p + "self_attn."
        add(a + "q_a_proj.weight", (Q_LORA, HIDDEN), stage)
        add(a + "kv_a_proj_with_mqa.weight", (KV_LORA + QK_ROPE, HIDDEN), stage)
        add(a + "q_a_layernorm.weight", (Q_LORA,), stage)
        add(a + "q_b_proj.weight", (HEADS * (QK_NOPE + QK_ROPE), Q_LORA), stage)
        add(a + "kv_a_layernorm.weight", (KV_LORA,), stage)
        add(a + "kv_b_proj.weight", (HEADS * (QK_NOPE + V_HEAD), KV_LORA), stage)
        add(a + "o_proj.weight", (HIDDEN, HEADS * V_HEAD), stage)
        add(p + "input_layernorm.weight", (HIDDEN,), stage)
        add(p + "post_attention_layernorm.weight", (HIDDEN,), stage)
        targets += [
            target(a + "fused_qkv_a_proj_with_mqa.weight", [a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight"], everywhere, dtype=FP8),
            target(a + "q_a_layernorm.weight", a + "q_a_layernorm.weight", everywhere),
            target(a + "q_b_proj.weight", a + "q_b_proj.weight", everywhere, dtype=FP8),
            target(a + "kv_a_layernorm.weight", a + "kv_a_layernorm.weight", everywhere),
            target(a + "kv_b_proj.weight", a + "kv_b_proj.weight", everywhere, dtype=FP8),
            target(a + "o_proj.weight", a + "o_proj.weight", everywhere, dtype=FP8),
            target(p + "input_layernorm.weight", p + "input_layernorm.weight", everywhere),
            target(p + "post_attention_layernorm.weight", p + "post_attention_layernorm.weight", everywhere),
        ]  # fmt: skip
        m = p + "mlp."
        if layer == 0:
            add(m + "gate_proj.weight", (DENSE_INTER, HIDDEN), stage)
            add(m + "up_proj.weight", (DENSE_INTER, HIDDEN), stage)
            add(m + "down_proj.weight", (HIDDEN, DENSE_INTER), stage)
            targets += [
                target(
                    m + "gate_up_proj.weight",
                    [m + "gate_proj.weight", m + "up_proj.weight"],
                    everywhere,
                    dtype=FP8,
                ),
                target(m + "down_proj.weight", m + "down_proj.weight", everywhere, dtype=FP8),
            ]
            continue
        add(m + "gate.weight", (EXPERTS, HIDDEN), stage)
        add(m + "gate.e_score_correction_bias", (EXPERTS,), stage)
        s = m + "shared_experts."
        add(s + "gate_proj.weight", (SHARED_INTER, HIDDEN), stage)
        add(s + "up_proj.weight", (SHARED_INTER, HIDDEN), stage)
        add(s + "down_proj.weight", (HIDDEN, SHARED_INTER), stage)
        e = m + "experts."
        add(e + "gate_proj", (EXPERTS, MOE_INTER, HIDDEN), stage, experts(stage))
        add(e + "up_proj", (EXPERTS, MOE_INTER, HIDDEN), stage, experts(stage))
        add(e + "down_proj", (EXPERTS, HIDDEN, MOE_INTER), stage, experts(stage))
        targets += [
            target(m + "gate.weight", m + "gate.weight", everywhere),
            target(m + "gate.e_score_correction_bias", m + "gate.e_score_correction_bias", everywhere),
            target(s + "gate_up_proj.weight", [s + "gate_proj.weight", s + "up_proj.weight"], everywhere, dtype=FP8),
            target(s + "down_proj.weight", s + "down_proj.weight", everywhere, dtype=FP8),
            target(e + "w13_weight", [e + "gate_proj", e + "up_proj"], expert_split, fuse_dim=1, dtype=FP8),
            target(e + "w2_weight", e + "down_proj", expert_split, dtype=FP8),
        ]  # fmt: skip
    sources.append(source("model.norm.weight", (HIDDEN,), bf16, hsdp(pp - 1)))
    sources.append(source("lm_head.weight", (VOCAB, HIDDEN), bf16, hsdp(pp - 1)))
    targets.append(target("model.norm.weight", "model.norm.weight", everywhere))
    targets.append(target("lm_head.weight", "lm_head.weight", vocab))
    return sources, targets, pp * stage_ranks, instances * inf_ep


def per_rank_work(sched: Schedule) -> dict[str, Any]:
    """Per trainer: bytes written, requests, BF16 bytes quantized, bytes received by its gathers;
    per inference rank: bytes received; and the largest unit (the pipeline's fill)."""
    n = sched.num_trainers
    quant = [0] * n
    for w in sched.writes:
        t = sched.targets[w.target]
        if t.quantized:
            quant[w.writer] += box_numel(w.dst_box) * DTYPE_SIZES[sched.sources[t.parts[0]].dtype]
    gather_in = [0] * n
    largest = 0
    for u in sched.units:
        size = box_numel(u.box) * DTYPE_SIZES[sched.sources[u.source].dtype]
        if u.needed and u.gather:
            g = len(u.gather_group)
            for r in u.gather_group:
                gather_in[r] += size * (g - 1) // g
            largest = max(largest, size)
    stats = sched.stats()
    return {
        "bytes_sent": stats["bytes_sent"],
        "requests": stats["requests_sent"],
        "bytes_quantized": quant,
        "bytes_gathered_in": gather_in,
        "bytes_received": stats["bytes_received"],
        "largest_gathered_unit": largest,
        "param_groups": stats["param_groups"],
        "writes": stats["writes"],
        "total_requests": stats["requests"],
        "total_bytes": stats["bytes"],
    }


def predict(work: dict[str, Any], rates: dict[str, float], shared_nic: bool = False) -> dict[str, Any]:
    """The update time under ``rates``: nic_gbps (per GPU, each direction), gather_gbs,
    quantize_gbs (BF16 bytes in per second), submit_us, barrier_us."""
    nic = rates["nic_gbps"] * 1e9 / 8
    per_trainer = []
    for i in range(len(work["bytes_sent"])):
        send = (work["bytes_sent"][i] + (work["bytes_gathered_in"][i] if shared_nic else 0)) / nic
        stages = {
            "send": send,
            "gather": work["bytes_gathered_in"][i] / (rates["gather_gbs"] * 1e9),
            "quantize": work["bytes_quantized"][i] / (rates["quantize_gbs"] * 1e9),
            "submit": work["requests"][i] * rates["submit_us"] * 1e-6,
        }
        per_trainer.append(stages)
    slowest_trainer = max(range(len(per_trainer)), key=lambda i: max(per_trainer[i].values()))
    trainer_s = max(per_trainer[slowest_trainer].values())
    receive_s = max(work["bytes_received"]) / nic
    fill = work["largest_gathered_unit"] * (
        1 / (rates["gather_gbs"] * 1e9) + 1 / (rates["quantize_gbs"] * 1e9)
    )
    barriers = work["param_groups"] * rates["barrier_us"] * 1e-6
    total = max(trainer_s, receive_s) + fill + barriers
    return {
        "predicted_s": total,
        "published_s": PUBLISHED_S,
        "bound": "inference receive" if receive_s >= trainer_s else f"trainer {slowest_trainer}",
        "inference_receive_s": receive_s,
        "slowest_trainer": {k: round(v, 4) for k, v in per_trainer[slowest_trainer].items()},
        "pipeline_fill_s": fill,
        "barriers_s": barriers,
        "rates": dict(rates),
        "shared_nic": shared_nic,
    }


DEFAULT_RATES = {
    "nic_gbps": 400.0,  # per GPU, as published
    "gather_gbs": 100.0,  # FSDP all-gather, bytes received per GPU per second (NVLink + IB mix)
    "quantize_gbs": 1000.0,  # BF16 bytes in per second: a memory-bound kernel on an H100 (3.35 TB/s HBM)
    "submit_us": 23.0,  # per request, the published per-call cost (the benchmark measures its own)
    "barrier_us": 200.0,  # one barrier among 256 trainers (one per parameter group)
}


def run(rates: dict[str, float], group_bytes: int, max_write_bytes: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    sources, targets, trainers, inference = kimi_k2_layout()
    sched = build_schedule(
        sources,
        targets,
        num_trainers=trainers,
        num_inference=inference,
        max_write_bytes=max_write_bytes,
        group_bytes=group_bytes,
    )
    build_s = time.perf_counter() - t0
    work = per_rank_work(sched)
    params = sum(box_numel(tuple((0, n) for n in s.shape)) for s in sources)
    out = {
        "model": "Kimi-K2",
        "parameters": params,
        "trainers": trainers,
        "inference_ranks": inference,
        "schedule_build_s": build_s,
        "writes": work["writes"],
        "requests": work["total_requests"],
        "requests_per_trainer_max": max(work["requests"]),
        "requests_per_trainer_mean": work["total_requests"] / trainers,
        "bytes_total": work["total_bytes"],
        "bytes_sent_per_trainer_max": max(work["bytes_sent"]),
        "bytes_sent_per_trainer_mean": work["total_bytes"] / trainers,
        "bytes_received_per_inference_max": max(work["bytes_received"]),
        "bytes_gathered_in_per_trainer_max": max(work["bytes_gathered_in"]),
        "param_groups": work["param_groups"],
        "prediction": predict(work, rates),
        "prediction_shared_nic": predict(work, rates, shared_nic=True),
    }
    return out


def print_model(result: dict[str, Any]) -> None:
    p = result["prediction"]
    print(
        f"Kimi-K2 {result['parameters'] / 1e12:.3f} T params: {result['trainers']} trainers -> "
        f"{result['inference_ranks']} inference ranks; schedule of {result['writes']} writes "
        f"({result['requests']} requests) built in {result['schedule_build_s']:.1f} s"
    )
    print(
        f"  per trainer: {result['bytes_sent_per_trainer_max'] / 1e9:.1f} GB sent (max; mean "
        f"{result['bytes_sent_per_trainer_mean'] / 1e9:.1f}), {result['requests_per_trainer_max']} requests (max), "
        f"{result['bytes_gathered_in_per_trainer_max'] / 1e9:.1f} GB gathered in; per inference rank "
        f"{result['bytes_received_per_inference_max'] / 1e9:.1f} GB received"
    )
    for label, pred in (("overlapped", p), ("gathers on the NIC", result["prediction_shared_nic"])):
        print(
            f"  predicted update ({label}): {pred['predicted_s']:.2f} s (published {PUBLISHED_S} s), "
            f"bound by {pred['bound']}; slowest trainer stages {pred['slowest_trainer']}, "
            f"inference receive {pred['inference_receive_s']:.3f} s, fill {pred['pipeline_fill_s']:.3f} s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for key, value in DEFAULT_RATES.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=float, default=value)
    p.add_argument(
        "--group-bytes",
        type=int,
        default=64 << 30,
        help="bytes per parameter group (one barrier each; about a layer)",
    )
    p.add_argument("--max-write-bytes", type=int, default=64 << 20)
    p.add_argument("--json-out", type=Path, default=None)
    a = p.parse_args()
    rates = {k: getattr(a, k) for k in DEFAULT_RATES}
    result = run(rates, a.group_bytes, a.max_write_bytes)
    print_model(result)
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
