"""What compiling and loading kernels takes in a process, whoever asks: a
miss of a user's call (aoti_eager/_runtime.py) or a worker process
(aoti_eager/_worker.py). No policy: which kernel to compile is the
planner's (aoti_eager/_planner.py).

Per process: one Inductor compile at a time, the C++ compiler's failures,
the cache disks found full, and the eager fallbacks already logged.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from aoti_eager import _extension, settings
from aoti_eager._planner import Eager, Family
from aoti_eager.cache import DamagedEntry, KernelCache, UntrustedEntry, inventory, remote
from aoti_eager.cache.entry_store import Entry, EntryStore, LockedElsewhere
from aoti_eager.cache.store import LIBRARY_FILE, TEMPORARY_PREFIX, beside
from aoti_eager.kernels import CallSignature
from aoti_eager.kernels.compile import compile_options, flat_tensor_inputs
from aoti_eager.kernels.dynamic import NotDynamic, ShapeFamily
from aoti_eager.kernels.inductor.load_probe import UnsafeToLoad, check_loads, probe_ahead, runtime_crashes
from aoti_eager.kernels.pipeline import Loader, NotCompiled, Outcome, Published, compile_signature, time_kernel
from aoti_eager.kernels.seam import Seam
from aoti_eager.kernels.target import Target
from aoti_eager.kernels.speed import Timer
from aoti_eager.kernels.signature import qualified_name
from aoti_eager.kernels.toolchain import environment_name

log = logging.getLogger("aoti_eager")

# Inductor is not thread-safe: one compile at a time in a process (the cache's
# file lock orders processes).
compile_lock = threading.Lock()

# How long the calls of a signature whose kernel did not fit on the cache's
# disk run the original kernel before one looks whether space was freed.
DISK_FULL_RETRY_SECONDS = 10.0
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CompilerFailures:
    """The C++ compiler's failures in this process, by what it said.

    A compiler that fails the same way on several signatures is the machine's
    problem (a path it cannot take, a missing header, a full disk), not the
    ops': after ``GIVE_UP_AFTER`` such failures no further compile is tried in
    this process, so that each new signature does not pay seconds for nothing.
    The failures are not recorded in the cache: a later process tries again.
    """

    GIVE_UP_AFTER = 3

    def __init__(self) -> None:
        self._counts: collections.Counter[str] = collections.Counter()
        self.given_up: str | None = None  # what the compiler said, once given up

    def add(self, said: str) -> None:
        # Paths and digests differ from one signature to the next; the failure does not.
        same_way = re.sub(r"\S*/\S*|\b[0-9a-f]{8,}\b", "_", said)
        self._counts[same_way] += 1
        if self._counts[same_way] >= self.GIVE_UP_AFTER and self.given_up is None:
            self.given_up = said
            log.error(
                "aoti_eager: the C++ compiler failed the same way on %d signatures: %s. No further kernels are "
                "compiled in this process (calls run eagerly); `aoti-eager doctor` checks the whole path.",
                self.GIVE_UP_AFTER, said,
            )


compiler_failures = CompilerFailures()

# (op, device, reason) already logged: one line per process, not per call.
_logged: set[tuple[str, str, str]] = set()


def log_eager_once(name: str, device: str, reason: str) -> None:
    """Says that ``name`` on ``device`` runs eagerly and why, once per process."""
    if (name, device, reason) not in _logged:
        _logged.add((name, device, reason))
        log.warning("aoti_eager: %s on %s runs eagerly: %s", name, device, reason)


@contextlib.contextmanager
def own_work() -> Iterator[None]:
    """Within the block, this thread's calls of overridden ops run the
    original kernels, uncounted, as inside a miss: a compile started from
    Python (a region's) neither recurses into the overrides nor waits on
    :data:`compile_lock`, which it holds, for an op's compile."""
    extension = _extension.load()
    extension.enter_own_work()
    try:
        yield
    finally:
        extension.leave_own_work()


def open_cache(root: Path, device: torch.device, url: str | None, wait: float) -> EntryStore:
    """The cache at ``root`` of kernels for ``device`` (keyed by its capability,
    not its index), with the fleet cache at ``url`` behind it (None:
    ``$AOTI_EAGER_REMOTE``, if set), whose lock a miss waits ``wait`` seconds for."""
    cache = KernelCache(root, environment_name(device, compile_options(device.type)))
    url = url or settings.remote.get()
    if url is not None:
        cache.behind = remote.tier(url, cache.directory.name, wait=wait)
    return cache


def waited_for(error: TimeoutError) -> str:
    """Why a miss runs eagerly for now: another machine compiles its kernel
    (the fleet's lock), or another process did for longer than the lock timeout."""
    if isinstance(error, LockedElsewhere):
        return f"{error}; running eagerly meanwhile"
    return f"waited over {settings.lock_timeout.get():.0f} s for another process's compile; running eagerly meanwhile"


def not_loaded(crash: str) -> str:
    return f"kernels of this cache environment are not loaded: {crash}"


def cannot_compile(cache: EntryStore) -> str | None:
    """Why no kernel is compiled for ``cache`` in this process, or None."""
    if compiler_failures.given_up is not None:
        return f"the C++ compiler failed on several signatures in this process: {compiler_failures.given_up}"
    crash = runtime_crashes(cache.directory.name)
    return None if crash is None else not_loaded(crash)


def loader(cache: EntryStore, signature: CallSignature, known_good: bool) -> Loader:
    """Loads a library of ``cache`` as the kernel of ``signature``, checked
    against what the call will give it (its outputs against the output
    counts: the C++ constructor checks them)."""

    def load(library: Path, output_counts: list[int]) -> Any:
        inputs = len(flat_tensor_inputs(signature))
        return load_library(cache, signature.device, library, output_counts, inputs, signature.short(), known_good,
                            signature.runtime_arguments)

    return load


def load_library(
    cache: EntryStore, device: torch.device, library: Path, output_counts: list[int], inputs: int, call: str,
    known_good: bool, runtime_arguments: list[Any] | tuple[Any, ...] = (),
) -> Any:
    """A library of ``cache`` loaded as a kernel on ``device`` (probed first
    where none of its environment has loaded yet), checked to take the
    ``inputs`` tensors that the call ``call`` gives it; ``known_good``: a
    published entry's, not one a compile is about to check. What loads it
    is :func:`current`'s :class:`Loading`."""
    return _loading.current().library(cache, device, library, output_counts, inputs, call, known_good, runtime_arguments)


def _load_library(
    cache: EntryStore, device: torch.device, library: Path, output_counts: list[int], inputs: int, call: str,
    known_good: bool, runtime_arguments: list[Any] | tuple[Any, ...],
) -> Any:
    check_loads(cache.directory.name, library, str(device), output_counts, known_good)
    extension = _extension.load()
    if device.type == "cpu":
        # Its outputs come from the pool of freed blocks (csrc/cpu_output_pool.h), held as the setting says now.
        extension.set_cpu_pool_limit(settings.cpu_pool.get())
    kernel = extension.CompiledKernel(str(library), str(device), output_counts, runtime_arguments)
    if kernel.num_inputs != inputs:
        raise DamagedEntry(f"its library takes {kernel.num_inputs} inputs, a call ({call}) gives {inputs}")
    return kernel


def load_ahead(cache: EntryStore, device: torch.device, library: Path, output_counts: list[int]) -> None:
    """Starts, where :func:`load_library` will, the child that probes this
    environment's first library, so that it runs while the caller goes on."""
    probe_ahead(cache.directory.name, library, str(device), output_counts)


@dataclass(frozen=True)
class Loading:
    """What a library is loaded as, for a compile's checks and for the calls
    it serves: ``library`` as :func:`load_library` takes its arguments (by
    default the library loaded by ``_C``; a test gives a stand-in kernel, or
    one that wraps the loaded one, with :func:`scope`)."""

    library: Callable[..., Any] = _load_library


_loading = Seam(Loading())
current, scope = _loading.current, _loading.scope


def load_entry(cache: EntryStore, signature: CallSignature, entry: Entry) -> Any:
    """The kernel of a published ``entry`` of ``cache`` for ``signature``
    (see :func:`entry_kernel`)."""
    return entry_kernel(loader(cache, signature, known_good=True), entry)


def entry_kernel(load: Loader, entry: Entry) -> Any:
    """The kernel of a published ``entry``, loaded by ``load``. Raises
    UnsafeToLoad where kernels of its cache's environment crash this
    process, and DamagedEntry where this entry's does not load."""
    try:
        return load(entry.library, entry.output_counts)
    except (UnsafeToLoad, DamagedEntry):
        raise
    except Exception as e:  # noqa: BLE001 - the entry's problem, not the environment's
        raise DamagedEntry(f"its kernel does not load: {e}") from e


def dynamic_kernel(cache: EntryStore, name: str, key: str) -> ShapeFamily | None:
    """The dynamic kernel's family of the entry ``key``; None where it is none (or gone, or damaged)."""
    try:
        entry = cache.lookup(name, key)
        return ShapeFamily.from_json(entry.dynamic) if entry is not None and entry.dynamic else None
    except (DamagedEntry, NotDynamic):  # damaged, or an entry of an earlier format: its guards meant something else
        return None


def held(cache: EntryStore, name: str, key: str, adopt: Callable[[Entry], Any]) -> Any:
    """What ``adopt`` makes of ``name``'s entry ``key`` in ``cache``, which
    is held meanwhile (no eviction removes its library while it loads); None
    where there is none, it is damaged (set aside: compiled again), or it is a
    verdict on speed that the timing's switch turned off (compiled again)."""
    try:
        with cache.hold(name, key) as entry:
            if entry is None or entry.library is None and entry.timing is not None and not settings.keep_faster.get():
                return None
            return adopt(entry)
    except DamagedEntry:
        return None


def copy_library(cache: EntryStore, name: str, key: str, library: Path, file: str = LIBRARY_FILE) -> dict | None:
    """Copies the library ``file`` of ``name``'s entry ``key`` (its own, or
    one beside it: ``backward.so``), and the ops it leaves to the dispatcher,
    if any, to ``library``, the entry held meanwhile: the entry's timing
    (``Timing.to_json``; empty where it was not timed), None where the entry
    is gone, damaged or holds no library."""
    try:
        with cache.hold(name, key) as entry:
            if entry is None or entry.library is None:
                return None
            source = beside(entry.library, file)
            if not source.exists():
                return None
            shutil.copyfile(source, library)
            if (left := beside(entry.library, str(Path(file).with_suffix(".json")))).exists():
                shutil.copyfile(left, library.with_suffix(".json"))
            return entry.timing or {}
    except (DamagedEntry, OSError):
        return None


def from_family(
    cache: EntryStore, family: Family, target: Target, load: Callable[[str, ShapeFamily], Any],
) -> tuple[str, ShapeFamily, Any] | None:
    """The first of ``family``'s dynamic kernels, narrowest first, whose
    guards admit ``target``'s call, this process's or another's that the
    cache holds (looking one up in the fleet cache publishes it locally,
    verified), with what its calls run: its decision in this process, else
    ``load(key, family)``'s; None where none does. A kernel whose entry is
    gone is forgotten."""
    keys = [key for key in cache.keys(target.name, target.family_key() + "-") if key not in family.published]
    family.published.update({key: dynamic_kernel(cache, target.name, key) for key in keys})
    for key, dynamic in family.dynamic():
        if target.admitted_by(dynamic, key):
            if (decision := family.decisions.get(key) or load(key, dynamic)) is not None:
                return key, dynamic, decision
            family.published.pop(key)
    return None


def recorded_verdict(cache: EntryStore, name: str, keys: list[tuple[str, str]]) -> Eager | None:
    """The first eager verdict that ``cache`` holds for op ``name`` under
    ``keys`` (each with the verdict's scope, as :meth:`Planner.verdict_keys`
    gives them), or None."""
    for key, scope in keys:
        try:
            entry = cache.lookup(name, key)
        except (DamagedEntry, UntrustedEntry):
            entry = None
        if entry is not None and entry.library is None:
            return Eager(entry.reason or "decided eager", scope)
    return None


def compile_kernel(
    op: torch._ops.OpOverload, signature: CallSignature, cache: EntryStore, family: ShapeFamily | None,
    seen: list[list[tuple[int, ...]]], timer: Timer | None = None,
) -> tuple[Outcome, str | None]:
    """The outcome of compiling ``signature``'s kernel of ``family`` (None:
    its own), and why a dynamic kernel failed where it did: the shape is then
    compiled alone (where the compiler itself failed, a static compile would too)."""
    load = loader(cache, signature, known_good=False)
    outcome: Outcome | None = None
    failed = None
    if family is not None:
        outcome = compile_signature(op, signature, cache, load, family, seen=seen, timer=timer)
        if isinstance(outcome, NotCompiled) and not outcome.eager_raised and outcome.compiler_error is None:
            failed, outcome = outcome.reason, None
            log.info("aoti_eager: %s (%s): %s; compiling this shape alone",
                     qualified_name(op), signature.short(), failed)
    if outcome is None:
        outcome = compile_signature(op, signature, cache, load, timer=timer)
    if isinstance(outcome, NotCompiled) and outcome.compiler_error is not None:
        compiler_failures.add(outcome.compiler_error)
    elif isinstance(outcome, Published):
        stages = ", ".join(f"{stage} {t:.1f} s" for stage, t in outcome.stages.items())
        described = outcome.family.short(signature.to_json()) if outcome.family else signature.short()
        log.info("aoti_eager: compiled %s for (%s) in %.1f s (%s)", qualified_name(op), described, outcome.seconds, stages)
    return outcome, failed


def slower_here(kernel: Any, signature: CallSignature, op: torch._ops.OpOverload, timer: Timer | None) -> str | None:
    """Why eager is faster than the dynamic ``kernel`` at ``signature``'s
    call, or None where it is not (or the timing failed)."""
    timing = time_kernel(kernel, signature, op, timer)
    if timing is None or not timing.eager_faster:
        return None
    reason = f"eager is faster at these sizes: kernel {timing.ratio:.2f}x eager's time"
    log.info("aoti_eager: %s on %s keeps eager for sizes like (%s): %s", qualified_name(op), signature.device.type, signature.short(), reason)
    return reason


def keep_size_limit(root: Path) -> None:
    """Evicts the least recently used entries of the cache at ``root`` past
    its size limit: the whole root's, every environment of it."""
    limit = settings.cache_size.get()
    eviction = inventory.evict(root, max_bytes=limit)
    if eviction.removed:
        log.info(
            "aoti_eager: evicted %d least recently used cache entries (%d bytes) to stay under %d bytes",
            len(eviction.removed), sum(listing.bytes for listing in eviction.removed), limit,
        )


def unusable_cache(root: Path, error: OSError) -> str:
    """Why the cache at ``root`` failed a miss, and what to do about it."""
    path = Path(error.filename) if error.filename else None
    if path is not None and path.name.startswith(TEMPORARY_PREFIX):
        path = path.parent  # a new name each time: say where it was made
    where = f": {path}" if path is not None else ""
    return (
        f"the cache at {root} cannot be used ({error.strerror or error}{where}); make it writable, "
        "or give enable(cache_dir=...) or AOTI_EAGER_CACHE_DIR a directory of your own"
    )


# Cache roots whose disk was found full -> the bytes free then: a miss there
# compiles again only once more is free.
_full_disks: dict[Path, int] = {}


def _free_bytes(root: Path) -> int:
    try:
        st = os.statvfs(root)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _mount_point(path: Path) -> Path:
    path = Path(os.path.realpath(path))
    device = path.stat().st_dev
    while path.parent != path and path.parent.stat().st_dev == device:
        path = path.parent
    return path


def disk_full(root: Path) -> str:
    """Why a kernel could not be published into the cache at ``root``: its
    disk is full (not the compile's scratch, which the error names)."""
    _full_disks[root] = free = _free_bytes(root)
    try:
        where = f"the file system mounted at {_mount_point(root)}"
    except OSError:
        where = "its file system"
    return (f"the cache at {root} is full ({where} has {free} bytes free); calls run eagerly, and the kernel is "
            f"compiled again once space is freed (`aoti-eager cache prune`, or a smaller {settings.cache_size.name})")


def still_full(root: Path) -> str | None:
    """Why no kernel is compiled into the cache at ``root`` while its disk,
    found full, has no more space free than then; None once it has."""
    full_at = _full_disks.get(root)
    if full_at is None:
        return None
    if _free_bytes(root) <= full_at:
        return f"the cache at {root} is still full"
    del _full_disks[root]
    return None
