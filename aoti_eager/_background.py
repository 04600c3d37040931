"""Background compiles: a queue of manifest entries and one thread that runs
them in a worker process (see :mod:`aoti_eager._worker`), kept while entries
keep coming.

The thread is a daemon and a worker still running when the process exits is
stopped, so a process never waits for a compiler, not even at exit; the next
process compiles what was left.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
from concurrent.futures import Future
from pathlib import Path

from aoti_eager import _worker
from aoti_eager.manifest import ManifestEntry

log = logging.getLogger("aoti_eager")

_queue: queue.Queue[tuple[ManifestEntry, Path, Future]] = queue.Queue()
_thread: threading.Thread | None = None
_thread_lock = threading.Lock()
# An idle worker holds torch and Inductor in memory: it is stopped after this long.
IDLE_SECONDS = 60.0


def submit(entry: ManifestEntry, root: Path) -> Future:
    """Queues a compile of ``entry`` into the cache at ``root``; the future's
    result is the worker's :class:`aoti_eager._worker.Outcome`."""
    global _thread
    future: Future = Future()
    _queue.put((entry, root, future))
    with _thread_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_serve, name="aoti_eager-background-compiles", daemon=True)
            _thread.start()
    return future


def _serve() -> None:
    workers: dict[Path, _worker.Worker] = {}
    while True:
        try:
            entry, root, future = _queue.get(timeout=IDLE_SECONDS if workers else None)
        except queue.Empty:
            for worker in workers.values():
                worker.close()
            workers.clear()
            continue
        try:
            outcome = workers.setdefault(root, _worker.Worker(root)).compile(entry)
        except Exception as e:  # noqa: BLE001 - e.g. no process could be started
            outcome = _worker.Outcome("failed", f"{type(e).__name__}: {e}")
        if outcome.status == "failed" and not _worker.stopped:
            log.warning("aoti_eager: background compile of %s on %s failed: %s", entry.op, entry.device, outcome.reason)
        future.set_result(outcome)


atexit.register(_worker.shutdown)
