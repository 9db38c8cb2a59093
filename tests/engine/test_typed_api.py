"""The typed seams: every error is a FabricError, friendly errors for common mistakes, descriptor
hex form, and the submit_* overloads (a submit without on_done is a Future[None] to mypy)."""

from __future__ import annotations

import ast
import builtins
import subprocess
import sys
import textwrap
from pathlib import Path

import fabric_lib
import pytest
from fabric_lib import errors

PACKAGE = Path(fabric_lib.__file__).parent
REPO = Path(__file__).resolve().parents[2]


def _builtin_raises(path: Path) -> list[str]:
    """`raise ValueError(...)`-style raises of built-in exception classes in one module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Raise)
            and isinstance(node.exc, ast.Call)
            and isinstance(node.exc.func, ast.Name)
        ):
            name = node.exc.func.id
            if isinstance(getattr(builtins, name, None), type) and issubclass(
                getattr(builtins, name), BaseException
            ):
                if name not in ("SystemExit", "KeyboardInterrupt", "ImportError"):
                    found.append(f"{path.name}:{node.lineno}: raise {name}")
    return found


def test_package_raises_only_fabric_errors() -> None:
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in _builtin_raises(path)]
    assert offenders == [], "raise a fabric_lib.errors class instead:\n" + "\n".join(offenders)


def test_every_exported_error_is_a_fabric_error() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.FabricError), name
    from fabric_lib.testing.netns import TestBedError
    from fabric_lib.topology import UnknownDeviceError

    assert issubclass(TestBedError, errors.FabricError)
    assert issubclass(UnknownDeviceError, KeyError) and issubclass(UnknownDeviceError, errors.FabricError)


def test_former_builtin_errors_are_typed(tcp_pair) -> None:
    a, _ = tcp_pair
    with pytest.raises(errors.InvalidArgumentError, match="32 bits"):
        a.imm_counter(-1)
    with pytest.raises(errors.InvalidArgumentError, match="no device 'cuda:99'"):
        fabric_lib.TransferEngine.detect_topology().device("cuda:99")
    with pytest.raises(errors.InvalidArgumentError, match="hosts must be"):
        from fabric_lib.testing.netns import TestBed

        TestBed(hosts=0)


def test_exchange_without_process_group_is_typed(tcp_pair) -> None:
    pytest.importorskip("torch")
    from fabric_lib import distributed

    with pytest.raises(errors.InvalidArgumentError, match="init_process_group"):
        distributed.exchange(tcp_pair[0])


def test_tensor_where_a_region_is_expected(tcp_pair) -> None:
    torch = pytest.importorskip("torch")
    a, b = tcp_pair
    dst = b.register_tensor(torch.zeros(16))
    with pytest.raises(errors.InvalidArgumentError, match=r"register_tensor\(tensor\)"):
        a.submit_write(torch.ones(16), dst.descriptor)  # type: ignore[arg-type]


def test_descriptor_where_a_source_is_expected(tcp_pair) -> None:
    a, b = tcp_pair
    dst = b.register_buffer(bytearray(64))
    with pytest.raises(errors.InvalidArgumentError, match="names a peer.s region"):
        a.submit_write(dst.descriptor, dst.descriptor)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="MemoryRegion"):
        a.submit_write(b"bytes", dst.descriptor)  # type: ignore[arg-type]


def test_bad_destination_and_peer_kinds(tcp_pair) -> None:
    a, _ = tcp_pair
    src = a.register_buffer(bytearray(64))
    with pytest.raises(errors.InvalidArgumentError, match="region.descriptor"):
        a.submit_write(src, 1234)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidDescriptorError):
        a.submit_write(src, b"not a descriptor")
    with pytest.raises(errors.InvalidArgumentError, match="main_address"):
        a.submit_send(3.5, b"hi")  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgumentError, match="callable"):
        a.submit_write(src, src.descriptor, on_done="print")  # type: ignore[call-overload]


def test_memory_region_is_accepted_as_destination(tcp_pair) -> None:
    a, b = tcp_pair
    src = a.register_buffer(bytearray(b"abcd" * 256))
    target = bytearray(1024)
    dst = b.register_buffer(target)
    with b.imm_counter(5) as counter:
        a.submit_write(src, dst, imm=5).result(timeout=20)
        counter.wait(1, timeout=20)
    assert bytes(target) == b"abcd" * 256


def test_register_buffer_rejects_what_it_cannot_write(tcp_pair) -> None:
    a, _ = tcp_pair
    with pytest.raises(errors.InvalidArgumentError, match="read-only"):
        a.register_buffer(b"immutable")
    with pytest.raises(errors.InvalidArgumentError, match="writable buffer"):
        a.register_buffer(object())
    with pytest.raises(errors.InvalidArgumentError, match="contiguous"):
        a.register_buffer(memoryview(bytearray(64))[::2])


def test_descriptor_hex_form(tcp_pair) -> None:
    a, b = tcp_pair
    descriptor = b.register_buffer(bytearray(128)).descriptor
    text = descriptor.to_hex()
    assert text == descriptor.to_bytes().hex()
    assert fabric_lib.MrDescriptor.from_hex(text) == descriptor
    assert fabric_lib.MrDescriptor.from_hex(f"  {text}\n") == descriptor
    with pytest.raises(errors.InvalidDescriptorError, match="not hex"):
        fabric_lib.MrDescriptor.from_hex("zz")
    with pytest.raises(errors.InvalidDescriptorError):
        fabric_lib.MrDescriptor.from_hex(text[:-8])
    src = a.register_buffer(bytearray(128))
    a.submit_write(src, text).result(timeout=20)  # the hex string is a destination too


def _mypy(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mypy")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(code))
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", str(snippet)],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_submit_overloads_type_the_return(tmp_path: Path) -> None:
    result = _mypy(
        tmp_path,
        """
        from concurrent.futures import Future
        import fabric_lib

        def use(engine: fabric_lib.TransferEngine, region: fabric_lib.MemoryRegion,
                dst: fabric_lib.MrDescriptor, peer: fabric_lib.EngineAddress) -> None:
            f1: Future[None] = engine.submit_write(region, dst, imm=1)
            f2: Future[None] = engine.submit_paged_writes(4096, region, [0], dst, [1])
            f3: Future[None] = engine.submit_scatter(region, [(8, 0, dst, 0)])
            f4: Future[None] = engine.submit_imm(3, peer)
            f5: Future[None] = engine.submit_send(peer, b"x")
            f6: Future[None] = engine.submit_barrier(3, 0)
            for f in (f1, f2, f3, f4, f5, f6):
                f.result(timeout=1)
            engine.submit_write(region, dst, on_done=lambda error: None)
        """,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    bad = _mypy(
        tmp_path,
        """
        import fabric_lib

        def use(engine: fabric_lib.TransferEngine, region: fabric_lib.MemoryRegion) -> None:
            engine.submit_write(region, region.descriptor, on_done=lambda error: None).result()
        """,
    )
    assert bad.returncode == 1 and '"None" has no attribute "result"' in bad.stdout, bad.stdout


def test_cuda_device_is_checked_when_the_engine_starts() -> None:
    """``cuda_device`` binds that GPU's context on the worker: without a driver that is a typed
    CUDA error, with one a GPU that does not exist is an invalid argument."""
    import fabric_lib.cuda as fcuda

    try:
        gpus = fcuda.device_count()
    except errors.CudaUnavailableError:
        with pytest.raises(errors.CudaUnavailableError):
            fabric_lib.TransferEngine("tcp", cuda_device=0)
        return
    with pytest.raises(errors.InvalidArgumentError, match="cuda_device"):
        fabric_lib.TransferEngine("tcp", cuda_device=gpus)
    if gpus:
        with fabric_lib.TransferEngine("tcp", cuda_device=gpus - 1) as e:
            assert e.main_address.provider.startswith("tcp")
