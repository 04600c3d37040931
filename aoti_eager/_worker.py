"""Compiles requests (kernels/request.py) in worker processes.

Prewarming and background compiles run their requests in child processes
(:data:`COMMAND` with the cache directory): a compiler that crashes or runs
out of memory then takes down only the child. A child rebuilds each call from
its signature and compiles the requested kernel through the pipeline
(kernels/pipeline.py), validated and published as the miss of a real call
would be: a dynamic-shape kernel is checked at the ends of the span of sizes
recorded for it, and a kernel whose runtime ints fail leaves one with their
values compiled in.

A child compiles one entry after another (entries as JSON lines on its stdin,
outcomes as JSON lines on its stdout), so that only its first entry pays for
starting Python, torch and Inductor, which takes longer than a further
signature's whole compile (BENCHMARKS.md, "Prewarm"). A child that dies takes
only its current entry with it; the next entry starts a new one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from aoti_eager import _mechanism, _ops, _zygote, settings
from aoti_eager._planner import Planner
from aoti_eager.cache.entry_store import Entry, EntryStore
from aoti_eager.kernels import CallSignature, CompileRequest
from aoti_eager.kernels.dynamic import ShapeFamily, tensor_args
from aoti_eager.kernels.examples import eager_accepted, example_arguments
from aoti_eager.kernels.pipeline import NotCompiled, Published
from aoti_eager.kernels.pipeline import Outcome as PipelineOutcome
from aoti_eager.kernels.signature import qualified_name
from aoti_eager.manifest import regions_note

log = logging.getLogger("aoti_eager")

# Memory one compile may take, to size the default number of jobs.
_BYTES_PER_JOB = 2 << 30


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_jobs() -> int:
    """One job per core, as many as memory allows at about 2 GiB a compile."""
    cores = _cores()
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return cores
    return max(1, min(cores, available // _BYTES_PER_JOB))


def compile_threads(jobs: int) -> int:
    """Inductor's compile threads for each of ``jobs`` workers: their share of
    the cores. Inductor's default is a pool of one process per core (up to
    32), each importing torch, in every worker: 16 workers on a 16-core host
    would start 256 of them, which slow every first compile."""
    return max(1, _cores() // max(1, jobs))


# The command that runs a worker (tests replace it to make workers fail).
# Not ``-m aoti_eager._worker``: the package imports this module first, and runpy warns.
_MAIN = [sys.executable, "-c", "import sys; from aoti_eager._worker import main; sys.exit(main())"]
COMMAND = _MAIN


@dataclass
class Outcome:
    """What became of one entry: ``compiled``, ``cached`` (someone else
    compiled it), ``eager`` (decided eager, see ``reason``) or ``failed``."""

    status: str
    reason: str | None = None
    seconds: float = 0.0


def warm(request: CompileRequest, root: Path, fleet_wait: float = 0.0) -> Outcome:
    """Compiles ``request`` into the cache at ``root``, checked against eager
    and published as a miss of its call would be; runs in the worker
    process. ``fleet_wait``: how long to wait for another machine's compile
    of it (the fleet cache's lock)."""
    op = _ops.overload_named(request.op)
    device = torch.device(request.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    args = eager_accepted(op, example_arguments(request.signature, device))
    signature = CallSignature.of(op, request.device, args)
    if request.runtime_ints:
        signature = signature.with_runtime_ints(request.runtime_ints)
    if (request.family.entry_key(signature) if request.family else signature.key) != request.key:
        return Outcome("failed", "the rebuilt call does not produce the recorded cache entry")
    cache = _mechanism.open_cache(root, device, None, wait=fleet_wait)
    seen = [[t.sizes for t in tensor_args(end)] for end in request.family.span_ends(signature, request.seen or [])] if request.family else []
    outcome = _compile_unless_published(op, request.key, signature, cache, request.family, seen)
    if isinstance(outcome, Entry):
        return Outcome("cached" if outcome.library else "eager", outcome.reason)
    if isinstance(outcome, NotCompiled) and signature.runtime_arguments and not (outcome.eager_raised or outcome.any_values):
        # No kernel takes these numbers at run time: the miss compiles their values in next.
        constant = signature.with_constant_numbers()
        _compile_unless_published(op, constant.key, constant, cache, None, [])
    _mechanism.keep_size_limit(root)
    published = cache.lookup(request.op, request.key)
    seconds = outcome.seconds if isinstance(outcome, Published) else 0.0
    if published is None:
        if isinstance(outcome, Published):
            # Export fixed a size the family moves (a 1 among its sizes, say): the parent's
            # shapes of this family compile alone from now on, and this one is in the cache.
            return Outcome("failed", "no dynamic-shape kernel for the family: this shape was compiled alone", seconds)
        return Outcome("failed", outcome.reason, seconds)
    if published.library is None:
        return Outcome("eager", published.reason)
    return Outcome("compiled", seconds=seconds)


def _compile_unless_published(
    op: torch._ops.OpOverload, key: str, signature: CallSignature, cache: EntryStore, family: ShapeFamily | None,
    seen: list[list[tuple[int, ...]]],
) -> PipelineOutcome | Entry:
    """Compiles the kernel of ``family`` (None: its own) for ``signature``
    under its locks, unless the cache holds the entry ``key``: that entry then."""
    name = qualified_name(op)
    with cache.lock_signature(name, signature.key, timeout=settings.lock_timeout.get()), _mechanism.compile_lock:
        if (published := cache.lookup(name, key)) is not None:
            return published
        if (why_not := _mechanism.cannot_compile(cache)) is not None:
            return NotCompiled(why_not)
        if (recorded := _mechanism.recorded_verdict(cache, name, Planner.verdict_keys(signature))) is not None:
            return NotCompiled(recorded.reason)
        return _mechanism.compile_kernel(op, signature, cache, family, seen)[0]


# Workers running now, so that an interrupted parent can stop them.
_running: set[subprocess.Popen | _zygote.ForkedWorker] = set()
_running_lock = threading.Lock()
# Set at exit (see shutdown()): no worker starts any more.
stopped = False
# Forks workers while any runs (see _fork); under _running_lock. Once a
# zygote fails, this process starts its workers anew: the next would fail too.
_forking: _zygote.Zygote | None = None
_forking_failed = False


class Worker:
    """A child process that compiles entries into the cache at ``root``, one
    at a time; started on the first entry, and again after it dies. Not
    thread-safe: one thread drives a worker.

    ``remote``: the fleet cache's URL that the child's misses ask and its
    compiles publish to, as the parent's would (``enable(remote=...)``);
    None: ``$AOTI_EAGER_REMOTE``, which the child inherits, if set.
    ``niceness``: added to the child's (and so its compilers') nice value.
    ``jobs``: workers compiling at once, which share the cores
    (:func:`compile_threads`); ``TORCHINDUCTOR_COMPILE_THREADS``, where set,
    is the user's choice instead."""

    def __init__(self, root: Path, remote: str | None = None, niceness: int = 0, jobs: int = 1):
        self.root = root
        self.remote = remote
        self.niceness = niceness
        self.jobs = jobs
        self._process: subprocess.Popen | None = None
        self._stderr = None

    @property
    def running(self) -> bool:
        """Whether the child is up (the next entry pays no start-up)."""
        return self._process is not None

    def _start(self) -> subprocess.Popen:
        env = _environment(self.jobs)
        if self.remote is not None:
            env[settings.remote.name] = self.remote
        # A file, not a pipe: a compiler's chatter must not fill a pipe that no
        # one reads while the child waits for its next entry. Where the parent
        # logs at DEBUG, the child logs too, to the parent's stderr.
        verbose = log.isEnabledFor(logging.DEBUG)
        self._stderr = None if verbose else tempfile.TemporaryFile(prefix="aoti_eager-worker-")
        argv = [str(self.root), *(["--log"] if verbose else [])]
        with _running_lock:
            if stopped:
                raise ProcessLookupError("the process is exiting")
            self._process = _fork(argv, env, self._stderr, self.niceness) or subprocess.Popen(
                [*COMMAND, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env,
            )
            _running.add(self._process)
        if self.niceness:
            with contextlib.suppress(OSError):  # a priority is a preference, not a need
                # Added to the process's own (its main thread's): the calling thread may be niced already.
                os.setpriority(os.PRIO_PROCESS, self._process.pid, os.getpriority(os.PRIO_PROCESS, os.getpid()) + self.niceness)
        return self._process

    def compile(self, entry: CompileRequest, timeout: float | None = None) -> Outcome:
        """The outcome of ``entry``; never raises for what happens in the child
        (a crash or timeout is a ``failed`` outcome, and the child is gone)."""
        try:
            process = self._process if self._process is not None else self._start()
        except ProcessLookupError as e:
            return Outcome("failed", str(e))
        try:
            process.stdin.write(json.dumps(entry.to_json()) + "\n")
            process.stdin.flush()
            ready, _, _ = select.select([process.stdout], [], [], timeout)
            line = process.stdout.readline() if ready else None
        except (BrokenPipeError, ValueError):  # the child died, or was stopped
            line = ""
        if line:
            try:
                return Outcome(**json.loads(line))
            except (ValueError, TypeError):
                self.close()
                return Outcome("failed", f"the compiling process answered {line.strip()[:300]!r}")
        if line is None:
            self.close()
            return Outcome("failed", f"the compile took over {timeout:.0f} s and was stopped")
        return self._died()

    def _died(self) -> Outcome:
        process = self._process
        returncode = process.wait()
        last = "its output went to this process's stderr"
        if self._stderr is not None:
            self._stderr.seek(0)
            last = (self._stderr.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
        self.close()
        if stopped:
            return Outcome("failed", "the process is exiting")
        if returncode < 0:
            name = signal.Signals(-returncode).name
            hint = " (out of memory?)" if name == "SIGKILL" else ""
            return Outcome("failed", f"the compiling process died of {name}{hint}")
        return Outcome("failed", f"the compiling process exited with code {returncode}: {last[:300]}")

    def close(self) -> None:
        """Stops the child (it holds no lock between entries)."""
        process, self._process = self._process, None
        if process is None:
            return
        with _running_lock:
            _running.discard(process)
        process.kill()
        process.wait()
        _stop_forking_if_idle()
        for stream in (process.stdin, process.stdout, self._stderr):
            if stream is None:
                continue
            try:
                stream.close()
            except (OSError, BrokenPipeError):
                pass


def _environment(jobs: int) -> dict[str, str]:
    """A worker's environment: this process's, less the recording (the parent
    records), with its share of the cores for Inductor's compile threads, and
    CUDA contexts of one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS``,
    unless set): a worker runs one stream, and the driver creates contexts
    one at a time: processes forked at once get their contexts sooner with
    one queue than with CUDA's default of 8."""
    env = {k: v for k, v in os.environ.items() if k != settings.record.name}
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(compile_threads(jobs)))
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    return env


def _may_fork() -> bool:
    return COMMAND is _MAIN and not _forking_failed and settings.fork_workers.get()


def prestart(jobs: int, niceness: int) -> None:
    """Starts the zygote that workers fork from, if they will be forked and it
    is not running: its imports then run while this process goes on. Returns
    at once where a worker is being forked (a zygote is running then), which
    can take as long as the zygote's imports."""
    if not _running_lock.acquire(blocking=False):
        return
    try:
        if not stopped and _may_fork():
            with contextlib.suppress(OSError):  # the first fork reports it
                _zygote_running(_environment(jobs), niceness)
    finally:
        _running_lock.release()


def _zygote_running(env: dict[str, str], niceness: int) -> _zygote.Zygote:
    """The zygote, started anew where there is none or it ended. Under _running_lock."""
    global _forking
    if _forking is None or not _forking.alive:
        if _forking is not None:
            _forking.close()
        _forking = None
        _forking = _zygote.Zygote(env, niceness)
    return _forking


def _fork(argv: list[str], env: dict[str, str], stderr, niceness: int) -> _zygote.ForkedWorker | None:
    """A worker forked from the zygote (see :mod:`aoti_eager._zygote`); None
    where workers start anew: the setting is off, a test replaced
    :data:`COMMAND`, or the zygote fails. Under _running_lock."""
    global _forking, _forking_failed
    if not _may_fork():
        return None
    # sys.__stderr__: a compile of this process may have swapped sys.stderr for a buffer (kernels/quiet.py).
    stderr_fd = stderr.fileno() if stderr is not None else sys.__stderr__.fileno()
    try:
        try:
            return _zygote_running(env, niceness).fork(f"{__name__}:main", argv, env, stderr_fd)
        except OSError:
            if _forking is None or not _forking.ended_idle:
                raise
        # It ended for want of requests just as this one came: a new one.
        return _zygote_running(env, niceness).fork(f"{__name__}:main", argv, env, stderr_fd)
    except OSError as e:
        log.info("aoti_eager: compile workers start anew, each importing torch: %s", e)
        if _forking is not None:
            _forking.close()
        _forking, _forking_failed = None, True
        return None


def _stop_forking_if_idle() -> None:
    """Ends the zygote once no worker runs: it holds torch and Inductor in memory."""
    global _forking
    with _running_lock:
        idle, _forking = (_forking, None) if not _running else (None, _forking)
    if idle is not None:
        idle.close()


def stop_all() -> None:
    """Kills every running worker; what they leave is cleaned up by the next compile of their op."""
    with _running_lock:
        for process in _running:
            process.kill()


def shutdown() -> None:
    """Kills every running worker and starts no more (at exit)."""
    global stopped, _forking
    with _running_lock:
        stopped = True
        forking, _forking = _forking, None
    stop_all()
    if forking is not None:
        forking.close()


def main() -> int:
    root = Path(sys.argv[1])
    if "--log" in sys.argv[2:]:
        logging.basicConfig(format=f"%(relativeCreated)8.0f ms worker {os.getpid()}: %(message)s")
        log.setLevel(logging.INFO)
    # Outcomes go to the parent on a stream of their own; whatever else
    # writes to stdout (a compiler, a print in torch) lands on stderr.
    outcomes = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    cuda_started = False
    for line in sys.stdin:
        data = json.loads(line)
        if "region" in data:
            # A region's call can be rebuilt only beside its model, never here.
            outcomes.write(json.dumps(asdict(Outcome("failed", regions_note(1)))) + "\n")
            outcomes.flush()
            continue
        entry = CompileRequest.from_json(data)
        try:
            if entry.device.startswith("cuda") and not cuda_started:
                cuda_started = True
                _zygote.warm_beside_cuda(entry.device)
            outcome = warm(entry, root, fleet_wait=settings.lock_timeout.get())
        except Exception as e:  # noqa: BLE001 - reported to the parent as the reason
            outcome = Outcome("failed", f"{type(e).__name__}: {e}")
        log.info("aoti_eager: %s on %s: %s", entry.op, entry.device, outcome.status)
        outcomes.write(json.dumps(asdict(outcome)) + "\n")
        outcomes.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
