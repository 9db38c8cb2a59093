"""End to end with a real model: a transformers Llama (random weights from a small config, no
downloads) prefills a prompt in chunks in one process, streaming each layer's K/V pages as the
layer finishes; a decoder process rebuilds its DynamicCache from the received pages and decodes.
Its logits for every step equal those of the same model decoding from its own cache in the
prefill process (same dtype, CPU, one thread each)."""

from __future__ import annotations

import random
from typing import Literal

import pytest

pytest.importorskip("transformers")

from fabric_lib.kv_cache import KvLayout

from .nodes import NodeState, decode_model, prefill_model, spawn_node

CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
STEPS = 6


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind,dtype", [("nhd", "float32"), ("hnd", "bfloat16")])
def test_disaggregated_decode_matches_local_decode(kind: Literal["nhd", "hnd"], dtype: str) -> None:
    config = {**CONFIG, "dtype": dtype}
    layout = KvLayout(
        kind, CONFIG["num_hidden_layers"], 4, CONFIG["num_key_value_heads"], CONFIG["head_dim"], dtype
    )
    rng = random.Random(7)
    prompt = [rng.randrange(CONFIG["vocab_size"]) for _ in range(45)]
    nb = layout.blocks_for(len(prompt))
    p_blocks, d_blocks = rng.sample(range(48), nb), rng.sample(range(64), nb)
    spec = {"tp_size": 1, "tp_rank": 0, "layout": layout.to_dict()}
    p = spawn_node(
        "prefill",
        [
            {
                **spec,
                "name": "p",
                "role": "prefill",
                "instance": "p",
                "seed": 0,
                "kw": {"chunk_tokens": 16, "context_bytes": 4096},
            }
        ],
    )
    d = None
    try:
        d = spawn_node(
            "decode",
            [{**spec, "name": "d", "role": "decode", "instance": "d", "kw": {"context_bytes": 4096}}],
        )
        d.call(NodeState.connect, name="d", addresses=list(p.addresses.values()))
        ctx = CONFIG["vocab_size"] * layout.itemsize
        d.call(
            NodeState.request,
            name="d",
            rid="m",
            instance="p",
            blocks=d_blocks,
            num_tokens=len(prompt),
            ctx=ctx,
        )
        ref = p.call(
            prefill_model,
            timeout=120,
            name="p",
            rid="m",
            config=config,
            seed=3,
            prompt=prompt,
            chunk=16,
            blocks=p_blocks,
            steps=STEPS,
        )

        def decode(blocks: list[int]) -> dict:
            return d.call(
                decode_model,
                timeout=120,
                name="d",
                rid="m",
                config=config,
                seed=3,
                n=len(prompt),
                blocks=blocks,
                steps=STEPS,
            )

        got = decode(d_blocks)
        assert got["first"] == ref["first"], "the context (last prompt logits) differs"
        assert len(got["steps"]) == STEPS
        for i, (a, b) in enumerate(zip(got["steps"], ref["steps"], strict=True)):
            assert a == b, f"decode step {i}: logits differ from the local decode"
        # control: the same decode from blocks that received nothing gives other logits
        empty = [b for b in range(64) if b not in d_blocks][:nb]
        blind = decode(empty)
        assert blind["steps"][0] != ref["steps"][0]
    finally:
        for n in (d, p):
            if n is not None:
                n.close()
