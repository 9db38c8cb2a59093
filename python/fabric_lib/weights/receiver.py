"""The inference side: registers its parameters once, publishes a manifest, and learns that an
update is complete by counting immediates. No other code runs here during an update.

Every write of update ``version`` carries the immediate ``imm_base + (version & 0xFFFF)``; the
schedule says how many writes reach this rank, so the version is complete exactly when that many
were counted (each immediate is counted after its bytes are in place). A version that does not
complete in time leaves the weights possibly half-written: ``intact`` turns False until a later
version completes, and ``wait_for_update`` raises ``UpdateIncompleteError``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ..engine import TransferEngine
from ..errors import FabricError, FabricTimeoutError, InvalidArgumentError
from .errors import UpdateIncompleteError
from .manifest import Manifest, TensorEntry
from .schedule import Schedule

#: Default immediate range of updates: ``imm_base + (version & 0xFFFF)``.
DEFAULT_IMM_BASE = 0x57000000
VERSION_MASK = 0xFFFF


def update_imm(imm_base: int, version: int) -> int:
    return imm_base + (version & VERSION_MASK)


class WeightReceiver:
    """One inference rank's parameters, registered with ``engine``.

    Args:
        engine: this rank's TransferEngine (its immediates ``imm_base .. imm_base + 0xFFFF`` are
            this receiver's).
        params: name -> contiguous tensor (CPU or CUDA), every tensor the schedule writes on
            this rank (FP8 weights and their scale tensors included).
        rank: this rank's index among the inference ranks of the schedule.
    """

    def __init__(
        self,
        engine: TransferEngine,
        params: Mapping[str, Any],
        rank: int,
        *,
        imm_base: int = DEFAULT_IMM_BASE,
    ) -> None:
        if rank < 0:
            raise InvalidArgumentError(f"rank must be non-negative, got {rank}")
        if not 0 <= imm_base <= 2**32 - 1 - VERSION_MASK:
            raise InvalidArgumentError(f"imm_base {imm_base:#x} leaves no room for 65536 versions")
        self.engine = engine
        self.rank = rank
        self.imm_base = imm_base
        self.params = dict(params)
        self._regions = {name: engine.register_tensor(t) for name, t in self.params.items()}
        self._expected: int | None = None
        self._lock = threading.Lock()
        #: The last version that arrived completely.
        self.version: int | None = None
        #: False after an update failed to complete (weights may be half-written) until a later
        #: version completes.
        self.intact = True
        self._failed: int | None = None

    def manifest(self) -> bytes:
        """What the trainers need to write here (send it to the controller)."""
        tensors = {
            name: TensorEntry(
                tuple(t.shape), str(t.dtype).removeprefix("torch."), self._regions[name].descriptor
            )
            for name, t in self.params.items()
        }
        return Manifest(self.rank, self.engine.main_address, tensors).to_bytes()

    def set_schedule(self, schedule: Schedule | str | bytes) -> None:
        """Learns how many writes reach this rank per update; checks the registered tensors
        against what the schedule writes (``ScheduleError`` on a mismatch)."""
        sched = schedule if isinstance(schedule, Schedule) else Schedule.from_json(schedule)
        Manifest.from_bytes(self.manifest()).check_against(sched.tensors_of(self.rank))
        self._expected = sched.submissions_to(self.rank)

    @property
    def expected_writes(self) -> int:
        if self._expected is None:
            raise InvalidArgumentError("call set_schedule(schedule) before waiting for updates")
        return self._expected

    def wait_for_update(self, version: int, timeout: float) -> None:
        """Returns once every write of ``version`` is in place. Raises ``UpdateIncompleteError``
        (a ``FabricTimeoutError``) when they are not all there within ``timeout`` seconds; the
        weights are then not intact (``self.intact`` is False) until a later version completes.
        A failed version number must not be reused: trainers retry with a new one."""
        expected = self.expected_writes
        with self._lock:
            if self.version is not None and version <= self.version:
                if version == self.version:
                    return
                raise InvalidArgumentError(
                    f"version {version} is older than the current version {self.version}"
                )
            if self._failed is not None and version <= self._failed:
                raise InvalidArgumentError(
                    f"version {version} failed or is older than one that failed ({self._failed}); "
                    "updates must be retried under a new version"
                )
        imm = update_imm(self.imm_base, version)
        counter = self.engine.imm_counter(imm)
        try:
            counter.wait(expected, timeout)
        except FabricTimeoutError:
            received = counter.value
            with self._lock:
                self.intact = False
                self._failed = max(version, self._failed or version)
            try:  # late arrivals of this version must not count towards a later use of the slot
                self.engine.remove_imm_count(imm)
            except FabricError:
                pass
            raise UpdateIncompleteError(
                f"update {version}: {received} of {expected} writes arrived within {timeout:g}s on inference "
                f"rank {self.rank}; the weights may be partially overwritten",
                version=version,
                received=received,
                expected=expected,
            ) from None
        finally:
            counter.close()
        self._settle_devices()
        with self._lock:
            self.version = version
            self.intact = True

    def _settle_devices(self) -> None:
        """GPU parameters: waits for copies the provider queued on this process's devices (shm's
        CUDA IPC path counts the immediate before its copy finished; docs/gpu.md)."""
        devices = {t.device for t in self.params.values() if getattr(t.device, "type", "cpu") == "cuda"}
        if devices:
            import torch

            for device in devices:
                torch.cuda.synchronize(device)

    def close(self) -> None:
        """Unregisters the parameters (no update may be in flight)."""
        for region in self._regions.values():
            try:
                self.engine.unregister_memory(region)
            except FabricError:
                pass
        self._regions.clear()
