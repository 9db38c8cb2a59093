"""GPU-side layer triggers: a kernel (also inside a CUDA graph) stores to a UVM watcher after
each layer, and the watcher's callback hands the layers to the current forward pass.

The word counts layers monotonically over passes: pass ``k`` (``arm`` returns its base ``b``)
stores ``b + layer + 1`` after ``layer``; ``values(pass)`` gives those numbers so a captured
graph can copy them from a device tensor refreshed before each replay. Stores that the watcher
sees coalesced (``new`` jumps by several) release every layer up to ``new``.
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import InvalidArgumentError
from .sender import ForwardPass, KvSender


class LayerTrigger:
    def __init__(self, sender: KvSender, device: int = 0) -> None:
        self._sender = sender
        self._lock = threading.Lock()
        self._pass: ForwardPass | None = None
        self._base = 0
        self._next_base = 0
        self.watcher = sender.engine.alloc_uvm_watcher(self._changed, device)

    @property
    def ptr(self) -> int:
        """Device address of the 64-bit word kernels store to."""
        return int(self.watcher.ptr)

    def arm(self, fwd: ForwardPass) -> int:
        """Makes ``fwd`` the pass the next stores belong to; returns its base value."""
        with self._lock:
            if self._pass is not None and self._pass.layers_done < self._sender.layout.num_layers:
                raise InvalidArgumentError("the previous forward pass has not reported every layer yet")
            self._pass, self._base = fwd, self._next_base
            self._next_base += self._sender.layout.num_layers
            return self._base

    def values(self) -> list[int]:
        """The word's value after each layer of the armed pass."""
        with self._lock:
            return [self._base + i + 1 for i in range(self._sender.layout.num_layers)]

    def _changed(self, old: int, new: int) -> None:
        with self._lock:
            fwd, base = self._pass, self._base
        if fwd is None:
            return
        last = min(new - base, self._sender.layout.num_layers)
        for layer in range(fwd.layers_done, last):
            fwd.layer_ready(layer)

    def close(self) -> None:
        self.watcher.close()

    def __enter__(self) -> LayerTrigger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
