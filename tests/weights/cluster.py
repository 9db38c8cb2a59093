"""Processes for the weight-transfer tests: trainer ranks (a gloo group among themselves, the model's
weights FSDP-sharded) and inference ranks (a WeightReceiver over zeroed tensors), started with
``fabric_lib.testing.spawn_ranks``; and the plain reference of what the inference side must hold.

The trainers' weights at version ``v`` are a transformers Llama's random initial weights (seed 0)
plus ``0.01 * v`` times seeded noise per tensor, so every process computes them alike.
"""

from __future__ import annotations

import os
import signal
import time
import zlib
from typing import Any

CONFIG = {
    "vocab_size": 1024,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}
TIMEOUT = 5.0  # engine transfer timeout, barrier and gather timeouts: the failure bound


def base_weights(config: dict[str, Any] = CONFIG, device: str = "cpu") -> dict[str, Any]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))
    return {n: p.detach().to(torch.bfloat16).to(device) for n, p in model.named_parameters()}


def weights_at(base: dict[str, Any], version: int) -> dict[str, Any]:
    """What the trainers hold after training step ``version``."""
    import torch

    out = {}
    for name, w in base.items():
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1000 + version)
        noise = torch.randn(w.shape, generator=gen).to(w.device)
        out[name] = (w.float() + 0.01 * version * noise).to(torch.bfloat16)
    return out


def shapes(config: dict[str, Any] = CONFIG) -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def trainer_placement(num_trainers: int) -> Any:
    """Vocabulary shards for the embeddings (no gather), FSDP2 rows for the MLP, FSDP1 flat
    shards for everything else."""
    from fabric_lib.weights import flat_sharded, fsdp_sharded, sharded

    ranks = list(range(num_trainers))

    def place(name: str, shape: tuple[int, ...]) -> Any:
        if "embed_tokens" in name or "lm_head" in name:
            return sharded(0, ranks)
        if ".mlp." in name:
            return fsdp_sharded(ranks)
        return flat_sharded(ranks)

    return place


# -- the plain reference ------------------------------------------------------------------------
def reference_fp8(x: Any, block: int = 128) -> tuple[Any, Any]:
    """Block FP8 quantization, one block at a time: scale = max|x| / 448 (at least 1e-12 / 448),
    q = clamp(x / scale, -448, 448) as float8_e4m3fn."""
    import torch

    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-rows // block), -(-cols // block), dtype=torch.float32)
    for i in range(0, rows, block):
        for j in range(0, cols, block):
            blk = x[i : i + block, j : j + block].float()
            scale = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i : i + block, j : j + block] = (blk / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            s[i // block, j // block] = scale
    return q, s


def expected_inference(full: dict[str, Any], rank: int, tp: int, layers: int, fp8: bool) -> dict[str, Any]:
    """vLLM-style TP shard ``rank`` of ``tp`` of the trainer's weights ``full``."""
    import torch

    out: dict[str, Any] = {}

    def linear(name: str, w: Any) -> None:
        if fp8:
            out[name], out[f"{name}_scale_inv"] = reference_fp8(w)
        else:
            out[name] = w

    for i in range(layers):
        p = f"model.layers.{i}."
        qkv = [full[f"{p}self_attn.{x}_proj.weight"].chunk(tp)[rank] for x in "qkv"]
        linear(f"{p}self_attn.qkv_proj.weight", torch.cat(qkv))
        linear(f"{p}self_attn.o_proj.weight", full[f"{p}self_attn.o_proj.weight"].chunk(tp, dim=1)[rank])
        gu = [full[f"{p}mlp.{x}_proj.weight"].chunk(tp)[rank] for x in ("gate", "up")]
        linear(f"{p}mlp.gate_up_proj.weight", torch.cat(gu))
        linear(f"{p}mlp.down_proj.weight", full[f"{p}mlp.down_proj.weight"].chunk(tp, dim=1)[rank])
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}{norm}.weight"] = full[f"{p}{norm}.weight"]
    out["model.embed_tokens.weight"] = full["model.embed_tokens.weight"].chunk(tp)[rank]
    out["lm_head.weight"] = full["lm_head.weight"].chunk(tp)[rank]
    out["model.norm.weight"] = full["model.norm.weight"]
    return out


def mismatches(got: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """Names whose bytes differ (or that are missing on either side)."""
    import torch

    bad = sorted(set(got) ^ set(expected))
    for name in sorted(set(got) & set(expected)):
        a, b = got[name], expected[name].contiguous()
        if a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            bad.append(name)
    return bad


# -- trainer ranks ------------------------------------------------------------------------------
class Trainer:
    def __init__(
        self,
        device: str = "cpu",
        provider: str = "tcp",
        force_network: bool = False,
        config: dict[str, Any] = CONFIG,
        backend: str = "gloo",
    ) -> None:
        import fabric_lib
        import torch
        import torch.distributed as dist
        from fabric_lib.testing import init_process_group, this_rank

        torch.set_num_threads(1)
        info = this_rank()
        self.device: Any = device
        if device == "cuda":
            index = info.local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        init_process_group(backend, timeout=TIMEOUT)
        self.rank = dist.get_rank()
        opts: dict[str, Any] = {"poll_mode": "adaptive", "transfer_timeout": TIMEOUT}
        if force_network:
            opts.update(gpu_network=True, force_network=True)
        self.engine = fabric_lib.TransferEngine(provider, **opts)
        self.base = base_weights(config, device="cpu")
        self.senders: dict[str, Any] = {}  # one per variant (own immediates), sharing the engine
        self.params: dict[str, dict[str, Any]] = {}

    def close(self) -> None:
        for sender in self.senders.values():
            sender.close()
        self.engine.stop()


def open_trainer(**kw: Any) -> Trainer:
    return Trainer(**kw)


def close_trainer(t: Trainer) -> None:
    t.close()


def imm_bases(variant: int) -> tuple[int, int]:
    """Update and barrier immediates of the ``variant``-th schedule sharing an engine."""
    from fabric_lib.weights import DEFAULT_IMM_BASE
    from fabric_lib.weights.sender import DEFAULT_BARRIER_IMM_BASE

    return DEFAULT_IMM_BASE + (variant << 16), DEFAULT_BARRIER_IMM_BASE + (variant << 20)


def make_sender(
    t: Trainer,
    variant: str,
    index: int,
    schedule_json: str,
    manifests: list[bytes],
    staging_bytes: int,
    offload: bool = False,
) -> None:
    """``offload``: the shards stay in host memory while the sender works on ``t.device`` (the
    host->device stage)."""
    from fabric_lib.weights import Schedule, WeightSender, trainer_shards

    sched = Schedule.from_json(schedule_json)
    where = "cpu" if offload else t.device
    params = {n: p.to(where) for n, p in trainer_shards(sched, t.rank, weights_at(t.base, 0)).items()}
    t.params[variant] = params
    imm, barrier_imm = imm_bases(index)
    t.senders[variant] = WeightSender(
        t.engine,
        sched,
        t.rank,
        params,
        manifests,
        device=t.device,
        staging_bytes=staging_bytes,
        imm_base=imm,
        barrier_imm_base=barrier_imm,
        barrier_timeout=2 * TIMEOUT,  # above the transfer timeout: a peer's writes may time out first
        gather_timeout=TIMEOUT,
    )


def train_and_update(
    t: Trainer, variant: str, version: int, die_after_group: int | None = None
) -> dict[str, Any]:
    """A training step (new weights, copied into the live shards), then the update."""
    from fabric_lib.weights import WeightsPeerLostError, trainer_shards

    sender = t.senders[variant]
    new = trainer_shards(sender.schedule, t.rank, weights_at(t.base, version))
    for name, p in t.params[variant].items():
        p.copy_(new[name])

    def progress(group: int) -> None:
        if group == die_after_group:
            os.kill(os.getpid(), signal.SIGKILL)  # a trainer crashing in the middle of an update

    start = time.monotonic()
    try:
        stats = sender.update(version, timeout=60.0, on_group_done=progress)
    except WeightsPeerLostError as e:
        return {
            "error": type(e).__name__,
            "role": e.role,
            "ranks": list(e.ranks),
            "after_s": time.monotonic() - start,
        }
    return {"stats": stats.__dict__}


# -- inference ranks ----------------------------------------------------------------------------
class Inference:
    def __init__(
        self, device: str = "cpu", provider: str = "tcp", force_network: bool = False, gpu_offset: int = 0
    ) -> None:
        import fabric_lib
        import torch
        from fabric_lib.testing import this_rank

        torch.set_num_threads(1)
        info = this_rank()
        self.rank = info.rank
        self.device: Any = device
        if device == "cuda":
            index = (info.local_rank + gpu_offset) % torch.cuda.device_count()
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
        opts: dict[str, Any] = {"poll_mode": "adaptive", "transfer_timeout": TIMEOUT}
        if force_network:
            opts.update(gpu_network=True, force_network=True)
        self.engine = fabric_lib.TransferEngine(provider, **opts)
        self.receivers: dict[str, Any] = {}

    def close(self) -> None:
        for receiver in self.receivers.values():
            receiver.close()
        self.engine.stop()


def open_inference(**kw: Any) -> Inference:
    return Inference(**kw)


def close_inference(i: Inference) -> None:
    i.close()


def make_receiver(i: Inference, variant: str, index: int, schedule_json: str) -> bytes:
    from fabric_lib.weights import Schedule, WeightReceiver, inference_params

    sched = Schedule.from_json(schedule_json)
    params = inference_params(sched, i.rank, device=i.device)
    receiver = WeightReceiver(i.engine, params, i.rank, imm_base=imm_bases(index)[0])
    receiver.set_schedule(sched)
    i.receivers[variant] = receiver
    return receiver.manifest()


def wait_update(i: Inference, variant: str, version: int, timeout: float) -> dict[str, Any]:
    from fabric_lib.weights import UpdateIncompleteError

    receiver = i.receivers[variant]
    try:
        receiver.wait_for_update(version, timeout)
    except UpdateIncompleteError as e:
        return {
            "error": type(e).__name__,
            "received": e.received,
            "expected": e.expected,
            "partial": e.partial,
            "intact": receiver.intact,
            "version": receiver.version,
        }
    return {"version": receiver.version, "intact": receiver.intact}


def fetch(i: Inference, variant: str) -> dict[str, tuple[str, Any]]:
    """Every registered tensor, as (dtype, raw bytes on the CPU)."""
    import torch

    return {
        n: (str(t.dtype).removeprefix("torch."), t.detach().cpu().contiguous().view(torch.uint8).clone())
        for n, t in i.receivers[variant].params.items()
    }


def as_tensors(fetched: dict[str, tuple[str, Any]]) -> dict[str, Any]:
    import torch

    return {n: raw.view(getattr(torch, dtype)) for n, (dtype, raw) in fetched.items()}


# -- the launcher's handle ----------------------------------------------------------------------
class Cluster:
    """Two trainer and ``tp`` inference processes; one sender and receiver per variant
    (``variants``: name -> FP8 or not), each with its own immediates on the shared engines."""

    def __init__(
        self,
        variants: dict[str, bool],
        *,
        config: dict[str, Any] = CONFIG,
        tp: int = 2,
        device: str = "cpu",
        provider: str = "tcp",
        force_network: bool = False,
        backend: str = "gloo",
        max_write_bytes: int = 256 << 10,
        group_bytes: int = 2 << 20,
        staging_bytes: int = 1 << 20,
        offloaded: tuple[str, ...] = (),
    ) -> None:
        from fabric_lib.testing import gather, spawn_ranks
        from fabric_lib.weights import build_schedule, dense_transformer

        self.variants, self.config, self.tp = variants, config, tp
        self.schedules = {}
        for variant, fp8 in variants.items():
            sources, targets = dense_transformer(
                shapes(config),
                trainer_placement=trainer_placement(2),
                inference_groups=[list(range(tp))],
                fp8=fp8,
            )
            self.schedules[variant] = build_schedule(
                sources, targets, num_trainers=2, num_inference=tp, max_write_bytes=max_write_bytes,
                group_bytes=group_bytes,
            )  # fmt: skip
        net = {"device": device, "provider": provider, "force_network": force_network}
        self.net = net
        self.inference = spawn_ranks(
            tp, setup=open_inference, setup_kwargs={**net, "gpu_offset": 2}, teardown=close_inference,
            names=[f"inf{r}" for r in range(tp)], timeout=180,
        )  # fmt: skip
        try:
            self.trainers = spawn_ranks(
                2, setup=open_trainer, setup_kwargs={**net, "config": config, "backend": backend},
                teardown=close_trainer, names=["trainer0", "trainer1"], timeout=180,
            )  # fmt: skip
        except BaseException:
            self.inference.close()
            raise
        try:
            for index, (variant, sched) in enumerate(self.schedules.items()):
                text = sched.to_json()
                manifests = self.inference.call_all(make_receiver, variant, index, text)
                offload = variant in offloaded
                gather(
                    self.trainers.submit_all(
                        make_sender, variant, index, text, manifests, staging_bytes, offload
                    ),
                    timeout=120,
                )
        except BaseException:
            self.close()
            raise
        self.base = base_weights(config)

    def update(
        self, variant: str, version: int, die_after_group: dict[int, int] | None = None, wait: float = 30.0
    ) -> tuple[list[Any], list[Any]]:
        """A training step and update on every live trainer while every live inference rank waits."""
        live_t = [t for t in self.trainers if t.exitcode is None and not t.broken]
        live_i = [i for i in self.inference if i.exitcode is None and not i.broken]
        sent = [
            t.submit(train_and_update, variant, version, (die_after_group or {}).get(t.rank)) for t in live_t
        ]
        waits = [i.submit(wait_update, variant, version, wait) for i in live_i]
        results_i = [w.result(timeout=wait + 60) for w in waits]
        results_t = []
        for t, p in zip(live_t, sent, strict=True):
            try:
                results_t.append(p.result(timeout=120))
            except Exception as e:  # noqa: BLE001 - the rank killed itself
                results_t.append({"died": str(e).splitlines()[0], "rank": t.rank})
        return results_t, results_i

    def fetch_from(self, variant: str, rank: int) -> dict[str, Any]:
        return as_tensors(self.inference[rank].submit(fetch, variant).result(timeout=120))

    def check(self, variant: str, rank: int, version: int) -> list[str]:
        full = weights_at(self.base, version)
        expected = expected_inference(
            full, rank, self.tp, self.config["num_hidden_layers"], self.variants[variant]
        )
        return mismatches(self.fetch_from(variant, rank), expected)

    def close(self) -> None:
        self.trainers.close()
        self.inference.close()
