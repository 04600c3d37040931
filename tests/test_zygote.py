"""Workers forked from one process that imported torch and Inductor once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import aoti_eager
from aoti_eager import _worker, _zygote
from aoti_eager.kernels import CompileRequest

# An entry a worker refuses at once: it shows that the worker ran, without a compile.
UNKNOWN_OP = CompileRequest("aten::no_such_op.default", "cpu", "key", [])


@pytest.fixture
def workers(monkeypatch):
    """The workers of this test alone, and their zygote."""
    monkeypatch.setattr(_worker, "_running", set())
    monkeypatch.setattr(_worker, "_forking", None)
    monkeypatch.setattr(_worker, "_forking_failed", False)
    started: list[_worker.Worker] = []
    yield lambda **kwargs: started.append(_worker.Worker(**kwargs)) or started[-1]
    for worker in started:
        worker.close()
    if _worker._forking is not None:
        _worker._forking.close()


def test_workers_are_forked_from_one_process_that_ends_with_the_last_worker(workers, tmp_path):
    first, second = workers(root=tmp_path), workers(root=tmp_path, niceness=3)
    outcomes = [first.compile(UNKNOWN_OP, timeout=120), second.compile(UNKNOWN_OP, timeout=120)]
    assert all(o.status == "failed" and "no_such_op" in o.reason for o in outcomes), outcomes
    assert all(isinstance(w._process, _zygote.ForkedWorker) for w in (first, second))
    assert os.getpriority(os.PRIO_PROCESS, second._process.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 3
    forking = _worker._forking
    first.close()
    assert _worker._forking is forking and forking.alive
    second.close()
    assert _worker._forking is None and not forking.alive


def test_a_forked_worker_that_dies_is_reported_as_a_new_one_would_be(workers, tmp_path):
    worker = workers(root=tmp_path)
    assert worker.compile(UNKNOWN_OP, timeout=120).status == "failed"
    os.kill(worker._process.pid, signal.SIGKILL)
    outcome = worker.compile(UNKNOWN_OP, timeout=120)
    assert outcome.status == "failed" and "died of SIGKILL" in outcome.reason, outcome
    assert worker.compile(UNKNOWN_OP, timeout=120).reason != outcome.reason  # the next entry: a new worker


@pytest.mark.parametrize("how", ["a zygote that fails", "the setting off"])
def test_without_a_zygote_workers_start_anew(workers, tmp_path, monkeypatch, how):
    if how == "the setting off":
        monkeypatch.setenv("AOTI_EAGER_FORK_WORKERS", "0")
    else:
        monkeypatch.setattr(_zygote, "_SERVE", "raise SystemExit(3)")
    for _ in range(2):  # a zygote that failed is not tried again
        worker = workers(root=tmp_path)
        outcome = worker.compile(UNKNOWN_OP, timeout=120)
        assert outcome.status == "failed" and "no_such_op" in outcome.reason, outcome
        assert isinstance(worker._process, subprocess.Popen) and _worker._forking is None
    assert _worker._forking_failed == (how == "a zygote that fails")


def test_background_compiles_start_the_zygote_at_enable(workers, tmp_path):
    try:
        aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=tmp_path, compile="background")
    finally:
        aoti_eager.disable()
    forking = _worker._forking
    assert forking is not None and forking.alive
    aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=tmp_path, compile="background")  # not a second one
    aoti_eager.disable()
    assert _worker._forking is forking
    worker = workers(root=tmp_path)
    assert "no_such_op" in worker.compile(UNKNOWN_OP, timeout=120).reason
    assert isinstance(worker._process, _zygote.ForkedWorker) and _worker._forking is forking


def test_enable_does_not_wait_for_a_fork_in_progress(workers, tmp_path):
    enabling = threading.Thread(target=aoti_eager.enable, args=(["aten::abs"],),
                                kwargs=dict(devices=["cpu"], cache_dir=tmp_path, compile="background"))
    with _worker._running_lock:  # as _fork holds it while the zygote imports
        enabling.start()
        enabling.join(timeout=60)
        assert not enabling.is_alive()
    aoti_eager.disable()
    assert _worker._forking is None  # the first miss starts it


@pytest.mark.parametrize("when", ["before the next fork", "as the next fork asks"])
def test_an_idle_zygote_ends_and_the_next_worker_forks_from_a_new_one(workers, tmp_path, monkeypatch, when):
    monkeypatch.setattr(_zygote, "IDLE_SECONDS", 0.5)
    _worker.prestart(jobs=1, niceness=0)
    idle = _worker._forking
    deadline = time.monotonic() + 120  # its imports come first
    while idle.alive and time.monotonic() < deadline:
        time.sleep(0.2)
    assert idle.ended_idle
    if when == "as the next fork asks":  # it seemed alive when the fork was asked for
        monkeypatch.setattr(_zygote.Zygote, "alive", property(lambda self: self._process.returncode is None))
        idle._process.returncode = None
    monkeypatch.setattr(_zygote, "IDLE_SECONDS", 60.0)
    worker = workers(root=tmp_path)
    assert "no_such_op" in worker.compile(UNKNOWN_OP, timeout=120).reason
    assert isinstance(worker._process, _zygote.ForkedWorker)
    assert _worker._forking is not idle and not _worker._forking_failed


def test_a_fork_asked_for_stops_the_warming(monkeypatch):
    steps = []
    monkeypatch.setattr(_zygote, "_WARMING_STEPS", [lambda until: steps.append("first"), lambda until: steps.append("second")])
    _zygote._warm(_zygote._WARMING_STEPS, until=lambda: True)
    assert steps == []
    _zygote._warm(_zygote._WARMING_STEPS, until=lambda: len(steps) == 1)
    assert steps == ["first"]


_PRELOAD_WITH_A_SLOW_TRITON_STEP = """
import socket, threading, time
from aoti_eager import _zygote
taken = []
_zygote._TRITON_STEPS[:] = [lambda until: time.sleep(3) or taken.append("triton")]
_zygote._WARMING_STEPS[:] = [lambda until: taken.append("after")]
requests, asking = socket.socketpair()
_zygote._preload(requests)
assert taken == ["triton", "after"], taken
assert threading.active_count() == 1, threading.enumerate()
"""


def test_the_zygote_joins_its_triton_warming_before_the_rest_and_any_fork():
    """Triton's warming runs in a thread beside the imports; once they are
    done, it is waited for: no thread may run at a fork."""
    out = subprocess.run([sys.executable, "-c", _PRELOAD_WITH_A_SLOW_TRITON_STEP], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


_COMPILES_AFTER_THE_WARMING = """
import socket, sys, torch, aoti_eager
from aoti_eager import _zygote
if sys.argv[2] == "without the last step":
    _zygote._WARMING_STEPS.pop()
requests, asking = socket.socketpair()  # no request comes: every step runs
_zygote._preload(requests)
before = set(sys.modules)
with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=sys.argv[1]):
    for n in (7, 9):  # a static kernel, then a dynamic-shape one (BERT's position embeddings)
        torch.add(torch.randn(2, n, 8), torch.randn(1, n, 8))
    assert aoti_eager.stats()["aten::add.Tensor"]["compiles"] == 2
print(sorted(name for name in set(sys.modules) - before if name.split(".")[0] == "sympy"))
"""


def test_a_dynamic_shape_compile_after_the_warming_imports_nothing_of_sympy(tmp_path):
    """sympy's simplify() imports its units within a process's first
    dynamic-shape compile (0.29-0.41 s of a forked worker's on H100 hosts): the
    zygote's warming imports them, and every module of sympy a compile uses."""
    def imported(how: str) -> str:
        out = subprocess.run([sys.executable, "-c", _COMPILES_AFTER_THE_WARMING, str(tmp_path / how), how],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout.strip().splitlines()[-1]

    assert imported("with every step") == "[]"
    assert "sympy.physics.units" in imported("without the last step")


_CUDA_WARMING = """
import os, sys, torch
from torch._inductor.fx_passes import post_grad
from triton.runtime import driver
import aoti_eager
from aoti_eager import _zygote
assert _zygote._first_gpu_target() is not None
_zygote._set_triton_up(lambda: False)
_zygote._cuda_pattern_tables(lambda: False)
assert not torch.cuda.is_initialized()
assert not os.path.exists(os.environ["TRITON_CACHE_DIR"]) or not os.listdir(os.environ["TRITON_CACHE_DIR"])
tables, utils = post_grad.lazy_init.cache_info().misses, driver.active.utils
child = os.fork()
if child == 0:
    x = torch.randn(40, device="cuda")
    with aoti_eager.enabled(["aten::sin"], devices=["cuda"], cache_dir=sys.argv[1]):
        result = torch.sin(x)
        compiles = aoti_eager.stats()["aten::sin"]["compiles"]
    torch.testing.assert_close(result, x.sin())
    assert compiles == 1 and post_grad.lazy_init.cache_info().misses == tables and driver.active.utils is utils
    os._exit(0)
assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_the_cuda_warming_starts_no_cuda_and_serves_a_forked_compile(tmp_path):
    """Triton's compiler and driver and CUDA's pattern tables, set up without
    CUDA (a forked child could not use it) and outside Triton's cache; a
    forked worker's CUDA compile then sets up neither again."""
    env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    subprocess.run([sys.executable, "-c", _CUDA_WARMING, str(tmp_path / "cache")], env=env, check=True, timeout=300)


_WARMING_BESIDE_CUDA = """
import os, sys, traceback, torch
from torch._inductor.fx_passes import post_grad
import aoti_eager
from aoti_eager import _zygote
assert not torch.cuda.is_initialized()
child = os.fork()
if child == 0:
    try:
        _zygote.warm_beside_cuda("cuda")
        assert torch.cuda.is_initialized() and _zygote._triton_set_up and post_grad.lazy_init.cache_info().misses == 1
        x = torch.randn(40, device="cuda")
        with aoti_eager.enabled(["aten::sin"], devices=["cuda"], cache_dir=sys.argv[1]):
            result = torch.sin(x)
            compiles = aoti_eager.stats()["aten::sin"]["compiles"]
        torch.testing.assert_close(result, x.sin())
        assert compiles == 1
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    os._exit(0)
assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_a_worker_warms_up_beside_cudas_start_and_then_compiles(tmp_path):
    """A worker forked before the zygote's warming ended takes the steps left
    while CUDA starts in a thread; its compile then runs as any other."""
    env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    out = subprocess.run([sys.executable, "-c", _WARMING_BESIDE_CUDA, str(tmp_path / "cache")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
