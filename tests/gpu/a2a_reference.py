"""The pure-torch reference that tests/gpu/test_all_to_all.py checks fabric_lib.all_to_all against:
tokens (bf16, or fp8 with a scale per 128 values), routings, the "experts" and the expected
dispatch layout and combine result."""

from __future__ import annotations

from typing import Any

import torch

HIDDEN = 512
TOPK = 4


def make_tokens(T: int, dtype: Any, gen: Any, device: Any, hidden: int = HIDDEN) -> tuple[Any, Any, Any]:
    """(x, scales or None, dequantized fp32 x) with fp8 scales per 128 values."""
    xf = torch.randn(T, hidden, generator=gen).to(device)
    if dtype == torch.bfloat16:
        x = xf.bfloat16()
        return x, None, x.float()
    blocks = xf.view(T, hidden // 128, 128)
    scales = (blocks.abs().amax(-1).clamp(min=1e-4) / 448.0).contiguous()
    q = (blocks / scales[..., None]).to(torch.float8_e4m3fn).view(T, hidden)
    deq = (q.float().view(T, hidden // 128, 128) * scales[..., None]).view(T, hidden)
    return q, scales, deq


def make_routing(kind: str, T: int, E: int, gen: Any, device: Any) -> tuple[Any, Any]:
    if kind == "skewed":
        idx = torch.arange(TOPK, dtype=torch.int64).expand(T, TOPK).contiguous()
    else:
        idx = torch.rand(T, E, generator=gen).topk(TOPK, dim=-1).indices
        if kind == "masked":
            drop = torch.rand(T, TOPK, generator=gen) < 0.15
            idx = torch.where(drop, torch.full_like(idx, -1), idx)
    weights = torch.rand(T, TOPK, generator=gen).softmax(-1)
    return idx.to(device), weights.to(device)


def coef(E: int, device: Any) -> Any:
    return 1.0 + torch.arange(E, device=device, dtype=torch.float32) / E


def run_experts(a2a: Any, out: Any) -> Any:
    """The 'experts': expert e multiplies its (dequantized) rows by coef[e]."""
    L, r = a2a.local_experts, a2a.rank
    xf = out.x.float()
    if out.scales is not None:
        xf = xf * out.scales.repeat_interleave(128, dim=-1)
    c = coef(a2a.num_experts, xf.device)[r * L : (r + 1) * L]
    return (xf * c[:, None, None]).nan_to_num().bfloat16()


def expected_combine(deq: Any, idx: Any, w: Any, E: int, T_live: int) -> Any:
    c = coef(E, deq.device)
    valid = idx >= 0
    factor = (w * c[idx.clamp(min=0)] * valid).sum(-1)
    out = deq * factor[:, None]
    out[T_live:] = 0
    return out


def check_combine(got: Any, deq: Any, idx: Any, w: Any, E: int, T_live: int) -> None:
    want = expected_combine(deq, idx, w, E, T_live)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=3e-2)


def check_dispatch(a2a: Any, out: Any, x: Any, scales: Any, idx: Any, T_live: int) -> None:
    """Gathers every rank's inputs and compares the expert-major layout bit for bit."""
    import torch.distributed as dist

    W, L, K, Tm = a2a.world_size, a2a.local_experts, a2a.experts_per_token, a2a.max_num_tokens
    dev = a2a.device
    xb = (
        x.view(torch.uint8)
        if x.numel()
        else torch.empty((0, a2a.hidden * x.element_size()), dtype=torch.uint8, device=dev)
    )
    row_bytes = xb.shape[1]
    px = torch.zeros((Tm, row_bytes), dtype=torch.uint8, device=dev)
    px[:T_live] = xb[:T_live]
    pi = torch.full((Tm, K), -1, dtype=torch.int64, device=dev)
    pi[:T_live] = idx[:T_live].long()
    ns = a2a.num_scales
    ps = torch.zeros((Tm, max(ns, 1)), dtype=torch.float32, device=dev)
    if ns:
        ps[:T_live] = scales[:T_live]
    # gloo (several ranks on one GPU, where NCCL refuses) gathers host copies.
    stage = (lambda t: t.cpu()) if dist.get_backend() == "gloo" else (lambda t: t)
    px, pi, ps = stage(px), stage(pi), stage(ps)
    gx = [torch.empty_like(px) for _ in range(W)]
    gi = [torch.empty_like(pi) for _ in range(W)]
    gs = [torch.empty_like(ps) for _ in range(W)]
    dist.all_gather(gx, px)
    dist.all_gather(gi, pi)
    dist.all_gather(gs, ps)
    gx, gi, gs = ([t.to(dev) for t in g] for g in (gx, gi, gs))
    counts = out.counts.cpu().tolist()
    for el in range(L):
        e = a2a.rank * L + el
        rows, srows = [], []
        for s in range(W):
            tt, _ = (gi[s] == e).nonzero(as_tuple=True)
            rows.append(gx[s][tt])
            srows.append(gs[s][tt])
        want = torch.cat(rows)
        n = want.shape[0]
        assert counts[el] == n, f"expert {e}: {counts[el]} rows, expected {n}"
        got = out.x[el, :n].view(torch.uint8).reshape(n, row_bytes)
        assert torch.equal(got, want), f"expert {e}: rows differ"
        if ns:
            assert torch.equal(out.scales[el, :n], torch.cat(srows)[:, :ns]), f"expert {e}: scales differ"
