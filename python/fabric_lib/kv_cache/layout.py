"""The shape of a paged KV cache as a serving engine keeps it, per layer and per TP rank.

Three layouts (one tensor per layer, blocks outermost):

- ``"nhd"`` (vLLM/FlashInfer style): ``[num_blocks, 2, block_size, heads, head_dim]``.
- ``"hnd"`` (heads first): ``[num_blocks, 2, heads, block_size, head_dim]``; a contiguous head
  range of a TP shard is one contiguous run per K/V half of a page.
- ``"mla"``: ``[num_blocks, block_size, head_dim]``, one latent vector per token (``head_dim``
  is the latent width), replicated on every TP rank.

``heads`` above is the per-rank count ``num_kv_heads // tp_size`` (MLA: no heads).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from ..errors import InvalidArgumentError

LayoutKind = Literal["nhd", "hnd", "mla"]

# Element sizes of the dtypes a KV cache uses, by torch's name (fp8 where torch has it).
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


@dataclass(frozen=True)
class KvLayout:
    """A model's paged KV cache: ``num_kv_heads`` is the model's total (global) count.

    ``dtype`` is a torch dtype name ("bfloat16", "float8_e4m3fn", ...). Both sides of a
    transfer must agree on everything here; only their TP sizes may differ.
    """

    kind: LayoutKind
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.kind not in ("nhd", "hnd", "mla"):
            raise InvalidArgumentError(f"layout kind must be 'nhd', 'hnd' or 'mla', not {self.kind!r}")
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgumentError(f"unsupported KV dtype {self.dtype!r}; one of {sorted(DTYPE_SIZES)}")
        for name in ("num_layers", "block_size", "head_dim"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kind == "mla":
            if self.num_kv_heads != 1:
                raise InvalidArgumentError("an MLA layout has one latent per token: num_kv_heads must be 1")
        elif self.num_kv_heads < 1:
            raise InvalidArgumentError(f"num_kv_heads must be at least 1, got {self.num_kv_heads}")

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def heads_per_rank(self, tp_size: int) -> int:
        """KV heads a rank of a ``tp_size`` instance holds (MLA: 1, the replicated latent)."""
        check_tp(tp_size, 0)
        if self.kind == "mla":
            return 1
        if self.num_kv_heads % tp_size:
            raise InvalidArgumentError(f"{self.num_kv_heads} KV heads do not divide evenly over TP {tp_size}")
        return self.num_kv_heads // tp_size

    def head_range(self, tp_size: int, tp_rank: int) -> tuple[int, int]:
        """The global heads ``[lo, hi)`` that rank ``tp_rank`` holds."""
        check_tp(tp_size, tp_rank)
        if self.kind == "mla":
            return (0, 1)
        h = self.heads_per_rank(tp_size)
        return (tp_rank * h, (tp_rank + 1) * h)

    def block_shape(self, tp_size: int) -> tuple[int, ...]:
        """Shape of one block (page) of one layer on one rank."""
        h = self.heads_per_rank(tp_size)
        if self.kind == "nhd":
            return (2, self.block_size, h, self.head_dim)
        if self.kind == "hnd":
            return (2, h, self.block_size, self.head_dim)
        return (self.block_size, self.head_dim)

    def layer_shape(self, num_blocks: int, tp_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor on one rank."""
        return (num_blocks, *self.block_shape(tp_size))

    def page_bytes(self, tp_size: int) -> int:
        n = self.itemsize
        for d in self.block_shape(tp_size):
            n *= d
        return n

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KvLayout:
        try:
            return KvLayout(**d)
        except TypeError as e:
            raise InvalidArgumentError(f"bad layout description {d!r}: {e}") from None


def check_tp(tp_size: int, tp_rank: int) -> None:
    if tp_size < 1:
        raise InvalidArgumentError(f"tp_size must be at least 1, got {tp_size}")
    if not 0 <= tp_rank < tp_size:
        raise InvalidArgumentError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}")
