"""The provider's CUDA work runs on the GPU the engine serves, not on device 0.

libfabric's ``shm`` with FI_HMEM makes its host registrations, device copies and CUDA IPC opens
through the CUDA runtime, in whatever context is current on the calling thread (the engine's
worker); a thread without one gets device 0's. So the worker makes a GPU's primary context
current on itself: ``cuda_device``'s before it opens the provider, else the first GPU whose
memory it registers. Otherwise an engine of a process on GPU 1 creates a context on device 0
and queues its copies there, behind whatever device 0 runs (another rank's kernels), outside
the streams its application waits for.

Each case runs in a fresh process that uses GPU 1 only, so nothing else touched device 0. Needs
two GPUs and a CUDA-enabled libfabric (``LD_LIBRARY_PATH=.libfabric-cuda/lib``); skips otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]

TESTS = Path(__file__).resolve().parents[1]


def device0_on_the_way(cuda_device: int | None, busy_device0: bool) -> dict[str, object]:
    """In a fresh process that uses GPU 1 only: two shm FI_HMEM engines (``cuda_device`` as
    given) write GPU 1 memory to GPU 1 memory with an immediate, through the provider. Returns
    whether device 0's primary context was active at each step, whether the bytes arrived, and
    (``busy_device0``: a kernel spins for seconds on device 0's legacy default stream while the
    writes run) whether device 0 was still busy when the bytes were in place."""
    import ctypes
    import time

    import fabric_lib
    import torch

    driver = ctypes.CDLL("libcuda.so.1")
    assert driver.cuInit(0) == 0

    def device0_active() -> bool:
        flags, active = ctypes.c_uint(), ctypes.c_int()
        assert driver.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0
        return bool(active.value)

    torch.cuda.set_device(1)
    n = 4 << 20
    src = (torch.arange(n, dtype=torch.int64, device="cuda:1") % 251).to(torch.uint8)
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda:1")
    torch.cuda.synchronize(1)
    steps = {"before": device0_active()}

    # Named only when set: the unset case also runs against builds that predate the option.
    named: dict[str, Any] = {} if cuda_device is None else {"cuda_device": cuda_device}

    def engine() -> fabric_lib.TransferEngine:
        return fabric_lib.TransferEngine(
            "shm", poll_mode="adaptive", gpu_network=True, force_network=True, transfer_timeout=30.0, **named
        )

    with engine() as a, engine() as b:
        if not (a.gpu_network and b.gpu_network):
            return {"skip": "this libfabric's shm has no FI_HMEM (scripts/build_libfabric.sh)"}
        steps["opened"] = device0_active()
        s = a.register_tensor(src)
        d = b.register_tensor(dst)
        if d.registration in ("same-host", "staged"):
            return {"skip": f"shm cannot register CUDA memory here ({d.registration})"}
        steps["registered"] = device0_active()
        counter = b.imm_counter(5)
        if busy_device0:
            with torch.cuda.device(0):
                torch.cuda._sleep(10_000_000_000)  # about 5 s at 2 GHz, on the legacy stream
        for _ in range(3):
            a.submit_write(s, d.descriptor, imm=5).result(timeout=30)
        counter.wait(3, timeout=30)
        until = time.monotonic() + 30
        while not (arrived := bool(torch.equal(src, dst))) and time.monotonic() < until:
            time.sleep(0.01)
        device0_busy = busy_device0 and not torch.cuda.default_stream(0).query()
        steps["written"] = device0_active()
    return {"steps": steps, "arrived": arrived, "device0_busy_at_arrival": device0_busy}


def _in_a_fresh_process(cuda_device: int | None, busy_device0: bool = False) -> dict[str, object]:
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA: the skip says so
        gpus = 0
    if gpus < 2:
        pytest.skip("needs two CUDA GPUs")
    code = (
        "import json; from gpu.test_provider_cuda_context import device0_on_the_way as f; "
        f"print('RESULT', json.dumps(f({cuda_device!r}, {busy_device0!r})))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, object] = json.loads(line.removeprefix("RESULT "))
    if "skip" in result:
        pytest.skip(str(result["skip"]))
    assert result["arrived"], "the bytes did not arrive"
    return result


def test_an_engine_given_its_gpu_never_touches_device0() -> None:
    steps = _in_a_fresh_process(1)["steps"]
    assert steps == {"before": False, "opened": False, "registered": False, "written": False}, steps


def test_without_cuda_device_the_first_registered_gpu_does_the_copies() -> None:
    """No ``cuda_device``: the provider may touch device 0 while it opens, but from the first
    registration on its copies run on GPU 1, so they do not wait behind device 0's work."""
    result = _in_a_fresh_process(None, busy_device0=True)
    assert result["device0_busy_at_arrival"], "the copies waited for device 0's kernel"
