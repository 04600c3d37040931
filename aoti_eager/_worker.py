"""Compiles manifest entries in worker processes.

Prewarming and background compiles run their entries in child processes
(:data:`COMMAND` with the cache directory): a compiler that crashes or runs
out of memory then takes down only the child. A child rebuilds each call from
its signature and makes it with the op enabled, so the entry is compiled,
validated and published exactly as the miss of a real call would be. A
dynamic-shape entry's call comes after calls at the ends of the span of sizes
recorded for it, made with ``compile="never"``: the op's shape family then
knows the shapes the recording process had seen, and the call compiles the
dynamic kernel compiled there, under the same key. Likewise an entry whose
ints are runtime numbers (the recording process saw them move) comes after a
call with each of them one higher, made with ``compile="never"``: the
override then sees them move too.

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

from aoti_eager import _zygote, settings
from aoti_eager.manifest import ManifestEntry

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
    would start 256 of them, and their first compiles take several times as
    long (BENCHMARKS.md, "A model's first forward")."""
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


def warm(entry: ManifestEntry, root: Path) -> Outcome:
    """Makes ``entry``'s call with its op enabled; runs in the worker process."""
    import torch

    import aoti_eager
    from aoti_eager import _ops
    from aoti_eager.cache import KernelCache
    from aoti_eager.kernels.compile import call_op, compile_options
    from aoti_eager.kernels.dynamic import ShapeFamily
    from aoti_eager.kernels.examples import eager_accepted, example_arguments, with_runtime_ints_moved
    from aoti_eager.kernels.signature import CallSignature
    from aoti_eager.kernels.toolchain import environment_name

    # A worker waits for another machine's compile of the entry (a user's call would run eagerly).
    aoti_eager._runtime.fleet_wait = settings.lock_timeout.get()
    op = _ops.overload_named(entry.op)
    device = torch.device(entry.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    args = eager_accepted(op, example_arguments(entry.signature, device))
    signature = CallSignature.of(op, entry.device, args)
    moved = with_runtime_ints_moved(entry.signature, args)
    try:
        if entry.dynamic is not None or moved is not None:
            aoti_eager.enable([op], devices=[entry.device], cache_dir=root, record=None, compile="never")
        if entry.dynamic is not None:
            family = ShapeFamily(tuple(tuple(dims) for dims in entry.dynamic["dims"]), general=entry.dynamic.get("general", False))
            aoti_eager._runtime.plan(entry.key, family)  # the runtime enable() installs
            for seen in family.span_ends(signature, entry.dynamic["seen"]):
                call_op(op, eager_accepted(op, list(seen.args)))
        if moved is not None:
            with contextlib.suppress(Exception):  # eager may refuse the value: the override has seen it
                call_op(op, moved)
        aoti_eager.enable([op], devices=[entry.device], cache_dir=root, record=None)
        call_op(op, args)
        stats = aoti_eager.stats()[entry.op]
    finally:
        aoti_eager.disable()
        # Each entry is rebuilt alone: shapes this worker saw for an earlier entry would make a family.
        aoti_eager._runtime.forget()
    cache = KernelCache(root, environment_name(device, compile_options(device.type)))
    published = cache.lookup(entry.op, entry.key)
    if published is None:
        reason = stats["fallback_reason"] or "the rebuilt call did not produce the recorded cache entry"
        if entry.dynamic is not None and stats["compiles"] and cache.lookup(entry.op, signature.key):
            # Export fixed a size the family moves (a 1 among its sizes, say): the parent's
            # shapes of this family compile alone from now on, and this one is in the cache.
            reason = "no dynamic-shape kernel for the family: this shape was compiled alone"
        return Outcome("failed", reason, seconds=stats["compile_seconds"])
    if published.library is None:
        return Outcome("eager", published.reason)
    return Outcome("compiled" if stats["compiles"] else "cached", seconds=stats["compile_seconds"])


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
                os.setpriority(os.PRIO_PROCESS, self._process.pid, os.getpriority(os.PRIO_PROCESS, 0) + self.niceness)
        return self._process

    def compile(self, entry: ManifestEntry, timeout: float | None = None) -> Outcome:
        """The outcome of ``entry``; never raises for what happens in the child
        (a crash or timeout is a ``failed`` outcome, and the child is gone)."""
        try:
            process = self._process if self._process is not None else self._start()
        except ProcessLookupError as e:
            return Outcome("failed", str(e))
        try:
            process.stdin.write(json.dumps(asdict(entry)) + "\n")
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
    one at a time: processes forked at once get their contexts in about half
    the time with one queue than with CUDA's default of 8 (BENCHMARKS.md, "A
    model's first forward")."""
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
    stderr_fd = stderr.fileno() if stderr is not None else sys.stderr.fileno()
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
        entry = ManifestEntry(**json.loads(line))
        try:
            if entry.device.startswith("cuda") and not cuda_started:
                cuda_started = True
                _zygote.warm_beside_cuda(entry.device)
            outcome = warm(entry, root)
        except Exception as e:  # noqa: BLE001 - reported to the parent as the reason
            outcome = Outcome("failed", f"{type(e).__name__}: {e}")
        log.info("aoti_eager: %s on %s: %s", entry.op, entry.device, outcome.status)
        outcomes.write(json.dumps(asdict(outcome)) + "\n")
        outcomes.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
