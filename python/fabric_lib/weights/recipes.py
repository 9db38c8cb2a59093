"""Ready descriptions for Llama/Qwen-style dense transformers: Hugging Face names on the trainer,
vLLM-style fused names and TP layout on the inference side.

Trainer names (``model.named_parameters()`` of LlamaForCausalLM, Qwen2/Qwen3ForCausalLM):
``q_proj``/``k_proj``/``v_proj`` become one ``qkv_proj`` (each rank: ``[q_r; k_r; v_r]``),
``gate_proj``/``up_proj`` one ``gate_up_proj``; ``o_proj`` and ``down_proj`` are split along
their input dimension (row-parallel), embeddings and ``lm_head`` along the vocabulary, biases of
column-parallel layers with their weights, everything else (norms) replicated.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from .errors import ScheduleError
from .layout import FP8, Placement, SourceParam, TargetParam, grouped, source, target

_FUSED = {
    r"(.*)\.self_attn\.([qkv])_proj\.(weight|bias)$": "{0}.self_attn.qkv_proj.{2}",
    r"(.*)\.mlp\.(gate|up)_proj\.(weight)$": "{0}.mlp.gate_up_proj.{2}",
}
_ORDER = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}
_ROW_PARALLEL = re.compile(r".*\.(o_proj|down_proj)\.weight$")
_VOCAB = re.compile(r"(^|.*\.)(embed_tokens|lm_head)\.weight$")


def dense_transformer(
    named_shapes: Mapping[str, Sequence[int]],
    *,
    trainer_placement: Callable[[str, tuple[int, ...]], Placement],
    inference_groups: Sequence[Sequence[int]],
    dtype: str = "bfloat16",
    fp8: bool = False,
    block: tuple[int, int] = (128, 128),
) -> tuple[list[SourceParam], list[TargetParam]]:
    """Trainer and inference descriptions of a dense transformer.

    ``named_shapes``: the trainer's parameter names and global shapes, in model order.
    ``trainer_placement(name, shape)``: how the trainers hold each (e.g. ``flat_sharded``).
    ``inference_groups``: one rank list per inference instance (its TP group); every instance
    receives the whole model. ``fp8``: linear-layer weights become block-quantized FP8 with
    fp32 scales (embeddings, norms and biases stay ``dtype``).
    """
    groups = [tuple(g) for g in inference_groups]
    tp = {len(g) for g in groups}
    if len(tp) != 1:
        raise ScheduleError("every inference instance must have the same TP size")
    sources = [source(n, s, dtype, trainer_placement(n, tuple(s))) for n, s in named_shapes.items()]
    shard0 = grouped(groups, outer_dim=None, inner="shard", dim=0)
    shard1 = grouped(groups, outer_dim=None, inner="shard", dim=1)
    everywhere = grouped(groups, outer_dim=None, inner="replicate")
    fused: dict[str, list[tuple[int, str]]] = {}
    targets: list[TargetParam] = []
    seen: set[str] = set()
    for name in named_shapes:
        for pattern, fmt in _FUSED.items():
            m = re.match(pattern, name)
            if m:
                fused_name = fmt.format(*m.groups())
                fused.setdefault(fused_name, []).append((_ORDER[m.group(2)], name))
                if fused_name not in seen:
                    seen.add(fused_name)
                    targets.append(_placeholder(fused_name))
                break
        else:
            shape = tuple(named_shapes[name])
            is_linear = len(shape) == 2 and not _VOCAB.match(name)
            quant = FP8 if fp8 and is_linear else dtype
            if _ROW_PARALLEL.match(name):
                targets.append(target(name, name, shard1, dtype=quant, block=block))
            elif _VOCAB.match(name):
                targets.append(target(name, name, shard0))
            elif is_linear:
                targets.append(target(name, name, shard0, dtype=quant, block=block))
            else:
                targets.append(target(name, name, everywhere))
    out = []
    for t in targets:
        if t.name in fused:
            parts = tuple(n for _, n in sorted(fused[t.name]))
            quant = FP8 if fp8 and t.name.endswith(".weight") else dtype
            out.append(target(t.name, parts, shard0, dtype=quant, block=block))
        else:
            out.append(t)
    return sources, out


def _placeholder(name: str) -> TargetParam:
    """Keeps a fused target's place in model order until all its parts are known."""
    return TargetParam(name, ("?",), grouped([[0]], outer_dim=None, inner="replicate"))
