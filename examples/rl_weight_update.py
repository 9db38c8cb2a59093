"""RL weight update with fabric_lib.weights, all in one process for brevity: one trainer rank
updates two inference ranks (TP2) of a small transformer-shaped model, fusing q/k/v and gate/up
and quantizing to block FP8 on the way. Across processes the same objects are built on each
rank; only the schedule (JSON) and the receivers' manifests (bytes) travel (docs/weights.md)."""

from __future__ import annotations

import fabric_lib
import torch
from fabric_lib.weights import (
    WeightReceiver,
    WeightSender,
    build_schedule,
    dense_transformer,
    inference_params,
    replicated,
    trainer_shards,
)

HIDDEN, INTER, KV = 256, 512, 256  # TP2 shards of every part are whole 128-blocks
SHAPES = {
    "model.embed_tokens.weight": (1024, HIDDEN),
    "model.layers.0.self_attn.q_proj.weight": (HIDDEN, HIDDEN),
    "model.layers.0.self_attn.k_proj.weight": (KV, HIDDEN),
    "model.layers.0.self_attn.v_proj.weight": (KV, HIDDEN),
    "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HIDDEN),
    "model.layers.0.mlp.gate_proj.weight": (INTER, HIDDEN),
    "model.layers.0.mlp.up_proj.weight": (INTER, HIDDEN),
    "model.layers.0.mlp.down_proj.weight": (HIDDEN, INTER),
    "model.layers.0.input_layernorm.weight": (HIDDEN,),
    "model.norm.weight": (HIDDEN,),
    "lm_head.weight": (1024, HIDDEN),
}


def main() -> None:
    # The controller: metadata in, a static schedule out (JSON, the same on every rank).
    sources, targets = dense_transformer(
        SHAPES, trainer_placement=lambda name, shape: replicated([0]), inference_groups=[[0, 1]], fp8=True
    )
    schedule = build_schedule(sources, targets, num_trainers=1, num_inference=2)
    print(f"schedule: {schedule.stats()['writes']} writes, {schedule.stats()['bytes']} bytes")

    with (
        fabric_lib.TransferEngine("tcp", poll_mode="adaptive") as trainer_engine,
        fabric_lib.TransferEngine("tcp", poll_mode="adaptive") as engine0,
        fabric_lib.TransferEngine("tcp", poll_mode="adaptive") as engine1,
    ):
        # Inference ranks: register the parameters once, publish a manifest.
        receivers = []
        for rank, engine in enumerate((engine0, engine1)):
            receiver = WeightReceiver(engine, inference_params(schedule, rank), rank)
            receiver.set_schedule(schedule.to_json())
            receivers.append(receiver)
        manifests = [r.manifest() for r in receivers]

        # The trainer rank: its live parameters (here whole tensors) and the manifests.
        weights = {name: torch.randn(shape).to(torch.bfloat16) for name, shape in SHAPES.items()}
        params = trainer_shards(schedule, 0, weights)
        sender = WeightSender(trainer_engine, schedule.to_json(), 0, params, manifests, staging_bytes=8 << 20)

        for version in (1, 2):
            for p in params.values():  # a "training step"
                p.add_(0.01)
            stats = sender.update(version, timeout=30)
            for receiver in receivers:
                receiver.wait_for_update(version, timeout=30)
            print(
                f"version {version}: {stats.bytes} bytes in {stats.writes} writes, {stats.total_s * 1e3:.1f} ms"
            )

        qkv = receivers[1].params["model.layers.0.self_attn.qkv_proj.weight"]
        scales = receivers[1].params["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
        expected = torch.cat([params[f"model.layers.0.self_attn.{x}_proj.weight"].chunk(2)[1] for x in "qkv"])
        dequant = (
            qkv.float()
            * scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[: qkv.shape[0], : qkv.shape[1]]
        )
        error = (dequant - expected.float()).abs().max() / expected.float().abs().max()
        print(
            f"inference rank 1, fused qkv {tuple(qkv.shape)} FP8: relative error {error:.3f} after dequantizing"
        )
        assert error < 0.1


if __name__ == "__main__":
    main()
