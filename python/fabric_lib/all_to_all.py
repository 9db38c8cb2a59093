"""MoE expert-parallel all-to-all (dispatch / combine): NVLink inside a node, RDMA between nodes.

One :class:`AllToAll` per expert-parallel group, created collectively by every rank of a
``torch.distributed`` group (it exchanges CUDA IPC handles through ``all_gather_object``). Then, on
every rank and in the same order::

    out = a2a.dispatch(x, indices, scales=scales)        # tokens -> experts
    y = run_experts(out.x, out.scales, out.counts)         # [local_experts, max_tokens_per_expert, hidden]
    tokens = a2a.combine(y, indices, weights)              # experts -> tokens, weighted sum of k

Kernels run on torch's current stream without synchronizing with the host: calls can be
captured in CUDA graphs and replayed (pass ``num_tokens`` as a device tensor for a live count).
``do_send`` / ``do_recv`` split each call in two halves so that other work can run between them.

Experts are placed contiguously: rank ``r`` hosts experts ``[r * L, (r + 1) * L)`` with
``L = num_experts // world_size``. Rows of one local expert in dispatch's output are ordered by
source rank, then token, then top-k slot. ``indices`` may hold ``-1`` for "no expert".

Errors found on the host (dtype, shape, device, sizes) raise :class:`InvalidArgumentError` before
anything is launched. Errors only the kernels can see (an expert index out of range, a device
token count above the rows given, more rows for one expert than ``max_tokens_per_expert``, a peer
that never answers) are recorded by the kernels and raised by the next call on this object or by
:meth:`AllToAll.check` (which synchronizes). ``validate=True`` checks expert indices on the host
before each dispatch (one synchronization; skipped during graph capture).

Ranks are grouped into NVLink domains of ``nvlink`` consecutive ranks (default: the whole group,
which must then be on one host with peer-to-peer access). Ranks of other domains are reached
through this rank's TransferEngine (``nets_per_gpu`` NICs) by a CPU proxy, run by the engine's
worker thread, that follows the kernels; the call sequence is the same (docs/all_to_all_rdma.md). A group has at most 64 ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist

from . import _rust
from .errors import CudaUnavailableError, FabricError, FabricTimeoutError, InvalidArgumentError

__all__ = [
    "ERR_BAD_EXPERT",
    "ERR_BAD_NUM_TOKENS",
    "ERR_CALL_ORDER",
    "ERR_EXPERT_OVERFLOW",
    "ERR_PROXY",
    "ERR_TIMEOUT",
    "AllToAll",
    "DispatchOutput",
]

#: Error bits reported by the kernels (see :meth:`AllToAll.errors`).
ERR_TIMEOUT = 1 << 0
ERR_BAD_EXPERT = 1 << 1
ERR_BAD_NUM_TOKENS = 1 << 2
ERR_EXPERT_OVERFLOW = 1 << 3
ERR_CALL_ORDER = 1 << 4
ERR_PROXY = 1 << 5

SCALE_BLOCK = 128

_DTYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8_e4m3"}

# The raw handle of a device's current stream, what a launch needs: `torch.cuda.current_stream()`
# costs about 5 µs per call (it resolves the device in Python), this about 0.2.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class DispatchOutput(NamedTuple):
    """What :meth:`AllToAll.dispatch` returns (grouped-GEMM ready)."""

    x: torch.Tensor
    """``[local_experts, max_tokens_per_expert, hidden]`` tokens, rows past ``counts[e]`` undefined."""
    scales: torch.Tensor | None
    """``[local_experts, max_tokens_per_expert, hidden // 128]`` fp32 scales (fp8 dispatch), else None."""
    counts: torch.Tensor
    """``[local_experts]`` int32: rows received by each local expert."""


# The halves' arguments as the native class reads them, by attribute name (device pointers and
# strides in bytes; 0 for an absent tensor). One object per half, shared by the separate and the
# fused calls.


@dataclass(frozen=True, slots=True)
class DispatchSendArgs:
    x: int
    x_stride: int
    scales: int
    scales_stride: int
    indices: int
    indices_stride: int  # in elements
    indices_are_i64: bool
    num_tokens: int  # rows of x (the kernel reads the live count from num_tokens_ptr when set)
    num_tokens_ptr: int
    publish_host_counts: bool


@dataclass(frozen=True, slots=True)
class DispatchRecvArgs:
    out_x: int
    out_scales: int
    out_counts: int


@dataclass(frozen=True, slots=True)
class CombineSendArgs:
    expert_out: int
    expert_out_stride: int
    weights: int
    weights_stride: int  # in elements


@dataclass(frozen=True, slots=True)
class CombineRecvArgs:
    out: int
    out_stride: int
    num_rows: int


def _fail(msg: str) -> InvalidArgumentError:
    return InvalidArgumentError(msg)


class AllToAll:
    """Dispatch/combine for one expert-parallel group; create it on every rank of ``group``.

    Args:
        group: the ``torch.distributed`` group of expert-parallel ranks (default: the world).
            Used once, to exchange buffer handles.
        max_num_tokens: most tokens a rank dispatches per call.
        hidden: values per token (a multiple of 128 for fp8).
        num_experts: experts in total (a multiple of the group size, at most 1024).
        experts_per_token: top-k (at most 32).
        dispatch_dtype: ``torch.bfloat16`` or ``torch.float8_e4m3fn`` (fp32 scale per 128 values).
        combine_dtype: ``torch.bfloat16`` (the only one supported).
        max_tokens_per_expert: rows per local expert in dispatch's output (default
            ``world_size * max_num_tokens``, enough for any routing without repeated experts).
        device: the CUDA device (default: the current one).
        timeout: seconds a kernel waits for a peer before it reports a timeout.
        validate: check expert indices on the host before every dispatch (synchronizes).
        publish_host_counts: have dispatch write per-expert counts to host memory
            (:meth:`host_counts`; the hook of a future RDMA proxy).
        fused: run both halves of a call as one kernel when both are asked for (False: the two
            halves' kernels back to back, as with ``do_send`` / ``do_recv``). Default: fused when
            every rank is over NVLink; with remote ranks the halves (measured a few percent
            faster there, docs/all_to_all_rdma.md).
        nvlink: ranks per NVLink domain (consecutive ranks; divides the group size). Default: the
            group size (every rank over NVLink: no engine, no proxy). ``1``: every peer through
            the engine.
        nets_per_gpu: NICs (engine domains) per GPU that carry remote traffic; without
            ``domains`` the ``nets_per_gpu`` NICs nearest the GPU (``detect_topology``).
        private_tokens: records per (source, destination) pair written speculatively into the
            destination's private area before every rank's counts are known (default
            ``max_num_tokens``: one write per remote rank); the rest goes in a second write to
            the destination's overflow area.
        provider: libfabric provider of the engine (default: an RDMA NIC's, else ``tcp``).
        domains: explicit engine domains (NICs or interfaces), overriding ``nets_per_gpu``.
        proxy_cpu: CPU for the proxy's thread; ``"auto"``: a core of the GPU's NUMA node (by rank).
        proxy: which thread runs the proxy. ``"worker"`` (default): the engine's worker, between
            its polls of the provider; the thread that sees a kernel's signal posts the writes
            itself. ``"thread"``: a thread of its own that hands every post to the worker (one
            more spinning thread per rank; slower to post, docs/all_to_all_rdma.md).
        engine_options: further :class:`fabric_lib.TransferEngine` options by name (e.g.
            ``{"gpu_network": True}`` for ``shm`` of a CUDA-enabled libfabric: GPU buffers).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        max_num_tokens: int,
        hidden: int,
        num_experts: int,
        experts_per_token: int,
        dispatch_dtype: torch.dtype = torch.float8_e4m3fn,
        combine_dtype: torch.dtype = torch.bfloat16,
        max_tokens_per_expert: int | None = None,
        device: torch.device | int | None = None,
        timeout: float = 10.0,
        validate: bool = False,
        publish_host_counts: bool = False,
        fused: bool | None = None,
        nvlink: int | None = None,
        nets_per_gpu: int = 1,
        private_tokens: int | None = None,
        provider: str | None = None,
        domains: Sequence[str] | None = None,
        proxy_cpu: int | Literal["auto"] | None = "auto",
        engine_options: Mapping[str, Any] | None = None,
        proxy: Literal["worker", "thread"] = "worker",
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise _fail("AllToAll needs an initialized torch.distributed process group")
        if not torch.cuda.is_available():
            raise CudaUnavailableError("AllToAll needs a CUDA GPU (torch.cuda.is_available() is False)")
        if dispatch_dtype not in _DTYPES:
            raise _fail(f"dispatch_dtype must be torch.bfloat16 or torch.float8_e4m3fn, not {dispatch_dtype}")
        if combine_dtype != torch.bfloat16:
            raise _fail(f"combine_dtype must be torch.bfloat16, not {combine_dtype}")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.type != "cuda" or self.device.index is None:
            raise _fail(f"device must be a CUDA device with an index, not {device}")
        for name, value in [
            ("max_num_tokens", max_num_tokens),
            ("hidden", hidden),
            ("num_experts", num_experts),
            ("experts_per_token", experts_per_token),
        ]:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise _fail(f"{name} must be a positive int, not {value!r}")
        if max_tokens_per_expert is None:
            max_tokens_per_expert = self.world_size * max_num_tokens
        self.max_num_tokens = max_num_tokens
        self.hidden = hidden
        self.num_experts = num_experts
        self.experts_per_token = experts_per_token
        self.local_experts = num_experts // self.world_size if num_experts % self.world_size == 0 else 0
        self.max_tokens_per_expert = max_tokens_per_expert
        self.dispatch_dtype = dispatch_dtype
        self.combine_dtype = combine_dtype
        self.num_scales = hidden // SCALE_BLOCK if dispatch_dtype == torch.float8_e4m3fn else 0
        self.validate = validate
        self.publish_host_counts = publish_host_counts
        if nvlink is None:
            nvlink = self.world_size
        if fused is not None and not isinstance(fused, bool):
            raise _fail(f"fused={fused!r} must be True, False or None")
        if not isinstance(nvlink, int) or nvlink < 1 or self.world_size % nvlink:
            raise _fail(f"nvlink={nvlink!r} must be a positive int dividing the group size {self.world_size}")
        if private_tokens is None:
            private_tokens = max_num_tokens
        if not isinstance(private_tokens, int) or not 0 <= private_tokens <= max_num_tokens:
            raise _fail(f"private_tokens={private_tokens!r} must be an int in [0, max_num_tokens]")
        if proxy not in ("worker", "thread"):
            raise _fail(f"proxy={proxy!r} must be 'worker' or 'thread'")
        if not isinstance(nets_per_gpu, int) or nets_per_gpu < 1:
            raise _fail(f"nets_per_gpu={nets_per_gpu!r} must be a positive int")
        self.nvlink = nvlink
        remote = nvlink < self.world_size
        self.fused = not remote if fused is None else fused
        domain_list: list[str] = list(domains) if domains is not None else []
        cpu: int | None = None
        if remote:
            if domains is None and nets_per_gpu > 1:
                nics = self._gpu_topology().nics
                if len(nics) < nets_per_gpu:
                    raise _fail(
                        f"nets_per_gpu={nets_per_gpu}: only {len(nics)} NICs near {self.device} ({nics}); "
                        "pass domains= explicitly"
                    )
                domain_list = nics[:nets_per_gpu]
            if proxy_cpu == "auto":
                cpus = self._gpu_topology().cpus
                cpu = cpus[self.rank % len(cpus)] if cpus else None
            elif proxy_cpu is not None:
                cpu = int(proxy_cpu)
        self._native = _rust.AllToAll(
            self.device.index,
            self.rank,
            self.world_size,
            max_num_tokens,
            hidden,
            num_experts,
            experts_per_token,
            max_tokens_per_expert,
            _DTYPES[dispatch_dtype],
            float(timeout),
            nvlink,
            private_tokens,
            provider,
            domain_list,
            cpu,
            dict(engine_options or {}),
            proxy == "thread",
        )
        # shm with FI_HMEM queues its device copies on the legacy default stream: the proxy waits
        # for an event recorded there before raising a flag, so the kernels must not run on it.
        self._side_stream_only = bool(self._native.remote_gpu_buffers) and (provider or "").startswith("shm")
        handles: list[Any] = [None] * self.world_size
        dist.all_gather_object(handles, self._native.export_handle(), group=self.group)
        self._native.connect(handles)
        # connect() set up this rank's paths to its remote ranks; the barrier makes sure every
        # rank's did before any call (RemotePath::warm_up says why).
        if self._native.remote_gpu_buffers is not None:
            dist.barrier(group=self.group)
        self._last_rows: int | None = None  # rows of x in the last dispatch send

    def _gpu_topology(self) -> Any:
        from .topology import detect_topology

        try:
            return detect_topology().device(f"cuda:{self.device.index}")
        except KeyError:
            return detect_topology().device("host")

    @property
    def remote_gpu_buffers(self) -> bool | None:
        """Whether remote traffic uses GPU buffers registered with the NIC (FI_HMEM) rather than
        mapped pinned host memory; None when every rank is over NVLink."""
        v = self._native.remote_gpu_buffers
        return None if v is None else bool(v)

    def proxy_stats(self) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
        """The proxy's costs of the calls since the last read, as it recorded them (nanoseconds):
        per dispatch ``counts_signal_to_first_write_ns`` (counts published → first count message
        posted), ``signal_to_first_write_ns`` (records packed → first data write posted),
        ``post_per_peer_ns``, ``data_writes``, ``count_writes``, ``remote_peers``, ``total_ns``;
        per combine ``signal_to_first_write_ns``, ``post_per_peer_ns``, ``writes``,
        ``remote_peers``. Empty without remote ranks."""
        d, c = self._native.proxy_samples()
        return [dict(x) for x in d], [dict(x) for x in c]

    # ----------------------------------------------------------------------------------- errors

    def errors(self) -> int:
        """Error bits the kernels reported so far (``ERR_*``), without synchronizing."""
        return int(self._native.errors())

    def _raise_errors(self) -> None:
        bits = self.errors()
        if not bits:
            return
        if bits & ERR_TIMEOUT:
            raise FabricTimeoutError(
                "all-to-all: a kernel timed out waiting for a peer (a rank missed a call, died, or "
                "called in another order); this AllToAll is unusable, create a new one"
            )
        if bits & ERR_PROXY:
            why = self._native.proxy_error() or "unknown"
            cls = (
                FabricTimeoutError if "timed out" in why.lower() or "timeout" in why.lower() else FabricError
            )
            raise cls(f"all-to-all: the proxy for remote ranks failed ({why}); this AllToAll is unusable")
        self._native.clear_errors()
        what = []
        if bits & ERR_BAD_EXPERT:
            what.append(f"an expert index was outside [-1, {self.num_experts}) (those slots were skipped)")
        if bits & ERR_BAD_NUM_TOKENS:
            what.append("the device token count was negative or above the rows of x (all rows were used)")
        if bits & ERR_EXPERT_OVERFLOW:
            what.append(
                f"a local expert received more than max_tokens_per_expert={self.max_tokens_per_expert} rows "
                "(the extra rows were dropped)"
            )
        if bits & ERR_CALL_ORDER:
            what.append(
                "a send half (do_recv=False) ran again before the receive half of the previous call "
                "(results of that call are undefined)"
            )
        raise InvalidArgumentError("all-to-all: an earlier call had bad input: " + "; ".join(what))

    def check(self) -> None:
        """Waits for this device's work, then raises what the kernels reported (if anything)."""
        torch.cuda.synchronize(self.device)
        self._raise_errors()

    def host_counts(self) -> tuple[int, list[int]]:
        """(dispatch sequence number, rows this rank sent to each expert) of the last dispatch
        with ``publish_host_counts`` (read from host memory; valid once that dispatch ran)."""
        seq, counts = self._native.host_counts()
        return int(seq), list(counts)

    # --------------------------------------------------------------------------------- checking

    def _tensor(self, name: str, t: Any, dtypes: tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise _fail(f"{name} must be a torch.Tensor, not {type(t).__name__}")
        if t.device != self.device:
            raise _fail(f"{name} is on {t.device}; this AllToAll is on {self.device}")
        if t.dtype not in dtypes:
            raise _fail(f"{name} must have dtype {' or '.join(map(str, dtypes))}, not {t.dtype}")
        if t.dim() != ndim:
            raise _fail(f"{name} must have {ndim} dimensions, not shape {tuple(t.shape)}")
        if t.numel() and t.stride(-1) != 1:
            raise _fail(f"{name} must be contiguous in its last dimension (stride {t.stride()})")
        return t

    def _stream(self) -> int:
        if _raw_stream is not None:
            stream = int(_raw_stream(self.device.index))
        else:
            stream = int(torch.cuda.current_stream(self.device).cuda_stream)
        if stream == 0 and self._side_stream_only:
            raise _fail(
                "with provider 'shm' and GPU buffers the calls must run on a non-default stream "
                "(torch.cuda.stream(torch.cuda.Stream())): shm copies on the legacy default stream"
            )
        return stream

    # --------------------------------------------------------------------------------- dispatch

    def dispatch(
        self,
        x: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
        *,
        scales: torch.Tensor | None = None,
        num_tokens: torch.Tensor | None = None,
        do_send: bool = True,
        do_recv: bool = True,
    ) -> DispatchOutput | None:
        """Sends each token to the ranks of its experts; returns the expert-major layout.

        Args:
            x: ``[T, hidden]`` tokens of ``dispatch_dtype`` (``T <= max_num_tokens``).
            indices: ``[T, experts_per_token]`` int32/int64 expert ids (-1: no expert).
            scales: ``[T, hidden // 128]`` fp32 (fp8 dispatch only).
            num_tokens: optional device int32 tensor of one element: the live token count
                (``<= T``), read by the kernel (graph-friendly).
            do_send / do_recv: run only one half (both by default). The send half needs
                ``x``/``indices``; the receive half returns the output.
        """
        if not (do_send or do_recv):
            raise _fail("dispatch with do_send=False and do_recv=False does nothing")
        self._raise_errors()
        send_args = self._dispatch_send_args(x, indices, scales, num_tokens) if do_send else None
        if not do_recv:
            assert send_args is not None
            self._native.dispatch_send(self._stream(), send_args)
            self._last_rows = send_args.num_tokens
            return None
        L, M, H = self.local_experts, self.max_tokens_per_expert, self.hidden
        out_x = torch.empty((L, M, H), dtype=self.dispatch_dtype, device=self.device)
        out_scales = (
            torch.empty((L, M, self.num_scales), dtype=torch.float32, device=self.device)
            if self.num_scales
            else None
        )
        counts = torch.empty((L,), dtype=torch.int32, device=self.device)
        recv_args = DispatchRecvArgs(
            out_x=out_x.data_ptr(),
            out_scales=out_scales.data_ptr() if out_scales is not None else 0,
            out_counts=counts.data_ptr(),
        )
        if send_args is None:
            self._native.dispatch_recv(self._stream(), recv_args)
        elif self.fused:
            self._native.dispatch(self._stream(), send_args, recv_args)
            self._last_rows = send_args.num_tokens
        else:
            self._native.dispatch_send(self._stream(), send_args)
            self._last_rows = send_args.num_tokens
            self._native.dispatch_recv(self._stream(), recv_args)
        return DispatchOutput(out_x, out_scales, counts)

    def _dispatch_send_args(
        self,
        x: torch.Tensor | None,
        indices: torch.Tensor | None,
        scales: torch.Tensor | None,
        num_tokens: torch.Tensor | None,
    ) -> DispatchSendArgs:
        """Checks the send half's inputs; returns the native send half's arguments."""
        if x is None or indices is None:
            raise _fail("dispatch's send half needs x and indices")
        x = self._tensor("x", x, (self.dispatch_dtype,), 2)
        indices = self._tensor("indices", indices, (torch.int32, torch.int64), 2)
        T = x.shape[0]
        if x.shape[1] != self.hidden:
            raise _fail(f"x has {x.shape[1]} values per token; this AllToAll has hidden={self.hidden}")
        if T > self.max_num_tokens:
            raise _fail(
                f"x has {T} tokens; this AllToAll allows at most max_num_tokens={self.max_num_tokens}"
            )
        if tuple(indices.shape) != (T, self.experts_per_token):
            raise _fail(
                f"indices must have shape ({T}, {self.experts_per_token}), not {tuple(indices.shape)}"
            )
        elem = x.element_size()
        if T and ((x.data_ptr() % 16) or (x.stride(0) * elem) % 16):
            raise _fail("x rows must start on 16-byte boundaries (use a contiguous tensor)")
        scales_ptr, scales_stride = 0, 0
        if self.num_scales:
            if scales is None:
                raise _fail("fp8 dispatch needs scales [T, hidden // 128] (fp32)")
            scales = self._tensor("scales", scales, (torch.float32,), 2)
            if tuple(scales.shape) != (T, self.num_scales):
                raise _fail(f"scales must have shape ({T}, {self.num_scales}), not {tuple(scales.shape)}")
            scales_ptr, scales_stride = scales.data_ptr(), scales.stride(0) * 4
        elif scales is not None:
            raise _fail("scales are only for fp8 dispatch (this AllToAll dispatches bf16)")
        nt_ptr = 0
        if num_tokens is not None:
            if not isinstance(num_tokens, torch.Tensor):
                raise _fail(f"num_tokens must be a device int32 tensor, not {type(num_tokens).__name__}")
            if num_tokens.device != self.device or num_tokens.dtype != torch.int32 or num_tokens.numel() != 1:
                raise _fail(
                    f"num_tokens must be one int32 on {self.device}, not {num_tokens.dtype} "
                    f"{tuple(num_tokens.shape)} on {num_tokens.device}"
                )
            nt_ptr = num_tokens.data_ptr()
        if self.validate and T and not torch.cuda.is_current_stream_capturing():
            lo, hi = torch.stack([indices.min(), indices.max()]).tolist()
            if lo < -1 or hi >= self.num_experts:
                raise _fail(
                    f"expert indices must be in [-1, {self.num_experts}); found values in [{lo}, {hi}]"
                )
        return DispatchSendArgs(
            x=x.data_ptr() if T else 0,
            x_stride=x.stride(0) * elem if T else 0,
            scales=scales_ptr if T else 0,
            scales_stride=scales_stride if T else 0,
            indices=indices.data_ptr() if T else 0,
            indices_stride=indices.stride(0) if T else 0,
            indices_are_i64=indices.dtype == torch.int64,
            num_tokens=T,
            num_tokens_ptr=nt_ptr,
            publish_host_counts=self.publish_host_counts,
        )

    # ---------------------------------------------------------------------------------- combine

    def combine(
        self,
        expert_out: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        *,
        out: torch.Tensor | None = None,
        do_send: bool = True,
        do_recv: bool = True,
    ) -> torch.Tensor | None:
        """Brings the expert outputs back: ``out[t] = sum_j weights[t, j] * y(expert j of t)``.

        The weighted sum is accumulated in fp32 (per rank on the expert side, then across ranks
        on this side) and returned in bf16.

        Args:
            expert_out: ``[local_experts, max_tokens_per_expert, hidden]`` bf16, rows as dispatch
                produced them (the send half).
            indices: this rank's ``[T, experts_per_token]`` indices of the matching dispatch
                (checked for shape; the routing itself is remembered from dispatch).
            weights: ``[T, experts_per_token]`` routing weights (fp32; other float dtypes are
                converted) of this rank's tokens (the send half publishes them to the experts).
            out: optional ``[T, hidden]`` bf16 output (the receive half).
            do_send / do_recv: run only one half (both by default).
        """
        if not (do_send or do_recv):
            raise _fail("combine with do_send=False and do_recv=False does nothing")
        if self._last_rows is None:
            raise _fail("combine before any dispatch")
        self._raise_errors()
        T = self._last_rows
        if indices is not None:
            indices = self._tensor("indices", indices, (torch.int32, torch.int64), 2)
            if tuple(indices.shape) != (T, self.experts_per_token):
                raise _fail(
                    f"indices must have shape ({T}, {self.experts_per_token}) like dispatch's, not {tuple(indices.shape)}"
                )
        if do_send:
            if expert_out is None or weights is None:
                raise _fail("combine's send half needs expert_out and weights")
            expert_out = self._tensor("expert_out", expert_out, (torch.bfloat16,), 3)
            L, M, H = self.local_experts, self.max_tokens_per_expert, self.hidden
            if tuple(expert_out.shape) != (L, M, H):
                raise _fail(f"expert_out must have shape ({L}, {M}, {H}), not {tuple(expert_out.shape)}")
            row = expert_out.stride(1)
            if expert_out.stride(0) != M * row or (row * 2) % 16 or expert_out.data_ptr() % 16:
                raise _fail(
                    "expert_out rows must be evenly strided and 16-byte aligned (use a contiguous tensor)"
                )
            if not isinstance(weights, torch.Tensor):
                raise _fail(f"weights must be a torch.Tensor, not {type(weights).__name__}")
            if weights.dtype != torch.float32 and weights.is_floating_point():
                weights = weights.float()
            weights = self._tensor("weights", weights, (torch.float32,), 2)
            if tuple(weights.shape) != (T, self.experts_per_token):
                raise _fail(
                    f"weights must have shape ({T}, {self.experts_per_token}), not {tuple(weights.shape)}"
                )
            # An empty weights tensor may have a null pointer: give the kernel a valid one.
            w = (
                weights
                if T
                else torch.empty((1, self.experts_per_token), dtype=torch.float32, device=self.device)
            )
            send_args = CombineSendArgs(
                expert_out=expert_out.data_ptr(),
                expert_out_stride=row * 2,
                weights=w.data_ptr(),
                weights_stride=w.stride(0),
            )
            if not do_recv:
                self._native.combine_send(self._stream(), send_args)
                return None
        else:
            send_args = None
        if out is None:
            out = torch.empty((T, self.hidden), dtype=torch.bfloat16, device=self.device)
        else:
            out = self._tensor("out", out, (torch.bfloat16,), 2)
            if tuple(out.shape) != (T, self.hidden):
                raise _fail(f"out must have shape ({T}, {self.hidden}), not {tuple(out.shape)}")
            if T and ((out.data_ptr() % 16) or (out.stride(0) * 2) % 16):
                raise _fail("out rows must start on 16-byte boundaries")
        recv_args = CombineRecvArgs(
            out=out.data_ptr() if T else 0, out_stride=out.stride(0) * 2 if T else 0, num_rows=T
        )
        if send_args is None:
            self._native.combine_recv(self._stream(), recv_args)
        elif self.fused:
            self._native.combine(self._stream(), send_args, recv_args)
        else:
            self._native.combine_send(self._stream(), send_args)
            self._native.combine_recv(self._stream(), recv_args)
        return out

    # ---------------------------------------------------------------------------------- cleanup

    def destroy(self) -> None:
        """Collective: waits for this device's work and every rank, then frees the buffers."""
        if self._native is None:
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self._native = None  # type: ignore[assignment]
        dist.barrier(group=self.group)

    @staticmethod
    def kernel_archs() -> str:
        """Machine-code architectures of the embedded kernels ("" when built without nvcc)."""
        return str(_rust.AllToAll.kernel_archs())
