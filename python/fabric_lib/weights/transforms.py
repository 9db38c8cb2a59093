"""What a trainer does to a unit's data before writing it: gather (FSDP unshard), slice and pack
(the fuse and TP re-split: each slice lands at its part's offset in the fused destination), and
FP8 block quantization. Pure torch; the same code runs on CPU and GPU tensors."""

from __future__ import annotations

from typing import Any

from .errors import ScheduleError
from .layout import Box, box_numel, box_shape

#: Largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: Smallest block maximum used for a scale, so an all-zero block gets a finite scale.
AMAX_FLOOR = 1e-12


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def slice_box(tensor: Any, unit_box: Box, box: Box) -> Any:
    """The view of ``box`` (global coordinates) in ``tensor``, which holds ``unit_box``."""
    return tensor[tuple(slice(lo - ulo, hi - ulo) for (lo, hi), (ulo, _) in zip(box, unit_box, strict=True))]


def quantize_fp8_blocks(x: Any, block: tuple[int, int]) -> tuple[Any, Any]:
    """Block FP8 quantization over the last two dimensions.

    For every ``block[0] x block[1]`` block (partial at the ends): ``scale = max(amax, 1e-12) /
    448`` in fp32 and ``q = clamp(x / scale, -448, 448)`` as float8_e4m3fn, so ``q * scale``
    dequantizes; both divisions are IEEE divisions, so CPU and GPU give the same bytes. Returns ``(q, scales)``, scales of shape ``[..., ceil(R/b0), ceil(C/b1)]``."""
    import torch

    if x.dim() < 2:
        raise ScheduleError(f"FP8 block quantization needs at least 2 dimensions, got {list(x.shape)}")
    b0, b1 = block
    *lead, rows, cols = x.shape
    rb, cb = -(-rows // b0), -(-cols // b1)
    xf = x.float()
    if rows % b0 or cols % b1:
        xf = torch.nn.functional.pad(xf, (0, cb * b1 - cols, 0, rb * b0 - rows))
    blocks = xf.reshape(*lead, rb, b0, cb, b1)
    amax = blocks.abs().amax(dim=(-3, -1))
    # A tensor divisor: a Python float would make CUDA multiply by its rounded reciprocal while
    # the CPU divides, and the scales (so every quantized byte) would differ by device.
    scales = amax.clamp(min=AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)
    q = (blocks / scales[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, rb * b0, cb * b1)[..., :rows, :cols]
    return q, scales


def gather_unit(local: Any, kind: str, box: Box, group_size: int, padded: int, pg: Any) -> Any:
    """All-gathers a unit held FSDP-style by ``group_size`` ranks (``pg``): ``kind`` "fsdp"
    (rows of dimension 0, each rank ``padded`` rows) or "flat" (``padded`` elements of the
    flattened box each). Returns the whole box as a tensor of its shape."""
    import torch

    shape = box_shape(box)
    if kind == "flat":
        flat = local.reshape(-1)
        if flat.numel() < padded:
            flat = torch.nn.functional.pad(flat, (0, padded - flat.numel()))
        inp = flat[:padded].contiguous()
        out = torch.empty(padded * group_size, dtype=local.dtype, device=local.device)
        _all_gather(out, inp, pg)
        return out[: box_numel(box)].view(shape)
    rows = local.shape[0]
    inp = local
    if rows < padded:
        inp = torch.cat([local, local.new_zeros((padded - rows, *local.shape[1:]))])
    inp = inp.contiguous()
    out = torch.empty((padded * group_size, *shape[1:]), dtype=local.dtype, device=local.device)
    _all_gather(out, inp, pg)
    return out[: shape[0]]


def _all_gather(out: Any, inp: Any, pg: Any) -> None:
    import torch.distributed as dist

    if inp.is_cuda and dist.get_backend(pg) == "gloo":  # gloo gathers host memory: stage through it
        host = out.cpu()
        dist.all_gather_into_tensor(host, inp.cpu(), group=pg)
        out.copy_(host)
        return
    dist.all_gather_into_tensor(out, inp, group=pg)
