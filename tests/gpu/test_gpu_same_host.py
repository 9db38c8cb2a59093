"""GPU memory, same-host (CUDA IPC / NVLink) transfers, UVM watchers and GPU flags.

Marked ``gpu`` / ``multi_gpu``; every GPU test skips with a reason where CUDA is missing. The
first tests run everywhere and check the no-CUDA behaviour (typed errors, nothing loaded).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Literal

import fabric_lib
import fabric_lib.cuda as fcuda
import pytest
import torch
from fabric_lib.errors import CudaUnavailableError, InvalidArgumentError
from fabric_lib.testing import spawn_ranks

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None  # type: ignore[assignment]


def _num_gpus() -> int:
    if not torch.cuda.is_available():
        return 0
    try:
        return fcuda.device_count()
    except CudaUnavailableError:
        return 0


NGPU = _num_gpus()
needs_gpu = pytest.mark.skipif(NGPU < 1, reason="needs a CUDA GPU (none visible)")
needs_two = pytest.mark.skipif(NGPU < 2, reason=f"needs two CUDA GPUs ({NGPU} visible)")
needs_kernels = pytest.mark.skipif(
    not fcuda.kernels()[0], reason="this build carries no CUDA kernels (no nvcc)"
)

TIMEOUT = 30.0


def _engine(**kw) -> fabric_lib.TransferEngine:
    return fabric_lib.TransferEngine("tcp", "lo", transfer_timeout=TIMEOUT, **kw)


# -- everywhere -------------------------------------------------------------------------------


def test_import_and_host_engines_never_need_cuda() -> None:
    ok, archs = fcuda.kernels()
    assert isinstance(ok, bool) and isinstance(archs, str)
    with _engine(poll_mode="adaptive") as e:
        t = torch.zeros(1024, dtype=torch.uint8)
        r = e.register_tensor(t)
        assert r.kind == "host" and r.descriptor.network_reachable
        r2 = e.register_memory(t.data_ptr(), 512)
        assert r2.kind == "host"
        assert fcuda.memory_kind(t.data_ptr()) == "host"


@pytest.mark.skipif(NGPU > 0, reason="checks the behaviour without CUDA")
def test_without_cuda_gpu_features_raise_cuda_unavailable() -> None:
    assert not fcuda.is_available()
    with pytest.raises(CudaUnavailableError, match="libcuda|cuInit|device"):
        fcuda.device_count()
    with _engine(poll_mode="adaptive") as e:
        with pytest.raises(CudaUnavailableError):
            e.alloc_gpu_flag()
        with pytest.raises(CudaUnavailableError):
            e.alloc_uvm_watcher(lambda old, new: None)
        with pytest.raises(CudaUnavailableError):
            e.register_memory(0x10000, 4096, device=0)
    with pytest.raises(CudaUnavailableError):
        fcuda.SignalStream(0)


# -- helpers for GPU tests ---------------------------------------------------------------------


def _expected_pages(
    dst: torch.Tensor, src: torch.Tensor, page_len: int, src_pages, dst_pages
) -> torch.Tensor:
    out = dst.clone()
    for s, d in zip(src_pages, dst_pages):
        out[d * page_len : (d + 1) * page_len] = src[s * page_len : (s + 1) * page_len].to(out.device)
    return out


def _rand_bytes(n: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


class _Pair:
    """Two engines in this process: writer on device `a`, receiver on device `b`."""

    def __init__(self, a: int, b: int, pages: int = 64, page_len: int = 4096) -> None:
        self.page_len, self.pages = page_len, pages
        n = pages * page_len
        self.w, self.r = _engine(), _engine()
        self.src_gpu = _rand_bytes(n, f"cuda:{a}", 1)
        self.src_host = _rand_bytes(n, "cpu", 2)
        self.dst_gpu = torch.zeros(n, dtype=torch.uint8, device=f"cuda:{b}")
        self.dst_host = torch.zeros(n, dtype=torch.uint8)
        self.src_gpu_r = self.w.register_tensor(self.src_gpu)
        self.src_host_r = self.w.register_tensor(self.src_host)
        self.dst_gpu_r = self.r.register_tensor(self.dst_gpu)
        self.dst_host_r = self.r.register_tensor(self.dst_host)
        torch.cuda.synchronize()

    def close(self) -> None:
        self.w.stop()
        self.r.stop()


def _combos(p: _Pair):
    return [
        ("gpu->gpu", p.src_gpu_r, p.src_gpu, p.dst_gpu_r, p.dst_gpu),
        ("host->gpu", p.src_host_r, p.src_host, p.dst_gpu_r, p.dst_gpu),
        ("gpu->host", p.src_gpu_r, p.src_gpu, p.dst_host_r, p.dst_host),
    ]


def _check_pair(p: _Pair) -> None:
    imm = 100
    for name, src_r, src, dst_r, dst in _combos(p):
        imm += 1
        dst.zero_()
        torch.cuda.synchronize()
        # single write
        n = p.page_len * 3 + 5
        p.w.submit_write(src_r, dst_r.descriptor, n, src_offset=7, dst_offset=11, imm=imm).result(TIMEOUT)
        p.r.imm_counter(imm).wait(1, timeout=TIMEOUT)
        torch.cuda.synchronize()
        assert torch.equal(dst[11 : 11 + n].cpu(), src[7 : 7 + n].cpu()), name
        assert dst[:11].cpu().eq(0).all() and dst[11 + n :].cpu().eq(0).all(), name
        # paged write
        dst.zero_()
        torch.cuda.synchronize()
        src_pages = [5, 0, 63, 17, 17]
        dst_pages = [1, 2, 3, 60, 0]
        expected = _expected_pages(dst.cpu(), src.cpu(), p.page_len, src_pages, dst_pages)
        p.w.submit_paged_writes(p.page_len, src_r, src_pages, dst_r.descriptor, dst_pages, imm=imm).result(
            TIMEOUT
        )
        p.r.imm_counter(imm).wait(1, timeout=TIMEOUT)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), expected), name
        assert p.r.imm_counter(imm).value == 0, f"{name}: exactly one immediate per request"


# -- one process ---------------------------------------------------------------------------------


@needs_gpu
@needs_kernels
@pytest.mark.gpu
def test_one_gpu_same_process_all_directions() -> None:
    p = _Pair(0, 0)
    try:
        _check_pair(p)
    finally:
        p.close()


@needs_gpu
@pytest.mark.gpu
def test_scatter_with_gpu_memory_on_the_same_host() -> None:
    """A scatter whose targets are same-host GPU copies (CUDA, the receiver's inbox) next to
    host-to-host targets over the provider, from a GPU and from a host source: each receiver
    counts the immediate once per target, after that target's bytes are in place."""
    n = 1 << 20
    w, r1, r2 = _engine(poll_mode="adaptive"), _engine(poll_mode="adaptive"), _engine(poll_mode="adaptive")
    try:
        src_gpu, src_host = _rand_bytes(n, "cuda:0", 5), _rand_bytes(n, "cpu", 6)
        dst = {
            (r, kind): torch.zeros(n, dtype=torch.uint8, device="cuda:0" if kind == "gpu" else "cpu")
            for r in (1, 2)
            for kind in ("gpu", "host")
        }
        engines = {1: r1, 2: r2}
        desc = {key: engines[key[0]].register_tensor(t).descriptor for key, t in dst.items()}
        rs_gpu, rs_host = w.register_tensor(src_gpu), w.register_tensor(src_host)
        torch.cuda.synchronize()
        expected = {key: torch.zeros(n, dtype=torch.uint8) for key in dst}
        # (source, shard_by, imm, [(length, src_offset, (receiver, kind), dst_offset)])
        scatters: list[
            tuple[str, Literal["peer", "bytes"], int, list[tuple[int, int, tuple[int, str], int]]]
        ] = [
            (
                "gpu",
                "peer",
                61,
                [
                    (100_003, 7, (1, "gpu"), 11),
                    (5000, 0, (2, "gpu"), 0),
                    (70_000, 13, (2, "host"), 3),
                    (1, n - 1, (1, "gpu"), 200_000),
                    (0, 0, (1, "host"), 0),
                ],
            ),
            ("host", "bytes", 62, [(300_000, 1, (1, "gpu"), 400_000), (20_000, 5, (2, "host"), 500_000)]),
        ]
        for src_kind, shard_by, imm, targets in scatters:
            src, region = (src_gpu, rs_gpu) if src_kind == "gpu" else (src_host, rs_host)
            for length, src_off, key, dst_off in targets:
                expected[key][dst_off : dst_off + length] = src[src_off : src_off + length].cpu()
            native = [(length, src_off, desc[key], dst_off) for length, src_off, key, dst_off in targets]
            w.submit_scatter(region, native, imm=imm, shard_by=shard_by).result(TIMEOUT)
            per_receiver = {r: sum(1 for t in targets if t[2][0] == r) for r in (1, 2)}
            for r, count in per_receiver.items():
                if count:
                    engines[r].imm_counter(imm).wait(count, timeout=TIMEOUT)
        torch.cuda.synchronize()
        time.sleep(0.05)
        for r, e in engines.items():
            assert e.imm_counter(61).value == 0 and e.imm_counter(62).value == 0, (
                f"receiver {r}: extra immediates"
            )
        for key, t in dst.items():
            assert torch.equal(t.cpu(), expected[key]), f"receiver {key[0]}'s {key[1]} buffer"
    finally:
        for e in (w, r1, r2):
            e.stop()


@needs_two
@needs_kernels
@pytest.mark.multi_gpu
def test_two_gpus_one_process_all_directions_and_1000_requests() -> None:
    p = _Pair(0, 1)
    try:
        _check_pair(p)
        # 1000 consecutive paged requests, each with the immediate; every byte and count exact.
        p.dst_gpu.zero_()
        torch.cuda.synchronize()
        imm, n_req = 999, 1000
        futures = []
        for i in range(n_req):
            s = [(i + k) % p.pages for k in range(4)]
            d = [(7 * i + 3 * k) % p.pages for k in range(4)]
            futures.append(
                p.w.submit_paged_writes(p.page_len, p.src_gpu_r, s, p.dst_gpu_r.descriptor, d, imm=imm)
            )
        for f in futures:
            f.result(TIMEOUT)
        p.r.imm_counter(imm).wait(n_req, timeout=TIMEOUT)
        assert p.r.imm_counter(imm).value == 0
        expected = torch.zeros_like(p.dst_gpu).cpu()
        src = p.src_gpu.cpu()
        for i in range(n_req):
            s = [(i + k) % p.pages for k in range(4)]
            d = [(7 * i + 3 * k) % p.pages for k in range(4)]
            expected = _expected_pages(expected, src, p.page_len, s, d)
        torch.cuda.synchronize()
        assert torch.equal(p.dst_gpu.cpu(), expected)
    finally:
        p.close()


if given is not None:

    @needs_two
    @needs_kernels
    @pytest.mark.multi_gpu
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def test_two_gpus_paged_writes_hypothesis(data) -> None:
        p = _PAIR_CACHE.get()
        page_len = data.draw(st.sampled_from([16, 1000, 4096]))
        pages = (p.pages * p.page_len) // page_len
        count = data.draw(st.integers(1, min(pages, 48)))
        dst_pages = data.draw(
            st.lists(st.integers(0, pages - 1), unique=True, min_size=count, max_size=count)
        )
        src_pages = data.draw(st.lists(st.integers(0, pages - 1), min_size=count, max_size=count))
        which = data.draw(st.sampled_from(range(3)))
        name, src_r, src, dst_r, dst = _combos(p)[which]
        dst.zero_()
        torch.cuda.synchronize()
        expected = torch.zeros(dst.numel(), dtype=torch.uint8)
        srcc = src.cpu()
        for s, d in zip(src_pages, dst_pages):
            expected[d * page_len : (d + 1) * page_len] = srcc[s * page_len : (s + 1) * page_len]
        p.w.submit_paged_writes(page_len, src_r, src_pages, dst_r.descriptor, dst_pages, imm=55).result(
            TIMEOUT
        )
        p.r.imm_counter(55).wait(1, timeout=TIMEOUT)
        torch.cuda.synchronize()
        assert torch.equal(dst.cpu(), expected), name
        assert p.r.imm_counter(55).value == 0


class _PairCache:
    def __init__(self) -> None:
        self.pair: _Pair | None = None

    def get(self) -> _Pair:
        if self.pair is None:
            self.pair = _Pair(0, 1 if NGPU > 1 else 0)
        return self.pair


_PAIR_CACHE = _PairCache()


@pytest.fixture(scope="module", autouse=True)
def _close_cached_pair():
    yield
    if _PAIR_CACHE.pair is not None:
        _PAIR_CACHE.pair.close()


# -- two processes -------------------------------------------------------------------------------


class _Receiver:
    """The receiving process's engine and destination tensors (on its GPU and in host memory)."""

    def __init__(self, device: int, nbytes: int) -> None:
        torch.cuda.set_device(device)
        self.engine = _engine()
        self.dst = {
            "gpu": torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device}"),
            "host": torch.zeros(nbytes, dtype=torch.uint8),
        }
        self.regions = {which: self.engine.register_tensor(t) for which, t in self.dst.items()}
        torch.cuda.synchronize()


def open_receiver(device: int, nbytes: int) -> _Receiver:
    return _Receiver(device, nbytes)


def stop_receiver(rx: _Receiver) -> None:
    rx.engine.stop()


def receiver_descriptors(rx: _Receiver) -> tuple[bytes, bytes]:
    return rx.regions["gpu"].descriptor.to_bytes(), rx.regions["host"].descriptor.to_bytes()


def receive(rx: _Receiver, imm: int, n: int, which: str) -> tuple[bytes, int]:
    """Waits for ``n`` arrivals of ``imm``; returns the bytes of the ``which`` tensor (then zeroes
    it) and the arrivals counted beyond ``n``."""
    rx.engine.imm_counter(imm).wait(n, timeout=TIMEOUT)
    extra = rx.engine.imm_counter(imm).value
    torch.cuda.synchronize()
    t = rx.dst[which]
    data = t.cpu().numpy().tobytes()
    t.zero_()
    torch.cuda.synchronize()
    return data, extra


@needs_two
@needs_kernels
@pytest.mark.multi_gpu
def test_two_processes_two_gpus() -> None:
    page_len, pages = 4096, 64
    nbytes = page_len * pages
    with spawn_ranks(
        1,
        setup=open_receiver,
        setup_kwargs={"device": 1, "nbytes": nbytes},
        teardown=stop_receiver,
        timeout=120,
    ) as (rx,):
        gpu_desc, host_desc = (fabric_lib.MrDescriptor.from_bytes(b) for b in rx.call(receiver_descriptors))
        assert gpu_desc.kind == "cuda:1" and not gpu_desc.network_reachable
        w = _engine()
        src_gpu = _rand_bytes(nbytes, "cuda:0", 3)
        src_host = _rand_bytes(nbytes, "cpu", 4)
        rs_gpu, rs_host = w.register_tensor(src_gpu), w.register_tensor(src_host)
        torch.cuda.synchronize()
        import random

        rng = random.Random(5)
        cases = [
            ("gpu", rs_gpu, src_gpu, gpu_desc, "gpu"),
            ("host", rs_host, src_host, gpu_desc, "gpu"),
            ("gpu", rs_gpu, src_gpu, host_desc, "host"),
        ]
        for it in range(12):
            _, sr, src, dd, which = cases[it % 3]
            count = rng.randint(1, pages)
            dst_pages = rng.sample(range(pages), count)
            src_pages = [rng.randrange(pages) for _ in range(count)]
            imm = 200 + it
            arrived = rx.submit(receive, imm, 1, which)
            w.submit_paged_writes(page_len, sr, src_pages, dd, dst_pages, imm=imm).result(TIMEOUT)
            data, extra = arrived.result(TIMEOUT + 10)
            expected = _expected_pages(
                torch.zeros(nbytes, dtype=torch.uint8), src.cpu(), page_len, src_pages, dst_pages
            )
            got = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            assert torch.equal(got, expected), f"case {it} ({which})"
            assert extra == 0
        # 1000 consecutive requests into the peer GPU, one count.
        n_req = 1000
        arrived = rx.submit(receive, 500, n_req, "gpu")
        expected = torch.zeros(nbytes, dtype=torch.uint8)
        srcc = src_gpu.cpu()
        futures = []
        for i in range(n_req):
            s, d = [(3 * i) % pages], [(5 * i + 1) % pages]
            futures.append(w.submit_paged_writes(page_len, rs_gpu, s, gpu_desc, d, imm=500))
            expected = _expected_pages(expected, srcc, page_len, s, d)
        for f in futures:
            f.result(TIMEOUT)
        data, extra = arrived.result(TIMEOUT + 10)
        assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.uint8), expected)
        assert extra == 0
        w.stop()


# -- bad input --------------------------------------------------------------------------------


@needs_gpu
@pytest.mark.gpu
def test_bad_gpu_input_is_rejected() -> None:
    with _engine() as a, _engine() as b:
        src = torch.ones(1 << 16, dtype=torch.uint8, device="cuda:0")
        dst = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda:0")
        rs, rd = a.register_tensor(src), b.register_tensor(dst)
        assert rs.kind == "cuda:0"
        assert fcuda.memory_kind(src.data_ptr()) == "cuda:0"
        # auto-detected device pointer
        r2 = a.register_memory(src.data_ptr(), 1024, src)
        assert r2.kind == "cuda:0"
        a.unregister_memory(r2)
        # wrong device / past the allocation
        if NGPU > 1:
            with pytest.raises(InvalidArgumentError, match="device"):
                a.register_memory(src.data_ptr(), 1024, device=1)
        big = torch.zeros(1 << 21, dtype=torch.uint8, device="cuda:0")
        with pytest.raises(InvalidArgumentError):
            a.register_memory(big.data_ptr(), (1 << 40), big)
        # past the end: source, destination, page index
        with pytest.raises(InvalidArgumentError):
            a.submit_write(rs, rd.descriptor, (1 << 16) + 1)
        with pytest.raises(InvalidArgumentError):
            a.submit_write(rs, rd.descriptor, 16, dst_offset=(1 << 16) - 8)
        with pytest.raises(InvalidArgumentError):
            a.submit_paged_writes(4096, rs, [0], rd.descriptor, [16])
        # a handle that was never registered, and a region freed then used
        with pytest.raises(InvalidArgumentError):
            a.submit_write(fabric_lib.MemoryRegion(424242, rs.descriptor, 16, None), rd.descriptor, 16)
        a.unregister_memory(rs)
        with pytest.raises(InvalidArgumentError):
            a.submit_write(rs, rd.descriptor, 16)
        with pytest.raises(InvalidArgumentError):
            a.submit_scatter(rs, [(16, 0, rd.descriptor, 0)])


# -- UVM watcher --------------------------------------------------------------------------------


def _wait_for(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.001)
    return pred()


@needs_gpu
@pytest.mark.gpu
def test_uvm_watcher_sees_graph_replays_monotone() -> None:
    with _engine() as e:
        seen: list[tuple[int, int]] = []
        lock = threading.Lock()

        def cb(old: int, new: int) -> None:
            with lock:
                seen.append((old, new))

        w = e.alloc_uvm_watcher(cb, device=0)
        assert w.ptr % 8 == 0 and w.value == 0
        word = fcuda.word_tensor(w.ptr, 0)
        counter = torch.zeros(1, dtype=torch.int64, device="cuda:0")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.add(counter, 0, out=word)  # warm up
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                counter.add_(1)
                torch.add(counter, 0, out=word)
            for _ in range(1000):
                g.replay()
        torch.cuda.synchronize()
        assert _wait_for(lambda: bool(seen) and seen[-1][1] == 1000), seen[-5:]
        with lock:
            values = [new for _, new in seen]
            assert all(x < y for x, y in itertools.pairwise(values)), "monotone"
            assert all(o == prev for (o, _), prev in zip(seen[1:], values)), "old is the previous new"
            assert values[-1] == 1000
        # cuda-lib's release-store kernel
        s = fcuda.SignalStream(0)
        s.write_u64(w.ptr, 5000)
        assert s.synchronize(10)
        assert _wait_for(lambda: seen[-1][1] == 5000)
        w.close()


@needs_gpu
@needs_kernels
@pytest.mark.gpu
def test_inline_uvm_watcher_runs_on_the_watcher_thread_and_survives_a_raising_callback() -> None:
    """``inline=True``: the callback runs on the polling thread, not the callback thread; an
    exception in it is contained and later changes are still reported."""
    with _engine() as e:
        threads: dict[str, set[int]] = {"queued": set(), "inline": set()}
        seen: list[int] = []

        def queued(old: int, new: int) -> None:
            threads["queued"].add(threading.get_native_id())

        def inline(old: int, new: int) -> None:
            threads["inline"].add(threading.get_native_id())
            seen.append(new)
            if new == 1:
                raise RuntimeError("a raising inline callback")

        wq = e.alloc_uvm_watcher(queued, device=0)
        wi = e.alloc_uvm_watcher(inline, device=0, inline=True)
        s = fcuda.SignalStream(0)
        for v in (1, 2):
            s.write_u64(wq.ptr, v)
            s.write_u64(wi.ptr, v)
            assert s.synchronize(10)
            assert _wait_for(lambda v=v: bool(seen) and seen[-1] == v), seen
        assert _wait_for(lambda: bool(threads["queued"]))
        assert threads["inline"] and not threads["inline"] & threads["queued"], threads
        wq.close()
        wi.close()


# -- GPU flags ---------------------------------------------------------------------------------


@needs_gpu
@needs_kernels
@pytest.mark.gpu
def test_imm_count_sets_gpu_flag_that_a_kernel_waits_for() -> None:
    with _engine() as a, _engine() as b:
        flag = b.alloc_gpu_flag(0)
        assert flag.get() == 0
        s = fcuda.SignalStream(0)
        b.set_imm_count_expected(77, 3, flag=flag, flag_value=9)
        s.flag_poll(flag.ptr, 9, timeout=20.0, slot=0)
        assert s.status(0) is None
        for _ in range(3):
            a.submit_imm(77, b.main_address).result(TIMEOUT)
        assert s.synchronize(25)
        assert s.status(0) is True
        assert flag.get() == 9
        # Without the immediate the kernel times out (bounded), and the flag stays unset.
        flag2 = b.alloc_gpu_flag(0)
        b.set_imm_count_expected(78, 1, flag=flag2)
        t0 = time.monotonic()
        s.flag_poll(flag2.ptr, 1, timeout=0.2, slot=1)
        assert s.synchronize(20)
        assert s.status(1) is False
        assert time.monotonic() - t0 < 15
        assert flag2.get() == 0
        # CPU set works as well.
        s.flag_poll(flag2.ptr, 4, timeout=20.0, slot=2)
        flag2.set(4)
        assert s.synchronize(25) and s.status(2) is True
