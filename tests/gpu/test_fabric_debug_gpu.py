"""``fabric-debug`` with GPU buffers: a server and a client process on GPU 0, both forms
(``server``/``client --gpus 0`` and the positional ``fabric-debug 0 1 [HOST:PORT]``), over

- ``tcp`` with ``--force-network``: staged (bounce buffers and the landing area);
- ``shm`` of a CUDA-enabled libfabric with ``--force-network``: registered with the provider
  (DMA-BUF, or the CUDA interface), FI_HMEM; ``.libfabric-cuda/lib`` is put on
  ``LD_LIBRARY_PATH`` when present (``scripts/build_libfabric.sh``); skips where shm has no FI_HMEM;
- ``tcp`` without it: the same-host path (CUDA IPC).

Each run checks the JSON report: the registration and path named per GPU, nonzero throughput,
op rate, round trips and paged rates, and exactly the immediates each phase sent counted by the
server. Needs a CUDA GPU and the ``fabric-debug`` console script beside this interpreter (skips
otherwise).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import fabric_lib
import fabric_lib.cuda as fcuda
import pytest
from fabric_lib.errors import CudaUnavailableError

REPO = Path(__file__).resolve().parents[2]
CUDA_LIBFABRIC = REPO / ".libfabric-cuda" / "lib"

# Small but real: two sizes, one repetition; window 16 (the default), op window 16.
QUICK = [
    "--sizes", "64K,4M", "--reps", "1", "--bytes-per-rep", "16MiB", "--ops", "200", "--op-window", "16",
    "--iters", "50", "--warmup-iters", "5", "--page-sizes", "64K", "--page-counts", "16",
    "--read-sizes", "64K", "--json", "--stall-timeout", "60", "--connect-timeout", "60",
]  # fmt: skip
# Immediates each phase posts with QUICK (warm-up of min(writes, 4 windows), then one rep):
# 64 KiB: 256 writes (16 MiB) + 64; 4 MiB: max(4, 2 windows) = 32 + 32; paged: warm-up + 1;
# op rate: 200 + 64.
EXPECTED_IMMEDIATES = {"throughput": 256 + 64 + 32 + 32, "paged": 2, "op-rate": 200 + 64}


def _gpu_count() -> int:
    try:
        return fcuda.device_count()
    except CudaUnavailableError:
        return 0


def _binary() -> Path:
    found = shutil.which("fabric-debug", path=str(Path(sys.executable).parent))
    if found is not None:
        return Path(found)
    packaged = Path(fabric_lib.__file__).parent / "_bin" / "fabric-debug"  # e.g. a --target install
    if not packaged.is_file():
        pytest.skip("fabric-debug is not installed beside this interpreter nor in the package")
    return packaged


def _env(cuda_libfabric: bool) -> dict[str, str]:
    env = dict(os.environ)
    if cuda_libfabric and CUDA_LIBFABRIC.is_dir():
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(CUDA_LIBFABRIC), env.get("LD_LIBRARY_PATH")) if p
        )
    return env


def _shm_has_fi_hmem(env: dict[str, str]) -> bool:
    out = subprocess.run(
        [_binary(), "--gpus", "--gpu-provider", "shm", "--gpu-json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return bool(json.loads(out.stdout)["providers"][0]["fi_hmem"])


def _lines(server: subprocess.Popen[str]) -> queue.Queue[str]:
    """The server's stdout lines, read by a thread (a select on the pipe would miss lines
    already buffered by an earlier readline)."""
    assert server.stdout is not None
    out: queue.Queue[str] = queue.Queue()
    stream = server.stdout

    def pump() -> None:
        for line in stream:
            out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _line(lines: queue.Queue[str], timeout: float) -> str:
    """The server's next stdout line, waiting at most `timeout` for it."""
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"the server printed nothing within {timeout} s") from None


def _run(
    server_argv: list[str], client_argv: list[str], env: dict[str, str], lines: int = 1
) -> tuple[dict[str, Any], list[str]]:
    """Starts the server, reads its first `lines` stdout lines (READY first), runs the client
    against the printed address (`{address}` in `client_argv`); returns the client's JSON report
    and those lines."""
    binary = str(_binary())
    with tempfile.TemporaryFile("w+") as server_err:
        server = subprocess.Popen(
            [binary, *server_argv], stdout=subprocess.PIPE, stderr=server_err, text=True, env=env
        )
        try:
            out = _lines(server)
            try:
                printed = [_line(out, 120) for _ in range(lines)]
            except AssertionError as e:
                server.kill()
                server.wait(timeout=30)
                server_err.seek(0)
                raise AssertionError(f"{e}; server stderr:\n{server_err.read()}") from None
            if not printed[0].startswith("READY "):
                server.kill()
                server.wait(timeout=30)
                server_err.seek(0)
                raise AssertionError(f"server: {printed!r}\n{server_err.read()}")
            address = printed[0].split()[1]
            argv = [a.replace("{address}", address) for a in client_argv]
            client = subprocess.run([binary, *argv], capture_output=True, text=True, env=env, timeout=420)
            server.wait(timeout=60)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait(timeout=30)
        server_err.seek(0)
        err = server_err.read()
    assert client.returncode == 0, f"client:\n{client.stderr}\nserver:\n{err}"
    assert server.returncode == 0, f"server:\n{err}"
    return json.loads(client.stdout), [p.strip() for p in printed]


def _check(report: dict[str, Any], gpus: list[int], path: str, client_reg: set[str], server_reg: str) -> None:
    assert [g["memory"]["client_buffer"] for g in report["gpus"]] == [f"cuda:{g}" for g in gpus]
    for gpu in report["gpus"]:
        memory = gpu["memory"]
        assert memory["server_buffer"] == memory["client_buffer"], memory
        assert memory["path"] == path, memory
        assert memory["client_registration"] in client_reg, memory
        assert memory["server_registration"] == server_reg, memory
        assert (memory["staged_requests"] > 0 and memory["bounced_bytes"] > 0) == (path == "staged"), memory
        assert [t["size"] for t in gpu["throughput"]] == [64 << 10, 4 << 20]
        assert all(t["gbytes_per_s"] > 0 for t in gpu["throughput"]), gpu["throughput"]
        assert gpu["op_rate"]["verified"] and gpu["op_rate"]["mops_per_s"] > 0
        assert gpu["rtt"]["p50_us"] > 0 and gpu["rtt"]["iters"] == 50
        if "paged" in {v["phase"] for v in gpu["verified"]}:
            assert gpu["paged"][0]["gbits_per_s"] > 0
        counted = {v["phase"]: v["immediates"] for v in gpu["verified"]}
        assert counted == {k: n for k, n in EXPECTED_IMMEDIATES.items() if k in counted}, counted
        assert {"throughput", "op-rate"} <= set(counted)
        if path == "staged":  # reads are never staged: skipped, and the report says so
            assert gpu["read_throughput"] == [] and any(s.startswith("read") for s in gpu["skipped"]), gpu
        else:
            assert gpu["read_throughput"][0]["gbytes_per_s"] > 0, gpu
    total = report["total"]
    assert total["gpus"] == len(gpus)
    for i, size_total in enumerate(total["throughput"]):
        assert size_total["gbytes_per_s"] == pytest.approx(
            sum(g["throughput"][i]["gbytes_per_s"] for g in report["gpus"])
        )
    assert total["immediates_verified"] == sum(v["immediates"] for g in report["gpus"] for v in g["verified"])


# name: (provider, --force-network, CUDA libfabric, expected path, client registration, server's)
PATHS = {
    "tcp-staged": ("tcp", True, False, "staged", {"staged"}, "staged"),
    "shm-fi-hmem": ("shm", True, True, "network", {"dmabuf", "cuda"}, "nic"),
    "same-host": ("tcp", False, False, "same-host", {"staged"}, "staged"),
}


def _setup(name: str, gpus: int = 1) -> tuple[str, list[str], dict[str, str], tuple[Any, ...]]:
    if _gpu_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPU(s)")
    provider, force, cuda_libfabric, *expected = PATHS[name]
    env = _env(cuda_libfabric)
    if provider == "shm" and not _shm_has_fi_hmem(env):
        pytest.skip("shm has no FI_HMEM here: build the CUDA libfabric (scripts/build_libfabric.sh)")
    engine = ["--provider", provider, "--adaptive", *(["--force-network"] if force else [])]
    return provider, engine, env, tuple(expected)


def _tests(name: str) -> list[str]:
    # The same-host path copies pages with a CUDA kernel: only builds that carry kernels run it.
    paged = name != "same-host" or fcuda.kernels()[0]
    return ["--tests", "throughput,oprate,rtt,read" + (",paged" if paged else "")]


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(PATHS))
def test_subcommand_form_on_gpu_0(name: str) -> None:
    _, engine, env, expected = _setup(name)
    server = ["server", "--gpus", "0", "--listen", "127.0.0.1:0", *engine]
    client = ["client", "--gpus", "0", "--connect", "{address}", *engine, *QUICK, *_tests(name)]
    report, _ = _run(server, client, env)
    _check(report, [0], *expected)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["tcp-staged", "shm-fi-hmem"])
def test_positional_form_on_gpu_0(name: str) -> None:
    _, engine, env, expected = _setup(name)
    server = ["0", "1", "--listen", "127.0.0.1:0", *engine]
    report, printed = _run(server, ["0", "1", "{address}", *engine, *QUICK, *_tests(name)], env, lines=2)
    _check(report, [0], *expected)
    address = printed[0].split()[1]
    assert printed[1] == f"connect with: fabric-debug 0 1 {address}", printed


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.timeout(600)
def test_two_gpus_pair_by_index() -> None:
    _, engine, env, expected = _setup("tcp-staged", gpus=2)
    server = ["0,1", "1", "--listen", "127.0.0.1:0", *engine]
    report, _ = _run(server, ["0,1", "1", "{address}", *engine, *QUICK, *_tests("tcp-staged")], env)
    _check(report, [0, 1], *expected)
