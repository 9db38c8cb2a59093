"""How a serving engine's KV connector sits on fabric_lib.kv_cache: every hook of the worker-side
interface of a vLLM-style connector (KVConnectorBase_V1) is a line or two.

| connector hook | fabric_lib.kv_cache |
|---|---|
| register_kv_caches(caches) | KvSender / KvReceiver over the per-layer tensors (+ connect) |
| bind_connector_metadata(meta) | prefill: ``begin_forward`` with the tokens this step computes |
| start_load_kv (decode) | ``KvReceiver.request`` for each new request (decoder asked first) |
| wait_for_layer_load (decode) | ``RecvRequest.wait_for_layer`` (a ``layerwise`` receiver) |
| save_kv_layer (prefill) | ``ForwardPass.layer_ready(layer)`` (pages go out now) |
| wait_for_save (prefill) | ``ForwardPass.wait`` |
| get_finished | ``KvSender.finished()`` / ``KvReceiver.finished()`` |

Run: ``python examples/kv_connector_sketch.py`` (CPU, tcp, one process with two engines). It
prefills two requests in chunks with a stand-in "model" that writes each layer's KV into the
paged cache, streams them through the connector, and checks the decoder's pages byte for byte.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import fabric_lib
import torch
from fabric_lib.kv_cache import ForwardPass, KvLayout, KvReceiver, KvSender


@dataclass
class StepMetadata:
    """What the scheduler hands the workers each step (the connector metadata)."""

    prefill_progress: dict[str, int] = field(default_factory=dict)  # rid -> tokens done after this step
    new_prefill: dict[str, tuple[list[int], int]] = field(default_factory=dict)  # rid -> (blocks, tokens)
    new_loads: dict[str, tuple[str, list[int], int]] = field(
        default_factory=dict
    )  # rid -> (instance, blocks, tokens)


class FabricKvConnector:
    """The worker side of a KV connector for one rank (``role``: "prefill" or "decode")."""

    def __init__(
        self, role: str, engine: fabric_lib.TransferEngine, layout: KvLayout, instance: str, **kw: Any
    ) -> None:
        self.role, self.engine, self.layout, self.instance, self.kw = role, engine, layout, instance, kw
        self.endpoint: KvSender | KvReceiver | None = None
        self._layer_index: dict[str, int] = {}
        self._fwd: ForwardPass | None = None
        self._loads: dict[str, Any] = {}  # decode: requests whose layers this step waits for

    # -- hooks -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        cls = KvSender if self.role == "prefill" else KvReceiver
        self.endpoint = cls(
            self.engine, self.layout, list(kv_caches.values()), instance=self.instance, **self.kw
        )

    def bind_connector_metadata(self, meta: StepMetadata) -> None:
        if isinstance(self.endpoint, KvSender):
            for rid, (blocks, tokens) in meta.new_prefill.items():
                self.endpoint.add_request(rid, blocks, tokens)
            self._fwd = self.endpoint.begin_forward(meta.prefill_progress) if meta.prefill_progress else None

    def start_load_kv(self, meta: StepMetadata) -> None:
        if isinstance(self.endpoint, KvReceiver):
            self._loads = {
                rid: self.endpoint.request(rid, instance, blocks, tokens)
                for rid, (instance, blocks, tokens) in meta.new_loads.items()
            }

    def wait_for_layer_load(self, layer_name: str, timeout: float = 30.0) -> None:
        """Layer-wise loading: returns once this layer of every request being loaded landed,
        so the decoder's forward pass can run a layer while later ones are in flight."""
        for req in self._loads.values():
            req.wait_for_layer(self._layer_index[layer_name], timeout)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        if self._fwd is not None:
            self._fwd.layer_ready(self._layer_index[layer_name])

    def wait_for_save(self, timeout: float = 30.0) -> None:
        if self._fwd is not None:
            self._fwd.wait(timeout)
            self._fwd = None

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving); failures would be reported to the scheduler
        too (the error is in the dict ``finished()`` returns)."""
        assert self.endpoint is not None
        done = self.endpoint.finished()
        return (set(done), set()) if self.role == "prefill" else (set(), set(done))

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()


def main() -> None:
    layout = KvLayout("nhd", num_layers=4, block_size=16, num_kv_heads=4, head_dim=32, dtype="bfloat16")
    prompts = {"req-a": 100, "req-b": 37}
    chunk = 48
    with (
        fabric_lib.TransferEngine("tcp", poll_mode="adaptive", transfer_timeout=20.0) as pe,
        fabric_lib.TransferEngine("tcp", poll_mode="adaptive", transfer_timeout=20.0) as de,
    ):
        p_caches = {
            f"layer.{i}": torch.zeros(layout.layer_shape(64, 1), dtype=torch.bfloat16) for i in range(4)
        }
        d_caches = {
            f"layer.{i}": torch.zeros(layout.layer_shape(64, 1), dtype=torch.bfloat16) for i in range(4)
        }
        prefill = FabricKvConnector("prefill", pe, layout, "prefill-0", chunk_tokens=chunk)
        decode = FabricKvConnector("decode", de, layout, "decode-0", layerwise=True)
        prefill.register_kv_caches(p_caches)
        decode.register_kv_caches(d_caches)
        assert isinstance(decode.endpoint, KvReceiver)
        decode.endpoint.connect(pe.main_address)

        # the decoder is asked first: it allocates blocks and starts the loads
        p_blocks = {"req-a": list(range(0, 7)), "req-b": list(range(10, 13))}
        d_blocks = {"req-a": list(range(40, 47)), "req-b": list(range(20, 23))}
        decode.start_load_kv(
            StepMetadata(new_loads={r: ("prefill-0", d_blocks[r], n) for r, n in prompts.items()})
        )

        # chunked prefill: each step computes up to `chunk` more tokens of each prompt
        done = dict.fromkeys(prompts, 0)
        new = {r: (p_blocks[r], n) for r, n in prompts.items()}
        torch.manual_seed(0)
        while any(done[r] < n for r, n in prompts.items()):
            progress = {r: min(n, done[r] + chunk) for r, n in prompts.items() if done[r] < n}
            prefill.bind_connector_metadata(StepMetadata(prefill_progress=progress, new_prefill=new))
            new = {}
            for name, cache in p_caches.items():  # the stand-in model: each layer writes its KV
                for r, end in progress.items():
                    for t in range(done[r], end):
                        b, o = p_blocks[r][t // layout.block_size], t % layout.block_size
                        cache[b, :, o] = torch.randn(2, 4, 32).to(torch.bfloat16)
                prefill.save_kv_layer(name, cache)
            prefill.wait_for_save()
            done.update(progress)

        # the decoder's forward pass loads layer by layer
        for name in d_caches:
            decode.wait_for_layer_load(name)
            for r, n in prompts.items():
                nb = layout.blocks_for(n)
                assert torch.equal(d_caches[name][d_blocks[r][:nb]], p_caches[name][p_blocks[r][:nb]])

        # get_finished reports each request once all of it landed (the blocks are the decoder's)
        received: set[str] = set()
        deadline = time.monotonic() + 30
        while received != set(prompts) and time.monotonic() < deadline:
            received |= decode.get_finished()[1]
            time.sleep(0.01)
        sent: set[str] = set()
        while sent != set(prompts) and time.monotonic() < deadline:
            sent |= prefill.get_finished()[0]
            time.sleep(0.01)
        assert received == set(prompts) and sent == set(prompts), (received, sent)
        for r, n in prompts.items():
            nb = layout.blocks_for(n)
            for name in p_caches:
                got, want = d_caches[name][d_blocks[r][:nb]], p_caches[name][p_blocks[r][:nb]]
                assert torch.equal(got, want), f"{r} {name}: pages differ"
        prefill.close()
        decode.close()
    print(
        f"kv connector sketch: {len(prompts)} requests, {layout.num_layers} layers, chunks of {chunk}: pages equal"
    )


if __name__ == "__main__":
    main()
