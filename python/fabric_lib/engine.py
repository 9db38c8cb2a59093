"""The TransferEngine: one-sided writes with immediates and small messages between processes.

Completion is learned by counting immediates (``ImmCounter``), never from order: no two
operations are ordered with respect to each other. Every ``submit_*`` returns a
``concurrent.futures.Future`` (usable from asyncio via ``asyncio.wrap_future``), or calls
``on_done(error_or_None)`` on the engine's callback thread when one is given.
"""

from __future__ import annotations

import array
import ctypes
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Literal, Sequence, overload

from . import _fork, _rust
from ._futures import EngineFuture, ExpectationFuture, guarded
from .errors import InvalidArgumentError
from .imm_counter import ImmCounter
from .topology import Topology, detect_topology

EngineAddress = _rust.EngineAddress
MrDescriptor = _rust.MrDescriptor
OnDone = Callable[[BaseException | None], None]

UvmWatcher = _rust.UvmWatcher
GpuFlag = _rust.GpuFlag

__all__ = [
    "Destination",
    "EngineAddress",
    "GpuFlag",
    "MemoryRegion",
    "MrDescriptor",
    "Peer",
    "Readmission",
    "StagingStats",
    "TransferEngine",
    "UvmWatcher",
]


@dataclass(frozen=True)
class Readmission:
    """What ``TransferEngine.readmit_peer`` found and did. True when the peer was fenced.

    ``counted`` maps each immediate value to how many requests of the epoch that ended (since
    the engine started or the last re-admission of that peer) the peer counted, including
    requests that timed out or were still in flight. The peer drops later deliveries of that
    epoch (its ``stale_immediates`` counts them), so a request whose immediate is not in
    ``counted`` never will be: resend exactly those and each immediate is counted once. Give
    requests distinct immediates to tell them apart. ``None`` when the peer was not fenced, or
    where the provider's CQ data cannot carry epochs (4 bytes: efa, verbs), so what landed is
    unknown.
    """

    fenced: bool
    counted: dict[int, int] | None

    def __bool__(self) -> bool:
        return self.fenced


@dataclass(frozen=True)
class StagingStats:
    """Staged traffic of an engine (``TransferEngine.staging_stats``)."""

    requests_sent: int
    """Staged requests this engine started as the writer."""
    bounced_bytes: int
    """Bytes copied from source regions into bounce buffers."""
    requests_landed: int
    """Staged requests that completed into this engine's regions (immediate counted)."""
    landed_bytes: int
    """Bytes copied from the landing area into destination regions."""


class MemoryRegion:
    """A local registration: its handle, its descriptor for peers, and what keeps it alive."""

    __slots__ = ("handle", "descriptor", "length", "registration", "_owner")

    def __init__(
        self, handle: int, descriptor: MrDescriptor, length: int, owner: Any, registration: str = "host"
    ) -> None:
        self.handle = handle
        self.descriptor = descriptor
        self.length = length
        #: How the memory reached the NIC: "host" (host memory), "dmabuf" or "cuda" (GPU memory
        #: registered through DMA-BUF or by address with the CUDA interface), "staged" (GPU memory
        #: the NIC cannot reach, which peers on other hosts reach through this engine's landing
        #: area) or "same-host" (CUDA IPC peers only).
        self.registration = registration
        self._owner = owner  # the tensor/buffer whose memory is registered

    def __repr__(self) -> str:
        return (
            f"MemoryRegion(handle={self.handle}, length={self.length}, kind={self.descriptor.kind}, "
            f"registration={self.registration})"
        )

    @property
    def kind(self) -> str:
        """The memory kind: "host" or "cuda:N"."""
        return self.descriptor.kind


#: Where a write goes: the peer region's descriptor, its ``to_bytes()``/``to_hex()`` form, or (for
#: an engine in the same process) the MemoryRegion itself.
Destination = MrDescriptor | MemoryRegion | bytes | str
#: A peer engine: its address or the address's ``to_bytes()``/``to_hex()`` form.
Peer = EngineAddress | bytes | str


def _as_descriptor(dst: Destination, name: str = "dst") -> MrDescriptor:
    """The peer region to write into (or read from): its descriptor, its bytes or hex, or (same
    process) the MemoryRegion itself."""
    if isinstance(dst, MrDescriptor):
        return dst
    if isinstance(dst, MemoryRegion):
        return dst.descriptor
    if isinstance(dst, str):
        return MrDescriptor.from_hex(dst)
    if isinstance(dst, (bytes, bytearray, memoryview)):
        return MrDescriptor.from_bytes(bytes(dst))
    raise InvalidArgumentError(
        f"{name} must be the peer region's MrDescriptor (region.descriptor, or its to_bytes()/to_hex() "
        f"form), not {_kind_of(dst)}"
    )


def _as_region(src: MemoryRegion, name: str = "src") -> MemoryRegion:
    """The local source region; a tensor or a descriptor here is a common mistake, named as such."""
    if isinstance(src, MemoryRegion):
        return src
    if hasattr(src, "data_ptr"):
        raise InvalidArgumentError(
            f"{name} must be a MemoryRegion, not a tensor: register it first "
            f"(region = engine.register_tensor(tensor)) and pass the region"
        )
    if isinstance(src, MrDescriptor):
        raise InvalidArgumentError(
            f"{name} must be a local MemoryRegion from this engine's register_tensor/register_memory; "
            "an MrDescriptor names a peer's region (the destination of a write, the source of a read)"
        )
    raise InvalidArgumentError(
        f"{name} must be a MemoryRegion (from register_tensor/register_memory), not {_kind_of(src)}"
    )


def _kind_of(value: object) -> str:
    return "a tensor" if hasattr(value, "data_ptr") else f"{type(value).__name__}"


def _as_address(peer: Peer) -> EngineAddress:
    if isinstance(peer, EngineAddress):
        return peer
    if isinstance(peer, str):
        return EngineAddress.from_hex(peer)
    if isinstance(peer, (bytes, bytearray, memoryview)):
        return EngineAddress.from_bytes(bytes(peer))
    raise InvalidArgumentError(
        f"peer must be an EngineAddress (engine.main_address, or its to_bytes()/to_hex() form), not {_kind_of(peer)}"
    )


def _check_imm(imm: int | None) -> None:
    if imm is not None and not 0 <= imm < 2**32:
        raise InvalidArgumentError(f"imm must fit in 32 bits, got {imm}")


def _check_non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise InvalidArgumentError(f"{name} must be non-negative, got {value}")


def _trigger(
    after_imm: tuple[int, int] | None, after_timeout: float | None
) -> tuple[int, int, float | None] | None:
    """The native trigger for ``after_imm=(imm, count)``, or None to post at once."""
    if after_imm is None:
        if after_timeout is not None:
            raise InvalidArgumentError("after_timeout needs after_imm=(imm, count)")
        return None
    try:
        imm, count = after_imm
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"after_imm must be an (imm, count) pair, not {after_imm!r}") from None
    _check_imm(imm)
    if not isinstance(count, int) or count < 1:
        raise InvalidArgumentError(f"after_imm count must be a positive int, got {count!r}")
    return (imm, count, after_timeout)


def _page_list(pages: Any) -> bytes:
    """Page indices as little-endian uint32 bytes (C-speed for lists, numpy arrays and tensors)."""
    if hasattr(pages, "__array__") or hasattr(pages, "numpy"):
        import numpy as np

        arr = np.asarray(pages.cpu() if hasattr(pages, "cpu") else pages)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise InvalidArgumentError("page indices must be a 1-D sequence of integers")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**32):
            raise InvalidArgumentError("page indices must be in [0, 2**32)")
        return arr.astype("<u4", copy=False).tobytes()
    try:
        return array.array("I", pages).tobytes()
    except (OverflowError, TypeError) as e:
        raise InvalidArgumentError(f"page indices must be integers in [0, 2**32): {e}") from None


def _native_on_done(on_done: OnDone | None) -> OnDone | None:
    """The native submit's callback: None (it then returns a ``Completion``, which the Future
    wraps) or the user's ``on_done``, guarded."""
    if on_done is None:
        return None
    if not callable(on_done):
        raise InvalidArgumentError(
            f"on_done must be callable (called with None or the error), not {_kind_of(on_done)}"
        )
    return guarded(on_done)


def _future(completion: _rust.Completion | None) -> Future[None] | None:
    """The Future a submit without ``on_done`` returns (None with one)."""
    return None if completion is None else EngineFuture(completion)


def _stop_native(native: Any, regions: dict[int, MemoryRegion]) -> None:
    """Stops a native engine; ``regions`` (the registered objects) stay referenced until then."""
    native.stop()
    regions.clear()


class TransferEngine:
    """Moves host memory to and from peer engines over a libfabric provider.

    Args:
        provider: libfabric provider ("tcp", "udp;ofi_rxd", "shm", "efa", "verbs;ofi_rxm");
            None picks an RDMA provider when present, else tcp on loopback.
        domain: domain (NIC/interface) name, e.g. "lo" or "eth0", or a list of them to aggregate
            several NICs (every peer must open the same number); None picks a default.

    Every other option is keyword-only; ``None`` (the default) keeps the engine's default, and
    ``fabric_lib.engine_defaults()`` lists them all (defaults in brackets):

        worker_cpu: CPU to pin the worker thread to, or "auto" for the first physical core of
            the host's NUMA node (from ``detect_topology()``) [not pinned].
        cuda_device: the GPU (CUDA device ordinal) this engine serves. The provider's own CUDA
            work (with FI_HMEM: shm's host registrations, device copies and CUDA IPC opens) runs
            in the worker thread's current CUDA context, which is this GPU's from the start;
            unset, it becomes the first GPU whose memory is registered, from that registration
            on (the provider may touch device 0 while it opens). Set it on multi-GPU hosts
            [the first registered GPU].
        poll_mode: "busy" (lowest latency, one core) or "adaptive" (spins, then sleeps when
            idle) ["busy"].
        transfer_timeout: seconds after which an unfinished request fails (dead peer) [30].
        command_timeout: seconds to wait for the worker to accept or answer a command [10].
        wait_spin: seconds that threads waiting on the engine (``ImmCounter.wait``,
            ``wait_imm_count``, the callback thread between callbacks) poll before they sleep:
            saves a wake-up (several µs) per round trip but takes a core while it polls
            [None: 50 µs where the process may use at least 4 CPUs, 0 with fewer].
        max_message_size: largest two-sided message in bytes; peers learn it from the address
            and senders check it [65536].
        recv_buffers / send_buffers: message buffers per domain [64 / 64].
        queue_depth: commands the worker's queue holds before submits wait [8192].
        shard_min_bytes: single writes at least this long are split over the NICs [262144].
        paged_copy_blocks: blocks (SMs) of the same-host paged-copy kernel (GPU memory) [16].
        uvm_watcher_cpu: CPU to pin the UVM watcher threads to [not pinned].
        write_completion: when a write's (or a message's) Future completes: "delivery" (the bytes are in the
            receiver's memory; a write the receiver refuses fails with TransferError),
            "transmit" (the source may be reused; only the receiver's immediate count says the
            bytes arrived) or "auto" (delivery on tcp and sockets, whose refusals are reported no
            other way, transmit elsewhere) ["auto"].
        gpu_network: ask for FI_HMEM and register GPU memory with the NIC, so peers on other
            hosts reach GPU regions directly. None: on RDMA providers (efa, verbs;ofi_rxm) only;
            True: also on software providers that offer it (shm of a CUDA-enabled libfabric)
            [None]. ``engine.gpu_network`` says whether it took effect.
        force_network: carry same-host transfers that involve GPU memory over the provider, as
            between two hosts, instead of CUDA IPC (tests and benchmarks) [False].
        gpu_registration: how GPU memory is registered with the NIC where the provider has
            FI_HMEM: "auto" (DMA-BUF where the running libfabric has it, 1.20 or newer, else or
            when refused by address with the CUDA interface), "dmabuf" or "cuda" (only that
            way; a refusal fails the registration) ["auto"]. ``region.registration`` says which.
        same_host_inbox_slots: entries of this engine's same-host immediate inbox, a power of
            two (0: none; same-host writers then announce immediates over the provider) [4096].
        same_host_host_memory: also carry host-to-host writes and ``submit_imm`` to engines
            of other processes on this host the same-host way:
            ``process_vm_writev`` (needs ptrace permission over the peer: same user and Yama
            ``ptrace_scope`` 0, or CAP_SYS_PTRACE) and the peer's inbox, not the provider
            [False].
        staging: move GPU memory across hosts through registered host memory where the provider
            has no FI_HMEM (tcp, udp;ofi_rxd): a GPU source is copied into pinned bounce buffers,
            a GPU destination receives into this engine's landing area and is copied into place
            by the worker; the immediate is counted once every byte is in GPU memory [True].
            False: GPU memory serves same-host peers only (``ProviderUnavailableError``).
        staging_chunk_bytes / staging_slots: the bounce buffers' and the landing area's size:
            ``staging_slots`` chunks of ``staging_chunk_bytes`` each (a multiple of 4096)
            [1 MiB / 32].
        stage_host_memory: testing aid: host memory takes the staged path too (copies by
            memcpy), to exercise staging without a GPU [False].

    Timeouts: a request not completed within ``transfer_timeout`` fails with
    ``FabricTimeoutError`` and its peer is *fenced*: later requests to it fail at once with
    ``PeerFencedError`` until ``readmit_peer(address)``. Whether a timed-out request landed (and
    its immediate was counted) is unknown at that point, so resending it blindly could count an
    immediate twice; ``readmit_peer`` returns what the peer counted (``Readmission``) and the
    peer drops what arrives later, so resending the requests missing there is safe.

    Out-of-range values raise ``InvalidArgumentError`` before anything is allocated. An engine
    that is garbage-collected without ``stop()`` stops itself first.

    GPU memory (``register_tensor`` of a CUDA tensor) is reached from the same host through CUDA
    IPC: writes where either side is GPU memory and the destination's engine runs on this host
    are copied by CUDA (copy engines for single writes, a 16-block kernel for paged writes); the
    immediate follows once the data is visible, through the destination engine's shared-memory
    inbox (over the provider where it has none or it cannot be opened). Across hosts, GPU memory is
    registered with the NIC where the provider has FI_HMEM (``gpu_network``), and staged through
    host memory otherwise (``staging``; docs/gpu.md); with both unavailable it raises
    ``ProviderUnavailableError`` saying so. CUDA is loaded on first GPU use only.
    """

    # The native engine, refused (EngineStoppedError) in a child forked after it was created.
    _native = _fork.ForkGuarded[_rust.TransferEngine]()

    def __init__(
        self,
        provider: str | None = None,
        domain: str | Sequence[str] | None = None,
        *,
        worker_cpu: int | Literal["auto"] | None = None,
        cuda_device: int | None = None,
        poll_mode: Literal["busy", "adaptive"] | None = None,
        transfer_timeout: float | None = None,
        command_timeout: float | None = None,
        wait_spin: float | None = None,
        max_message_size: int | None = None,
        recv_buffers: int | None = None,
        send_buffers: int | None = None,
        queue_depth: int | None = None,
        shard_min_bytes: int | None = None,
        paged_copy_blocks: int | None = None,
        uvm_watcher_cpu: int | None = None,
        write_completion: Literal["auto", "delivery", "transmit"] | None = None,
        gpu_network: bool | None = None,
        force_network: bool | None = None,
        gpu_registration: Literal["auto", "dmabuf", "cuda"] | None = None,
        same_host_inbox_slots: int | None = None,
        same_host_host_memory: bool | None = None,
        staging: bool | None = None,
        staging_chunk_bytes: int | None = None,
        staging_slots: int | None = None,
        stage_host_memory: bool | None = None,
    ) -> None:
        if isinstance(domain, str) or domain is None:
            domains = [] if domain is None else [domain]
        elif isinstance(domain, Sequence) and all(isinstance(d, str) for d in domain):
            domains = list(domain)
        else:
            raise InvalidArgumentError(f"domain must be a name or a sequence of names, got {domain!r}")
        if worker_cpu == "auto":
            cpus = detect_topology().device("host").cpus
            worker_cpu = cpus[0] if cpus else None
        options = {
            "worker_cpu": worker_cpu,
            "cuda_device": cuda_device,
            "poll_mode": poll_mode,
            "transfer_timeout": transfer_timeout,
            "command_timeout": command_timeout,
            "wait_spin": wait_spin,
            "max_message_size": max_message_size,
            "recv_buffers": recv_buffers,
            "send_buffers": send_buffers,
            "queue_depth": queue_depth,
            "shard_min_bytes": shard_min_bytes,
            "paged_copy_blocks": paged_copy_blocks,
            "uvm_watcher_cpu": uvm_watcher_cpu,
            "write_completion": write_completion,
            "gpu_network": gpu_network,
            "force_network": force_network,
            "gpu_registration": gpu_registration,
            "same_host_inbox_slots": same_host_inbox_slots,
            "same_host_host_memory": same_host_host_memory,
            "staging": staging,
            "staging_chunk_bytes": staging_chunk_bytes,
            "staging_slots": staging_slots,
            "stage_host_memory": stage_host_memory,
        }
        native = _rust.TransferEngine(
            provider, domains, **{k: v for k, v in options.items() if v is not None}
        )
        self._native = native
        self._regions: dict[int, MemoryRegion] = {}
        self._lock = threading.Lock()
        # An engine dropped without stop() stops itself; until then the finalizer holds the
        # registered objects, so no registration ever outlives the memory it covers (an
        # ImmCounter may keep the native engine alive longer, stopped).
        self._finalizer = weakref.finalize(self, _stop_native, native, self._regions)

    @staticmethod
    def detect_topology(overrides: dict[str, list[str]] | None = None) -> Topology:
        """GPUs, NICs, NUMA nodes and physical cores of this host (see ``fabric_lib.topology``)."""
        return detect_topology(overrides)

    # -- identity ---------------------------------------------------------------------------
    @property
    def main_address(self) -> EngineAddress:
        """This engine's address; send ``main_address.to_bytes()`` (or ``to_hex()``) to peers."""
        return self._native.main_address()

    @property
    def provider(self) -> str:
        """The provider in use, e.g. "tcp;ofi_rxm"."""
        return self._native.provider

    @property
    def domain_names(self) -> list[str]:
        """The domains (NICs or interfaces) in use, in order."""
        return self._native.domain_names

    @property
    def domain_name(self) -> str:
        """The first domain's name."""
        return self._native.domain_names[0]

    @property
    def num_domains(self) -> int:
        return len(self._native.domain_names)

    # -- memory -----------------------------------------------------------------------------
    def register_tensor(self, tensor: Any, *, remote_read: bool = False) -> MemoryRegion:
        """Registers a contiguous torch tensor (CPU or CUDA); the region keeps the tensor alive.

        A CUDA tensor must come from ``cudaMalloc``-backed memory (torch's default caching
        allocator; not ``expandable_segments``); it is reachable from engines on this host only.
        Peers may write the region; with ``remote_read=True`` they may also read it
        (``submit_read``).
        """
        if not hasattr(tensor, "data_ptr") or not hasattr(tensor, "is_contiguous"):
            raise InvalidArgumentError(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if not tensor.is_contiguous():
            raise InvalidArgumentError("tensor must be contiguous (call .contiguous() first)")
        if tensor.device.type == "cpu":
            device = -1
        elif tensor.device.type == "cuda":
            device = tensor.device.index if tensor.device.index is not None else 0
        else:
            raise InvalidArgumentError(
                f"tensor is on {tensor.device}; only CPU and CUDA tensors can be registered"
            )
        length = tensor.numel() * tensor.element_size()
        return self._register(tensor.data_ptr(), length, tensor, device, remote_read)

    def register_buffer(self, buffer: Any, *, remote_read: bool = False) -> MemoryRegion:
        """Registers host memory of any writable, contiguous Python buffer (``bytearray``,
        ``mmap``, a numpy array, ...); no torch needed. The region keeps the buffer alive, and the
        buffer cannot be resized while registered. Peers may write the region; with
        ``remote_read=True`` they may also read it (``submit_read``)."""
        try:
            view = memoryview(buffer)
        except TypeError:
            raise InvalidArgumentError(
                f"expected a writable buffer (bytearray, mmap, numpy array), not {_kind_of(buffer)}"
            ) from None
        if view.readonly:
            raise InvalidArgumentError("the buffer is read-only (bytes are immutable: use a bytearray)")
        if not view.c_contiguous:
            raise InvalidArgumentError("the buffer must be C-contiguous")
        if view.nbytes == 0:
            raise InvalidArgumentError("the buffer is empty")
        window = (ctypes.c_char * view.nbytes).from_buffer(view)  # pins the buffer's memory
        return self._register(ctypes.addressof(window), view.nbytes, (buffer, window), -1, remote_read)

    def register_memory(
        self,
        ptr: int,
        length: int,
        owner: Any = None,
        *,
        device: int | None = None,
        remote_read: bool = False,
    ) -> MemoryRegion:
        """Registers raw memory ``[ptr, ptr + length)``: host memory, or CUDA device memory
        (detected, or given as ``device``; -1 forces host).

        The memory must stay allocated until ``unregister_memory``; pass ``owner`` to have the
        region keep the owning object alive. Peers may write the region; with
        ``remote_read=True`` they may also read it (``submit_read``). Without it, its keys refuse
        reads in the provider and readers get ``RegionNotReadableError`` before posting.
        """
        if ptr < 0 or length < 0:
            raise InvalidArgumentError("ptr and length must be non-negative")
        return self._register(ptr, length, owner, device, remote_read)

    def _register(
        self, ptr: int, length: int, owner: Any, device: int | None = None, remote_read: bool = False
    ) -> MemoryRegion:
        handle, descriptor = self._native.register_memory(ptr, length, device, bool(remote_read))
        registration = self._native.region_registration(handle)
        if registration == "same-host" and descriptor.staged_reachable:
            registration = "staged"
        region = MemoryRegion(handle, descriptor, length, owner, registration)
        with self._lock:
            self._regions[handle] = region
        return region

    def unregister_memory(self, region: MemoryRegion | int) -> None:
        """Releases a registration (fails while writes from it are in flight)."""
        handle = region.handle if isinstance(region, MemoryRegion) else int(region)
        self._native.unregister_memory(handle)
        with self._lock:
            self._regions.pop(handle, None)

    # -- one-sided --------------------------------------------------------------------------
    @overload
    def submit_write(
        self,
        src: MemoryRegion,
        dst: Destination,
        length: int | None = None,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        domain: int | None = None,
        shard_domains: int | None = None,
        after_imm: tuple[int, int] | None = None,
        after_timeout: float | None = None,
        on_done: None = None,
    ) -> Future[None]: ...
    @overload
    def submit_write(
        self,
        src: MemoryRegion,
        dst: Destination,
        length: int | None = None,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        domain: int | None = None,
        shard_domains: int | None = None,
        after_imm: tuple[int, int] | None = None,
        after_timeout: float | None = None,
        on_done: OnDone,
    ) -> None: ...
    def submit_write(
        self,
        src: MemoryRegion,
        dst: Destination,
        length: int | None = None,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        domain: int | None = None,
        shard_domains: int | None = None,
        after_imm: tuple[int, int] | None = None,
        after_timeout: float | None = None,
        on_done: OnDone | None = None,
    ) -> Future[None] | None:
        """Writes ``length`` bytes (default: all of ``src`` after ``src_offset``) into the peer
        region ``dst`` at ``dst_offset``; with ``imm``, the peer counts the immediate exactly once,
        after the bytes are in place — however the write was sharded.

        The returned Future (or ``on_done``) completes when the *source* may be reused; only the
        receiver's immediate count says the bytes are visible at the destination.

        Large writes (≥ ``shard_min_bytes``) are sharded over up to ``shard_domains`` domains
        (default: all); ``domain`` pins the write to one domain instead.

        With ``after_imm=(imm, count)`` the write is checked now and posted later by the engine's
        worker itself, as soon as it has counted ``count`` arrivals of that immediate (arrivals
        so far included; they are consumed and never reach ``ImmCounter``): a forwarding proxy
        without a thread in between. ``after_timeout`` (seconds) fails it with
        ``FabricTimeoutError`` if the count is not reached in time, returning the consumed
        arrivals to the counter.
        """
        src = _as_region(src)
        if length is None:
            length = src.length - src_offset
        _check_imm(imm)
        _check_non_negative(length=length, src_offset=src_offset, dst_offset=dst_offset)
        after = _trigger(after_imm, after_timeout)
        callback = _native_on_done(on_done)
        native = self._native.submit_write if after is None else partial(self._native.arm_write, after)
        completion = native(
            src.handle,
            src_offset,
            length,
            _as_descriptor(dst),
            dst_offset,
            imm,
            callback,
            domain,
            2**63 if shard_domains is None else shard_domains,
        )
        return _future(completion)

    @overload
    def submit_paged_writes(
        self,
        page_len: int,
        src: MemoryRegion,
        src_pages: Sequence[int],
        dst: Destination,
        dst_pages: Sequence[int],
        *,
        src_stride: int | None = None,
        src_offset: int = 0,
        dst_stride: int | None = None,
        dst_offset: int = 0,
        imm: int | None = None,
        on_done: None = None,
    ) -> Future[None]: ...
    @overload
    def submit_paged_writes(
        self,
        page_len: int,
        src: MemoryRegion,
        src_pages: Sequence[int],
        dst: Destination,
        dst_pages: Sequence[int],
        *,
        src_stride: int | None = None,
        src_offset: int = 0,
        dst_stride: int | None = None,
        dst_offset: int = 0,
        imm: int | None = None,
        on_done: OnDone,
    ) -> None: ...
    def submit_paged_writes(
        self,
        page_len: int,
        src: MemoryRegion,
        src_pages: Sequence[int],
        dst: Destination,
        dst_pages: Sequence[int],
        *,
        src_stride: int | None = None,
        src_offset: int = 0,
        dst_stride: int | None = None,
        dst_offset: int = 0,
        imm: int | None = None,
        on_done: OnDone | None = None,
    ) -> Future[None] | None:
        """Copies page ``src_pages[i]`` of ``src`` to page ``dst_pages[i]`` of ``dst`` for every i.

        Page p of a side starts at ``p * stride + offset`` (stride defaults to ``page_len``).
        Pages are spread over every domain; every index is checked before anything is posted.
        ``imm`` arrives once at the receiver, after all pages.
        """
        _check_imm(imm)
        src = _as_region(src)
        _check_non_negative(page_len=page_len, src_offset=src_offset, dst_offset=dst_offset)
        callback = _native_on_done(on_done)
        completion = self._native.submit_paged_writes(
            page_len,
            src.handle,
            _page_list(src_pages),
            page_len if src_stride is None else src_stride,
            src_offset,
            _as_descriptor(dst),
            _page_list(dst_pages),
            page_len if dst_stride is None else dst_stride,
            dst_offset,
            imm,
            callback,
        )
        return _future(completion)

    @overload
    def submit_read(
        self,
        src: Destination,
        dst: MemoryRegion,
        length: int | None = None,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        domain: int | None = None,
        shard_domains: int | None = None,
        on_done: None = None,
    ) -> Future[None]: ...
    @overload
    def submit_read(
        self,
        src: Destination,
        dst: MemoryRegion,
        length: int | None = None,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        domain: int | None = None,
        shard_domains: int | None = None,
        on_done: OnDone,
    ) -> None: ...
    def submit_read(
        self,
        src: Destination,
        dst: MemoryRegion,
        length: int | None = None,
        *,
        src_offset: int = 0,
        dst_offset: int = 0,
        domain: int | None = None,
        shard_domains: int | None = None,
        on_done: OnDone | None = None,
    ) -> Future[None] | None:
        """Reads ``length`` bytes (default: enough to fill ``dst`` after ``dst_offset``) of the
        peer region ``src`` from ``src_offset`` into the local region ``dst`` at ``dst_offset``.

        The peer must have registered ``src`` with ``remote_read=True``
        (``RegionNotReadableError`` otherwise, before anything is posted). The returned Future
        (or ``on_done``) completes once the bytes are in ``dst``; no immediate is involved and
        the peer is not notified. Ranges are checked against both regions
        (``InvalidArgumentError``); timeouts and fencing apply as for writes. Large reads are
        sharded over domains like writes; ``domain`` pins one.
        """
        dst = _as_region(dst, "dst")
        if length is None:
            length = dst.length - dst_offset
        _check_non_negative(length=length, src_offset=src_offset, dst_offset=dst_offset)
        callback = _native_on_done(on_done)
        completion = self._native.submit_read(
            _as_descriptor(src, "src"),
            src_offset,
            length,
            dst.handle,
            dst_offset,
            callback,
            domain,
            2**63 if shard_domains is None else shard_domains,
        )
        return _future(completion)

    @overload
    def submit_paged_reads(
        self,
        page_len: int,
        src: Destination,
        src_pages: Sequence[int],
        dst: MemoryRegion,
        dst_pages: Sequence[int],
        *,
        src_stride: int | None = None,
        src_offset: int = 0,
        dst_stride: int | None = None,
        dst_offset: int = 0,
        on_done: None = None,
    ) -> Future[None]: ...
    @overload
    def submit_paged_reads(
        self,
        page_len: int,
        src: Destination,
        src_pages: Sequence[int],
        dst: MemoryRegion,
        dst_pages: Sequence[int],
        *,
        src_stride: int | None = None,
        src_offset: int = 0,
        dst_stride: int | None = None,
        dst_offset: int = 0,
        on_done: OnDone,
    ) -> None: ...
    def submit_paged_reads(
        self,
        page_len: int,
        src: Destination,
        src_pages: Sequence[int],
        dst: MemoryRegion,
        dst_pages: Sequence[int],
        *,
        src_stride: int | None = None,
        src_offset: int = 0,
        dst_stride: int | None = None,
        dst_offset: int = 0,
        on_done: OnDone | None = None,
    ) -> Future[None] | None:
        """Copies page ``src_pages[i]`` of the peer region ``src`` to page ``dst_pages[i]`` of
        the local region ``dst`` for every i (the mirror of ``submit_paged_writes``).

        Page p of a side starts at ``p * stride + offset`` (stride defaults to ``page_len``).
        Every index is checked before anything is posted; the peer must have registered ``src``
        with ``remote_read=True``. Completes once every page is in ``dst``.
        """
        dst = _as_region(dst, "dst")
        _check_non_negative(page_len=page_len, src_offset=src_offset, dst_offset=dst_offset)
        callback = _native_on_done(on_done)
        completion = self._native.submit_paged_reads(
            page_len,
            _as_descriptor(src, "src"),
            _page_list(src_pages),
            page_len if src_stride is None else src_stride,
            src_offset,
            dst.handle,
            _page_list(dst_pages),
            page_len if dst_stride is None else dst_stride,
            dst_offset,
            callback,
        )
        return _future(completion)

    def add_peer_group(self, peers: Sequence[Peer]) -> int:
        """Registers peer engines for ``submit_scatter``/``submit_barrier``; returns the group id."""
        return self._native.add_peer_group([_as_address(p) for p in peers])

    @overload
    def submit_scatter(
        self,
        src: MemoryRegion,
        targets: Sequence[tuple[int, int, Destination, int]],
        *,
        imm: int | None = None,
        group: int | None = None,
        shard_by: Literal["peer", "bytes"] = "peer",
        on_done: None = None,
    ) -> Future[None]: ...
    @overload
    def submit_scatter(
        self,
        src: MemoryRegion,
        targets: Sequence[tuple[int, int, Destination, int]],
        *,
        imm: int | None = None,
        group: int | None = None,
        shard_by: Literal["peer", "bytes"] = "peer",
        on_done: OnDone,
    ) -> None: ...
    def submit_scatter(
        self,
        src: MemoryRegion,
        targets: Sequence[tuple[int, int, Destination, int]],
        *,
        imm: int | None = None,
        group: int | None = None,
        shard_by: Literal["peer", "bytes"] = "peer",
        on_done: OnDone | None = None,
    ) -> Future[None] | None:
        """Writes ``(length, src_offset, dst, dst_offset)`` slices of ``src`` to several peers.

        Each target's receiver counts ``imm`` once per target, after that target's bytes are in
        place. ``shard_by="peer"`` puts each target on one domain (rotating); ``"bytes"`` shards
        each target over all domains. With ``group``, every target must belong to that peer group.
        GPU memory may be on either side: each target takes the path a single write of its slice
        would take (same-host copy, staged, or over the provider) and the Future completes once,
        after every target finished (docs/gpu.md, "Scatter").
        """
        _check_imm(imm)
        if shard_by not in ("peer", "bytes"):
            raise InvalidArgumentError(f"shard_by must be 'peer' or 'bytes', not {shard_by!r}")
        src = _as_region(src)
        native_targets = []
        for length, src_offset, dst, dst_offset in targets:
            _check_non_negative(length=length, src_offset=src_offset, dst_offset=dst_offset)
            native_targets.append((length, src_offset, _as_descriptor(dst), dst_offset))
        callback = _native_on_done(on_done)
        completion = self._native.submit_scatter(
            group, src.handle, native_targets, imm, shard_by == "bytes", callback
        )
        return _future(completion)

    @overload
    def submit_barrier(
        self,
        imm: int,
        group: int,
        *,
        on_done: None = None,
    ) -> Future[None]: ...
    @overload
    def submit_barrier(
        self,
        imm: int,
        group: int,
        *,
        on_done: OnDone,
    ) -> None: ...
    def submit_barrier(
        self,
        imm: int,
        group: int,
        *,
        on_done: OnDone | None = None,
    ) -> Future[None] | None:
        """Sends ``imm`` to every member of ``group``; each member counts it once."""
        _check_imm(imm)
        callback = _native_on_done(on_done)
        completion = self._native.submit_barrier(imm, group, callback)
        return _future(completion)

    @overload
    def submit_imm(
        self,
        imm: int,
        dst: Destination | EngineAddress,
        *,
        after_imm: tuple[int, int] | None = None,
        after_timeout: float | None = None,
        on_done: None = None,
    ) -> Future[None]: ...
    @overload
    def submit_imm(
        self,
        imm: int,
        dst: Destination | EngineAddress,
        *,
        after_imm: tuple[int, int] | None = None,
        after_timeout: float | None = None,
        on_done: OnDone,
    ) -> None: ...
    def submit_imm(
        self,
        imm: int,
        dst: Destination | EngineAddress,
        *,
        after_imm: tuple[int, int] | None = None,
        after_timeout: float | None = None,
        on_done: OnDone | None = None,
    ) -> Future[None] | None:
        """Sends only an immediate: a zero-byte write into ``dst``'s region, or into the peer
        engine's own immediate slot when ``dst`` is an EngineAddress. ``after_imm`` and
        ``after_timeout``: posted by the worker once an immediate count is reached, as for
        ``submit_write`` (an echo answering each ping: one ``submit_imm(pong, peer,
        after_imm=(ping, 1))`` per expected ping)."""
        if imm is None:
            raise InvalidArgumentError("imm is required")
        _check_imm(imm)
        after = None if after_imm is None and after_timeout is None else _trigger(after_imm, after_timeout)
        callback = None if on_done is None else _native_on_done(on_done)
        if isinstance(dst, EngineAddress):
            if after is None:
                completion = self._native.submit_imm_to(imm, dst, callback)
            else:
                completion = self._native.arm_imm_to(after, imm, dst, callback)
        elif after is None:
            completion = self._native.submit_imm(imm, _as_descriptor(dst), callback)
        else:
            completion = self._native.arm_imm(after, imm, _as_descriptor(dst), callback)
        return _future(completion)

    # -- two-sided --------------------------------------------------------------------------
    @overload
    def submit_send(
        self,
        peer: Peer,
        data: bytes,
        *,
        after_imm: tuple[int, int] | None = None,
        after_timeout: float | None = None,
        on_done: None = None,
    ) -> Future[None]: ...
    @overload
    def submit_send(
        self,
        peer: Peer,
        data: bytes,
        *,
        after_imm: tuple[int, int] | None = None,
        after_timeout: float | None = None,
        on_done: OnDone,
    ) -> None: ...
    def submit_send(
        self,
        peer: Peer,
        data: bytes,
        *,
        after_imm: tuple[int, int] | None = None,
        after_timeout: float | None = None,
        on_done: OnDone | None = None,
    ) -> Future[None] | None:
        """Sends a small message (≤ ``max_message_size`` bytes) to ``peer``'s receive callback.
        ``after_imm`` and ``after_timeout``: posted by the worker once an immediate count is
        reached, as for ``submit_write``."""
        after = _trigger(after_imm, after_timeout)
        callback = _native_on_done(on_done)
        if after is None:
            completion = self._native.submit_send(_as_address(peer), bytes(data), callback)
        else:
            completion = self._native.arm_send(after, _as_address(peer), bytes(data), callback)
        return _future(completion)

    def readmit_peer(self, peer: EngineAddress | bytes) -> Readmission:
        """Lifts the fence a timed-out request put on ``peer`` (nothing to do if there is none).

        On tcp, udp;ofi_rxd, shm and sockets this is a handshake bounded by ``transfer_timeout``:
        the peer stops counting this engine's immediates of the epoch that ended and reports what
        it counted under it (``Readmission.counted``). If the peer does not answer, this raises
        ``FabricTimeoutError`` and the peer stays fenced; call it again."""
        fenced, counted = self._native.readmit_peer(_as_address(peer))
        return Readmission(fenced, counted)

    @property
    def gpu_network(self) -> bool:
        """Whether GPU regions of this engine are registered with the NIC (FI_HMEM)."""
        return self._native.gpu_network

    @property
    def staging(self) -> bool:
        """Whether GPU memory the NIC cannot reach crosses hosts staged through host memory
        (staging on, provider without FI_HMEM): GPU descriptors then carry a landing area."""
        return self._native.staging

    @property
    def staging_stats(self) -> StagingStats:
        """What this engine moved staged: requests it wrote and bytes it bounced, requests and
        bytes that landed in its regions."""
        return StagingStats(*self._native.staging_stats)

    @property
    def refused_messages(self) -> int:
        """Messages refused for exceeding this engine's ``max_message_size`` (sent by peers that
        ignored the limit their address carries)."""
        return self._native.refused_messages

    @property
    def stale_immediates(self) -> int:
        """Immediates refused because a writer's epoch had ended: the writer timed out on its
        requests to this engine and re-admitted it before they were delivered. Never counted."""
        return self._native.stale_immediates

    def domain_stats(self) -> list[tuple[int, int]]:
        """Operations and bytes posted on each domain (NIC) since the engine started, in domain
        order, as ``(ops, bytes)``. Same-host copies and inbox immediates post nothing."""
        return self._native.domain_stats()

    @property
    def refused_immediates(self) -> int:
        """Entries of this engine's same-host inbox refused as malformed: a process of this host
        that can open the inbox wrote something no fabric-lib writer produces. Never counted."""
        return self._native.refused_immediates

    def set_recv_callback(self, callback: Callable[[bytes], None] | None) -> None:
        """Installs the callback receiving every message; messages that arrived earlier are
        delivered once it is set."""
        self._native.set_recv_callback(None if callback is None else guarded(callback))

    # -- GPU signalling ---------------------------------------------------------------------
    def alloc_uvm_watcher(
        self, callback: Callable[[int, int], None], device: int = 0, *, inline: bool = False
    ) -> UvmWatcher:
        """A 64-bit word in mapped pinned host memory that kernels (also inside CUDA graphs) write
        at ``watcher.ptr``; a polling thread per device calls ``callback(old, new)`` on the
        engine's callback thread after each change it sees (fast successive writes coalesce:
        ``new`` is the latest value). ``watcher.close()`` (or dropping it) stops watching.

        ``inline=True`` runs the callback on the polling thread itself: no hand-off to the
        callback thread (lower latency), but the device's other watchers wait while it runs,
        so keep it short."""
        return self._native.alloc_uvm_watcher(guarded(callback), device, inline)

    def alloc_gpu_flag(self, device: int = 0) -> GpuFlag:
        """A 64-bit flag kernels poll at ``flag.ptr``; ``flag.set(v)`` from the CPU, or let an
        immediate count set it (``set_imm_count_expected(..., flag=flag)``). Mapped pinned host
        memory (GDRCopy is not used)."""
        return self._native.alloc_gpu_flag(device)

    # -- immediates -------------------------------------------------------------------------
    def set_imm_count_expected(
        self,
        imm: int,
        count: int,
        on_reached: Callable[[], None] | None = None,
        *,
        flag: GpuFlag | None = None,
        flag_value: int = 1,
    ) -> None:
        """Calls ``on_reached()`` exactly once, when ``imm`` has arrived ``count`` times
        (arrivals before this call count); then those ``count`` arrivals are consumed.

        With ``flag``, the flag is set to ``flag_value`` when the count is reached (in Rust, no
        Python on that path), before ``on_reached`` runs (which is then optional)."""
        if flag is not None:
            cb = None if on_reached is None else guarded(on_reached)
            self._native.set_imm_count_expected_flag(imm, count, flag, flag_value, cb)
            return
        if on_reached is None:
            raise InvalidArgumentError("set_imm_count_expected needs on_reached or flag")
        self._native.set_imm_count_expected(imm, count, guarded(on_reached))

    def expect_imm_count(self, imm: int, count: int) -> Future[None]:
        """Future form of ``set_imm_count_expected``. ``cancel()`` on the Future (also through
        ``asyncio.wrap_future`` when the awaiting task is cancelled) removes the expectation."""
        native = self._native
        return ExpectationFuture(native.expect_imm_count(imm, count), lambda: native.remove_imm_count(imm))

    def remove_imm_count(self, imm: int) -> int:
        """Cancels the expectation on ``imm`` (it will not fire) and returns its current count."""
        return self._native.remove_imm_count(imm)

    def imm_counter(self, imm: int) -> ImmCounter:
        """A waitable counter for ``imm`` (no callbacks needed)."""
        return ImmCounter(self._native, imm)

    def set_imm_callback(self, callback: Callable[[int], None] | None) -> None:
        """Receives immediates that no expectation or counter claims."""
        self._native.set_imm_callback(None if callback is None else guarded(callback))

    # -- diagnostics ------------------------------------------------------------------------
    def enable_latency_probe(self, on: bool = True) -> None:
        """Turns the latency probe on (clearing its marks) or off. While on, the engine records
        when the latest request passed each stage; see ``latency_marks``. Off by default (then it
        costs nothing measurable)."""
        self._native.enable_latency_probe(bool(on))

    def latency_marks(self) -> dict[str, int]:
        """The latency probe's latest time of each stage it recorded since it was enabled, in
        ``time.monotonic_ns()`` nanoseconds: ``enqueued`` (the submit planned the request and
        hands it to the worker's queue), ``dequeued`` (the worker took it), ``posted`` (its first post to the
        provider returned), ``completed`` (the worker saw it finish), ``callback_run`` (its
        completion callback started), ``imm_seen`` (the worker read an arriving immediate),
        ``imm_counted`` (it applies it to the counters) and ``wait_returned`` (a wait on a count
        returned in the native layer). Each stage keeps its latest event only: meaningful with
        one request in flight at a time (a latency test). Stamp the application's own call with
        ``time.monotonic_ns()`` to compare."""
        return self._native.latency_marks()

    # -- lifecycle --------------------------------------------------------------------------
    def stop(self) -> None:
        """Stops the engine: in-flight requests fail with EngineStoppedError. Idempotent; a no-op
        in a forked child (the engine belongs to the parent and is unusable there)."""
        if _fork.inherited(self):
            return
        self._finalizer()

    def _after_fork_in_child(self) -> None:
        """Called in a forked child: the parent's engine must never be stopped from here."""
        self._finalizer.detach()

    @property
    def stopped(self) -> bool:
        return self._native.stopped

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
