"""Background compiles: one queue of jobs served by a pool of threads, kept
while jobs keep coming. A job says where its compile runs:

- :class:`InWorker`, an op's: a worker process (see :mod:`aoti_eager._worker`)
  rebuilds the call from its request; each thread drives a worker of its own,
  started at its first such job;
- :class:`Here`, a region's: in this process, where its module is, which a
  worker could not rebuild (Inductor being not thread-safe, such compiles
  take ``_mechanism.compile_lock`` and run one at a time).

Each job starts a thread, up to ``AOTI_EAGER_BACKGROUND_JOBS`` of them
(default: as many as ``prewarm`` runs on this machine), so that a model's
first forward compiles its signatures side by side instead of one after
another. Idle for ``IDLE_SECONDS``, a thread stops its worker and ends.
Threads are daemons and a worker still running when the process exits is
stopped, so a process never waits for a compiler, not even at exit; the next
process compiles what was left.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from aoti_eager import _worker, settings
from aoti_eager.kernels import CompileRequest, toolchain
from aoti_eager.kernels.signature import short_form

log = logging.getLogger("aoti_eager")

# An idle worker holds torch and Inductor in memory: it is stopped after this long.
IDLE_SECONDS = 60.0
# Workers and their compilers yield the CPU to the process whose calls run
# eagerly meanwhile, and to that process's other work: at the same priority,
# a few workers on a small machine slow its forwards several times over.
NICENESS = 10

# A thread's workers, by the cache and fleet cache they publish into.
Workers = dict[tuple[Path, "str | None"], _worker.Worker]


class Job(Protocol):
    """A background compile: :meth:`run` on a thread of the pool, its result the future's."""

    def run(self, workers: Workers) -> Any: ...


@dataclass(frozen=True)
class InWorker:
    """A compile of ``request`` in a worker process, into the cache at
    ``root`` with the fleet cache at ``remote`` behind it (None:
    ``$AOTI_EAGER_REMOTE``, if set); its result is the worker's :class:`aoti_eager._worker.Outcome`."""

    request: CompileRequest
    root: Path
    remote: str | None = None

    def run(self, workers: Workers) -> _worker.Outcome:
        request, started = self.request, time.perf_counter()
        worker = workers.setdefault((self.root, self.remote), _worker.Worker(self.root, self.remote, NICENESS, jobs=_jobs()))
        new_worker = not worker.running
        try:
            outcome = worker.compile(request)
        except Exception as e:  # noqa: BLE001 - e.g. no process could be started
            outcome = _worker.Outcome("failed", f"{type(e).__name__}: {e}")
        log.debug("aoti_eager: background compile of %s on %s: %s after %.2f s (%.2f s compiling%s)%s", request.op,
                  request.device, outcome.status, time.perf_counter() - started, outcome.seconds,
                  ", in a new worker" if new_worker else "", f": {outcome.reason}" if outcome.reason else "")
        if outcome.status == "failed" and not _worker.stopped:
            # A dynamic-shape kernel that fails leaves the family's shapes to compile alone: no call is worse off.
            (log.info if request.dynamic else log.warning)(
                "aoti_eager: background compile of %s on %s failed: %s", request.op, request.device, outcome.reason)
        return outcome


@dataclass(frozen=True)
class Here:
    """``compile()`` on the thread itself; its result is what it returns."""

    compile: Callable[[], Any]

    def run(self, workers: Workers) -> Any:
        return self.compile()


_queue: queue.Queue[tuple[Job, Future]] = queue.Queue()
_threads: set[threading.Thread] = set()
_threads_lock = threading.Lock()
# Every background compile not finished yet (see wait()).
_running: set[Future] = set()


def submit(job: Job) -> Future:
    """Queues ``job`` for the pool; the future's result is what it returns."""
    future: Future = Future()
    _running.add(future)
    future.add_done_callback(_running.discard)
    with _threads_lock:
        _queue.put((job, future))
        if len(_threads) < _jobs():
            thread = threading.Thread(target=_serve, name="aoti_eager-background-compiles", daemon=True)
            _threads.add(thread)
            thread.start()
    return future


# A fused model's forward under compile="now" (aoti_eager.fuse): its ops'
# misses are queued as background compiles, side by side in workers, their
# calls run eagerly meanwhile, and the forward returns once every one has
# ended and what it decided is settled (a region's miss still compiles at its
# call). Per thread: the forward that opened it, and the compiles it waits for
# with what settles each.
class _Together(threading.local):
    owner: int | None = None
    compiles: list[tuple[Future, Callable[[], Any] | None]]


_together = _Together()


def together() -> bool:
    """Whether this thread's misses compile side by side (see :func:`begin_together`)."""
    return _together.owner is not None


def begin_together(owner: object) -> None:
    """Misses of this thread compile side by side until :func:`end_together`
    with ``owner`` (a fused model); one inside another's forward joins the
    outer. Begun again by its own owner (an end that an interrupt skipped),
    it settles what the last one left and starts anew."""
    if _together.owner == id(owner):
        _settle()
    if _together.owner is None:
        _together.owner, _together.compiles = id(owner), []


def end_together(owner: object) -> None:
    """Waits for the compiles queued since ``owner`` began, and settles them."""
    if _together.owner == id(owner):
        _settle()


def join(compiling: Future, settle: Callable[[], Any] | None = None) -> None:
    """The forward under way waits for ``compiling``, then calls ``settle``
    (which decides its calls from the result, so that the next finds it)."""
    _together.compiles.append((compiling, settle))


def _settle() -> None:
    compiles, _together.owner, _together.compiles = _together.compiles, None, []
    concurrent.futures.wait([future for future, _ in compiles])
    for _, settle in compiles:
        try:
            if settle is not None:
                settle()
        except Exception:  # noqa: BLE001 - the next call decides again
            log.exception("aoti_eager: internal error while settling a compile")


def wait(timeout: float | None = None) -> bool:
    """Waits for every background compile queued so far; whether all ended within ``timeout`` seconds."""
    return not concurrent.futures.wait(list(_running), timeout).not_done


class Queued:
    """One override's background compiles: the request, and the compile,
    that each of its signatures waits for (by the signature's decision key)."""

    def __init__(self) -> None:
        self._waiting: dict[Any, tuple[CompileRequest, Future]] = {}

    def running(self) -> int:
        """Compiles not finished yet."""
        waiting = list(self._waiting.values())  # a copy under the GIL: the override's lock may be held by a compile
        return len({id(future) for _, future in waiting if not future.done()})

    def get(self, key: Any) -> Future | None:
        """The compile ``key`` waits for, if any."""
        waiting = self._waiting.get(key)
        return None if waiting is None else waiting[1]

    def finish(self, key: Any) -> tuple[CompileRequest, Any]:
        """The request ``key`` waited for and the worker's outcome; no key waits
        for that compile any more (a dynamic kernel found in C++ serves the
        others, which may never ask again)."""
        request, compiling = self._waiting[key]
        for waiting in [k for k, (_, future) in self._waiting.items() if future is compiling]:
            del self._waiting[waiting]
        return request, compiling.result()

    def add(self, key: Any, request: CompileRequest, root: Path, remote: str | None) -> bool:
        """``key`` waits for a compile of ``request``: the one under way (the
        shapes of one dynamic kernel wait for its one compile), else a new one
        (True)."""
        compiling = next((future for queued, future in self._waiting.values() if queued.id == request.id), None)
        started = compiling is None
        if started:
            compiling = submit(InWorker(request, root, remote))
            log.info("aoti_eager: compiling %s for (%s) in the background%s", request.op, short_form(request.signature),
                     " as a dynamic-shape kernel" if request.family else "")
        self._waiting[key] = (request, compiling)
        return started


def prestart(devices: list[str]) -> None:
    """Starts the process that workers are forked from (see
    :mod:`aoti_eager._zygote`) and, for CPU kernels, the probe of
    :func:`vec_isas_known`: both then run while the program goes on, before
    its first miss."""
    _worker.prestart(_jobs(), NICENESS)
    if "cpu" in devices:
        vec_isas_known()


def vec_isas_known() -> bool:
    """Whether CPU kernels can be looked up at once: their cache is named by
    the CPU's vector ISA, which Inductor's probe finds once per machine, in up
    to a minute on a busy many-core host (:func:`aoti_eager.kernels.toolchain.cpu_isa`).
    Where it cannot, the probe runs in a thread meanwhile, so that no call
    waits for it."""
    global _probe
    if toolchain.vec_isas_known():
        return True
    with _threads_lock:
        if _probe is None:
            _probe = threading.Thread(target=_probe_vec_isas, name="aoti_eager-vec-isa-probe", daemon=True)
            _probe.start()
        # A probe that failed is made again by the miss, which reports it.
        return not _probe.is_alive()


_probe: threading.Thread | None = None


def _probe_vec_isas() -> None:
    try:
        toolchain.cpu_isa()
    except Exception as e:  # noqa: BLE001 - the miss that probes again reports it
        log.debug("aoti_eager: probing the CPU's vector ISAs failed: %s: %s", type(e).__name__, e)


def _jobs() -> int:
    return settings.background_jobs.get() or _worker.default_jobs()


def _serve() -> None:
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no setpriority here
        # This thread and the compilers it starts yield the CPU to the calls that run eagerly meanwhile (Linux: per thread).
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    workers: Workers = {}
    try:
        while (item := _next()) is not None:
            job, future = item
            try:
                future.set_result(job.run(workers))
            except BaseException as e:  # noqa: BLE001 - the caller's to report
                future.set_exception(e)
    finally:
        for worker in workers.values():
            worker.close()


def _next() -> tuple[Job, Future] | None:
    """The next queued job; None when the thread has left the pool: after
    ``IDLE_SECONDS`` without a job, or where the pool is larger than the
    setting now allows."""
    while True:
        try:
            item = _queue.get(timeout=IDLE_SECONDS)
        except queue.Empty:
            item = None
        with _threads_lock:
            # Under the lock that submit() holds: a job queued from now on
            # sees one thread fewer, and starts one if it must.
            if item is None and _queue.empty() or item is not None and len(_threads) > _jobs():
                if item is not None:
                    _queue.put(item)
                _threads.discard(threading.current_thread())
                return None
        if item is not None:
            return item


atexit.register(_worker.shutdown)
