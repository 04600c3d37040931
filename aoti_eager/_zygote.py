"""One process that imports torch and Inductor once, and forks compile workers.

A worker of :mod:`aoti_eager._worker` started anew imports torch, Inductor and
Triton, then initializes much of Inductor within its first compile; many
workers started at once pay that side by side, and compete with the program
for the cores. Forked from this process, which imported once, they only
initialize CUDA and compile.

Beyond the imports it does once what each worker's first compile would do for
itself (:func:`_warm`): Inductor's code generators, its and Triton's
source hashes, the recorded precompiled-header checks, where an NVIDIA GPU is,
Triton's compiler and driver and CUDA's pattern tables, and last the sympy
modules that a first dynamic-shape compile imports: each a large share of a
forked worker's first compile where it is not done here. (Inductor's
whole-graph pattern tables are not built: a compile of one op no longer
builds them, :func:`aoti_eager.kernels.compile._without_whole_graph_patterns`.)
Background compiles start it at ``enable()`` (:func:`aoti_eager._worker.prestart`), so
that all this runs while the program builds its model, not after its first
miss; Triton's part runs in a thread beside the imports. A fork asked for
sooner stops the warming, and each worker does the rest for itself while
CUDA starts (:func:`warm_beside_cuda`).

The process never initializes CUDA, which a forked child could not use: it
asks NVML whether a GPU is there (``PYTORCH_NVML_BASED_CUDA_CHECK``), and stops
if an import initialized CUDA all the same. Its one thread, Triton's warming
beside the imports, is joined once they are done: no thread runs at a fork.
It serves one request at a time, on a Unix socket pair (one message each):

- ``{"fork": argv, "env": {...}, "main": "module:function"}`` with three
  file descriptors, the worker's stdin, stdout and stderr: a child calls the
  function (:func:`aoti_eager._worker.main`) with ``argv`` and ``env`` and
  exits with what it returns; the answer is ``{"pid": pid}``;
- ``{"wait": pid}``: the answer is ``{"returncode": code}``, as
  ``subprocess.Popen.wait`` gives it, once that child has ended (asked once
  it was killed or closed its stdout).

It ends when the socket closes: when the process that started it stops it or
exits; or when no request came for :data:`IDLE_SECONDS` and no child of its own runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from typing import Callable

_SERVE = "import sys; from aoti_eager._zygote import serve; sys.exit(serve())"
# The longest a request waits: the first waits for the imports, which take
# seconds, and up to a minute on a machine whose disk cache is cold.
ANSWER_SECONDS = 300.0
# A zygote holds torch and Inductor in memory: without a request for this long,
# and with no child of its own running, it ends.
IDLE_SECONDS = 60.0


class ForkedWorker:
    """A worker forked by a :class:`Zygote`: what :class:`aoti_eager._worker.Worker`
    uses of a ``subprocess.Popen``."""

    def __init__(self, zygote: Zygote, pid: int, stdin, stdout):
        self._zygote = zygote
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None

    def kill(self) -> None:
        if self.returncode is None:  # once reaped, its pid may be another process's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._zygote.wait(self.pid)
            except OSError:  # the zygote is gone, and the child's status with it
                self.returncode = -signal.SIGKILL
        return self.returncode


class Zygote:
    """The forking process, started with ``env`` and ``niceness`` added to
    this process's nice value; it ends after :data:`IDLE_SECONDS` without a
    request (see :meth:`ended_idle`). Thread-safe: requests take turns."""

    def __init__(self, env: dict[str, str], niceness: int = 0):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.settimeout(ANSWER_SECONDS)
        self._socket = ours
        self._lock = threading.Lock()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", _SERVE, str(theirs.fileno()), str(IDLE_SECONDS)], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**env, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"},
            )
        finally:
            theirs.close()
        if niceness:
            with contextlib.suppress(OSError):  # a priority is a preference, not a need
                # Added to the process's own (its main thread's): the calling thread may be niced already.
                os.setpriority(os.PRIO_PROCESS, self._process.pid, os.getpriority(os.PRIO_PROCESS, os.getpid()) + niceness)

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    @property
    def ended_idle(self) -> bool:
        """Whether it ended on its own, for want of requests."""
        return self._process.poll() == 0

    def fork(self, main: str, argv: list[str], env: dict[str, str], stderr: int) -> ForkedWorker:
        """A new worker calling ``main`` (``"module:function"``) with ``argv``,
        its stderr on the descriptor ``stderr``. Waits for the zygote's imports
        on first use. Raises OSError where the zygote cannot fork one."""
        stdin_read, stdin_write = os.pipe()
        stdout_read, stdout_write = os.pipe()
        try:
            answer = self._ask({"fork": argv, "env": env, "main": main}, [stdin_read, stdout_write, stderr])
        except BaseException:
            os.close(stdin_write)
            os.close(stdout_read)
            raise
        finally:
            os.close(stdin_read)
            os.close(stdout_write)
        return ForkedWorker(self, answer["pid"], os.fdopen(stdin_write, "w"), os.fdopen(stdout_read, "r"))

    def wait(self, pid: int) -> int:
        return self._ask({"wait": pid})["returncode"]

    def _ask(self, request: dict, fds: list[int] = ()) -> dict:
        with self._lock:
            try:
                socket.send_fds(self._socket, [json.dumps(request).encode()], list(fds))
                answer = self._socket.recv(1 << 16)
            except OSError:  # a late answer would answer the next request: this zygote is done
                self.close()
                raise
        if not answer:
            raise ConnectionError(f"the forking process ended (exit code {self._process.wait()})")
        answer = json.loads(answer)
        if "error" in answer:
            raise OSError(answer["error"])
        return answer

    def close(self) -> None:
        """Ends the zygote; the workers it forked go on until they are stopped."""
        self._socket.close()
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def _preload(requests: socket.socket) -> None:
    """Imports what a compile uses (a module that is not installed, Triton on a
    CPU-only machine, is left to the worker), with Triton's warming beside the
    imports in a thread, then warms Inductor until a request comes on
    ``requests``."""
    import torch

    until = lambda: select.select([requests], [], [], 0)[0] != []  # noqa: E731
    # Triton's source hash and first compile are mostly out of the GIL (hashing,
    # LLVM, ptxas), so beside the imports they make the zygote ready sooner.
    # Joined before anything else: no thread may run at a fork.
    beside = threading.Thread(target=_warm, args=(_TRITON_STEPS, until), name="aoti_eager-triton-warming")
    beside.start()
    try:
        for name in (
            "torch._dynamo", "torch.export", "torch._inductor.compile_fx", "torch._inductor.lowering",
            "torch._inductor.codegen.cpp_wrapper_cpu", "torch._inductor.codegen.cpp_wrapper_gpu",
            "torch._inductor.codegen.triton", "triton.compiler.compiler", "aoti_eager._worker",
            "aoti_eager.kernels.pipeline", "aoti_eager.kernels.dynamic", "aoti_eager.kernels.examples",
            "torch.export._trace", "torch.utils.cpp_extension", "torch._inductor.fx_passes.joint_graph",
            "torch._inductor.fx_passes.post_grad", "torch._inductor.fx_passes.mkldnn_fusion",
            "torch._inductor.fx_passes.quantization", "torch._inductor.fx_passes.freezing_patterns",
            "torch._inductor.runtime.caching", "torch._inductor.compiler_bisector", "torch._inductor.bounds",
            "torch.fx.experimental.validator", "sympy.combinatorics", "sympy.tensor.tensor",
        ):
            with contextlib.suppress(ImportError):
                __import__(name)
    finally:
        beside.join()
    _warm(_WARMING_STEPS, until)
    if torch.cuda.is_initialized():
        raise RuntimeError("importing torch and Inductor initialized CUDA: forked workers could not use it")


def _warm(steps: list[Step], until: Callable[[], bool]) -> None:
    """Takes ``steps`` of Inductor's start-up that a first compile pays, here
    once for every worker (each is cached for the process and its children),
    until ``until()``: a fork asked for does not wait for a step that each
    worker can take for itself, side by side. A step that fails is left to the
    workers."""
    for step in steps:
        if until():
            return
        with contextlib.suppress(Exception):
            step(until)


def warm_beside_cuda(device: str) -> None:
    """In a worker whose first entry is for ``device`` (a CUDA device): starts
    CUDA there in a thread, and meanwhile takes the warming steps that the
    zygote had not taken when it forked (all of them in a worker started
    anew): side by side, both take less than one after the other, since
    CUDA's start in many workers at once is slow. Header checks wait for
    the compile: they set environment variables, which CUDA's start reads."""
    import torch

    def start_cuda() -> None:
        with contextlib.suppress(Exception):  # the compile reports it
            torch.empty(1, device=device)  # a context is made at the first allocation

    context = threading.Thread(target=start_cuda, name="aoti_eager-cuda-start", daemon=True)
    context.start()
    _warm([*_TRITON_STEPS, *(s for s in _WARMING_STEPS if s is not _check_recorded_headers)], lambda: False)
    context.join()


def _set_triton_up(until: Callable[[], bool]) -> None:
    """Triton's first compile in a process sets its compiler up, many times
    what the next kernel takes; and its first kernel launcher builds the CUDA
    driver's C utilities, a share of a forked worker's first compile. Both
    done here for the first GPU, which NVML names without starting CUDA, in a
    scratch directory instead of Triton's cache (the loaded module stays);
    without an NVIDIA GPU, nothing. Sets no environment variable: it runs
    beside other threads."""
    global _triton_set_up
    target = _first_gpu_target()
    if target is None or _triton_set_up:
        return
    import triton
    import triton.language as tl
    from triton.compiler import ASTSource

    from aoti_eager.kernels.inductor import scratch

    @triton.jit
    def double(x, y, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + offsets, tl.load(x + offsets, mask=offsets < n) * 2, mask=offsets < n)

    source = ASTSource(double, signature={"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 128})
    # In this user's scratch, not in a compile_directory(): that also removes
    # what killed compiles left.
    with scratch.python_temporary_files(), tempfile.TemporaryDirectory() as directory, triton.knobs.cache.scope():
        triton.knobs.cache.dir = directory
        triton.compile(source, target=target)
        if until():
            return
        triton.runtime.driver.active.utils  # noqa: B018 - creating the driver builds and loads them
    _triton_set_up = True


_triton_set_up = False


def _cuda_pattern_tables(until: Callable[[], bool]) -> None:
    """Inductor's post-grad pattern tables, which CUDA compiles build once per
    process (:func:`aoti_eager.kernels.compile._without_whole_graph_patterns`),
    a share of a forked worker's first compile. Built with
    CPU tensors; where no NVIDIA GPU is, CPU compiles skip them, and so does
    this."""
    if _first_gpu_target() is not None:
        importlib.import_module("torch._inductor.fx_passes.post_grad").lazy_init()


@functools.cache
def _first_gpu_target():
    """Triton's compile target for the first NVIDIA GPU, as NVML describes it;
    None where there is none."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
        if (nvml.nvmlInit_v2() or nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle))
                or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor))):
            return None
    except (OSError, AttributeError):
        return None
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", major.value * 10 + minor.value, 32)


def _check_recorded_headers(until: Callable[[], bool]) -> None:
    from aoti_eager.kernels import compile
    from aoti_eager.kernels.inductor import headers

    headers.check_recorded(compile.compile_options, until)


Step = Callable[[Callable[[], bool]], object]
# Taken beside the zygote's imports: they import nothing of torch, which the
# imports are importing meanwhile (two threads importing each other's modules
# can deadlock), and set no environment variable.
_TRITON_STEPS: list[Step] = [
    lambda until: importlib.import_module("triton.compiler.compiler").triton_key(),
    _set_triton_up,
]
# The header checks first: a worker forked before them checks for itself
# before its compile, not beside CUDA's start as it
# takes the other steps (see warm_beside_cuda).
_WARMING_STEPS: list[Step] = [
    _check_recorded_headers,
    lambda until: importlib.import_module("torch._inductor.codegen.common").init_backend_registration(),
    lambda until: importlib.import_module("torch._inductor.codecache").torch_key(),
    _cuda_pattern_tables,
    # sympy's simplify() imports it within a process's first dynamic-shape
    # compile, a share of that compile. Last: only dynamic-shape compiles
    # need it.
    lambda until: importlib.import_module("sympy.physics.units"),
]


def serve() -> int:
    """The zygote's loop; runs in the process :class:`Zygote` starts."""
    requests = socket.socket(fileno=int(sys.argv[1]))
    requests.settimeout(float(sys.argv[2]))
    children: set[int] = set()
    try:
        _preload(requests)
    except Exception as e:  # noqa: BLE001 - every request is told why
        failure = f"the forking process could not import what a compile uses: {type(e).__name__}: {e}"
    else:
        failure = None
    # The child inherits only the forking thread: the threads CUDA's libraries
    # start are idle here, and the child initializes CUDA for itself.
    warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks", category=DeprecationWarning)
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(requests, 1 << 16, 3)
        except TimeoutError:
            if children:
                continue
            return 0  # idle: the next fork starts a new zygote
        except OSError:
            return 0
        if not message:
            return 0  # the parent closed its end, or exited
        request = json.loads(message)
        if failure is not None:
            answer = {"error": failure}
        elif "wait" in request:
            answer = {"returncode": os.waitstatus_to_exitcode(os.waitpid(request["wait"], 0)[1])}
            children.discard(request["wait"])
        else:
            answer = {"pid": _fork(requests, request, fds)}
            children.add(answer["pid"])
        for fd in fds:
            os.close(fd)
        requests.send(json.dumps(answer).encode())


def _fork(requests: socket.socket, request: dict, fds: list[int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        requests.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        threads = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
        if threads:  # Inductor read it when this process imported it
            import torch._inductor.config

            torch._inductor.config.compile_threads = int(threads)
        sys.argv = ["aoti_eager worker", *request["fork"]]
        module, function = request["main"].split(":")
        code = getattr(importlib.import_module(module), function)() or 0
    except BaseException:  # noqa: BLE001 - the parent reads the last line of stderr
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
