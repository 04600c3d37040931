"""Installed overrides and the miss path.

The C++ kernel (csrc/op_override.cpp) serves every call whose signature it has
seen. On a new signature it calls :func:`_on_miss`, which decides once per
signature: a kernel from the persistent cache, a fresh compile, or eager.

The decision is one of :class:`UseKernel`, :class:`RetryLater` and
:class:`RunEagerly`. The C++ side reads every one the same way, through its
attributes: ``remember`` (bool: keep the decision for the signature's key, or
run this call eagerly and ask again on the next call, or, with a
``retry_after`` in seconds, on the first call after it), ``kernel`` (the
CompiledKernel to run, or None for the original kernel), ``dynamic`` (the
shape family it also holds for), ``judged`` (the dynamic kernel that was
judged against eager for the call's range of sizes only, or None) and, of an
eager decision, ``numbers``: the calls beyond the signature it holds for
(csrc/op_override.h: set_miss_handler).

A dynamic kernel is timed against eager again in each range of sizes
(:meth:`ShapeFamily.size_range`) that a call brings it to, and keeps eager in
the ranges where it loses: the first call of a new range misses.

An override that ``uninstall()`` removes keeps what it knows, and
``install()`` puts it back as it was: enabling an op again costs no lookup,
load or compile.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import os
import re
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Iterator, Union

import torch
from torch._ops import OpOverload

from aoti_eager import _background, _extension, settings
from aoti_eager.cache import DamagedEntry, Entry, KernelCache, UntrustedEntry, inventory, remote
from aoti_eager.cache.entry_store import EntryStore, LockedElsewhere
from aoti_eager.cache.store import TEMPORARY_PREFIX
from aoti_eager.kernels import CallSignature, Unsupported
from aoti_eager.kernels.compile import compile_options, flat_tensor_inputs
from aoti_eager.kernels.inductor.load_probe import UnsafeToLoad, check_loads, runtime_crashes
from aoti_eager.kernels.dynamic import (
    NotDynamic, ShapeFamily, changed_dims, family_key, family_limit_key, ints_key, kinds_key, tensor_args, tensor_sizes,
)
from aoti_eager.kernels.pipeline import NotCompiled, Outcome, compile_signature, publish_verdict
from aoti_eager.kernels.signature import Position, qualified_name
from aoti_eager.kernels.speed import Timer, measured, time_against_eager
from aoti_eager.kernels.toolchain import environment_name
from aoti_eager.manifest import ManifestEntry, Recorder

log = logging.getLogger("aoti_eager")

DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

# Inductor is not thread-safe: one compile at a time in a process (the cache's
# file lock orders processes).
_compile_lock = threading.Lock()

# How long a miss waits for another machine's compile of its signature (the
# fleet cache's lock): not at all in a user's process, whose calls run
# eagerly meanwhile; a background worker waits (see _worker.warm).
fleet_wait = 0.0


class _CompilerFailures:
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


_compiler_failures = _CompilerFailures()


@dataclass(frozen=True)
class UseKernel:
    """Calls of the signature run ``kernel``; with ``dynamic``, also every
    later call of its shape family that the kernel's guards admit."""

    kernel: Any  # a CompiledKernel (csrc/compiled_kernel.h); the C++ side keys it without its runtime numbers' values
    dynamic: ShapeFamily | None = None
    # With ``dynamic``: judged for the call's range of sizes only; other ranges ask again.
    per_range: bool = False
    remember: ClassVar[bool] = True

    @property
    def judged(self) -> Any:
        return self.kernel if self.per_range else None


@dataclass(frozen=True)
class RunEagerly:
    """Calls of the signature run the original kernel, for good in this
    process; with ``dynamic``, every call of its shape family that it admits;
    with ``numbers`` (positions, as :attr:`CallSignature.runtime_arguments`
    gives them), every call that differs from it only in their values."""

    reason: str
    dynamic: ShapeFamily | None = None
    numbers: tuple[Position, ...] = ()
    # With ``dynamic``: the dynamic kernel that eager beat in the call's range
    # of sizes; eager holds for that range only.
    judged: Any = None
    kernel: ClassVar[None] = None
    remember: ClassVar[bool] = True


@dataclass(frozen=True)
class RetryLater:
    """This call runs the original kernel; the next call of the signature asks again
    (a compile elsewhere has not ended, or a CUDA graph is being captured), or,
    with ``retry_after``, the first call after that many seconds: calls
    meanwhile run the original kernel straight from C++."""

    reason: str
    retry_after: float = 0.0
    kernel: ClassVar[None] = None
    dynamic: ClassVar[None] = None
    judged: ClassVar[None] = None
    remember: ClassVar[bool] = False


Decision = Union[UseKernel, RunEagerly, RetryLater]

# How long the calls of a signature that compiles in the background run the
# original kernel before one asks whether its kernel is ready. Asking on every
# call made a tiny call cost tens of times eager's (BENCHMARKS.md, "Background
# compiles"); a kernel takes over at most this much later.
BACKGROUND_RETRY_SECONDS = 0.1

# How long the calls of a signature whose kernel did not fit on the cache's
# disk run the original kernel before one looks whether space was freed.
DISK_FULL_RETRY_SECONDS = 10.0
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class _Family:
    """What this process knows of one shape family of an op (kernels/dynamic.py)."""

    # Tensor sizes of the family's shapes that missed here, most recent last.
    seen: list[list[tuple[int, ...]]] = field(default_factory=list)
    # Entry key -> its dynamic kernel's family (None: not a dynamic entry of this family).
    published: dict[str, ShapeFamily | None] = field(default_factory=dict)
    # Entry key -> the decision its entry gave.
    decisions: dict[str, Decision] = field(default_factory=dict)
    # (entry key, ShapeFamily.size_range) -> why eager is faster there, or
    # None where the dynamic kernel is not slower: each range judged once.
    verdicts: dict[tuple[str, tuple[int, ...]], str | None] = field(default_factory=dict)
    compiles: int = 0
    dynamic_failed: str | None = None  # why a dynamic kernel of it failed here

    SEEN = 8

    # Keys of the signatures seen: a signature seen again (its entry damaged, or
    # its compile retried) is not a shape that moved.
    keys: set[str] = field(default_factory=set)

    def see(self, signature: CallSignature) -> None:
        self.keys.add(signature.key)
        sizes = [t.sizes for t in tensor_args(signature)]
        if sizes not in self.seen:
            self.seen = [*self.seen, sizes][-self.SEEN:]

    def dynamic(self) -> list[tuple[str, ShapeFamily]]:
        """Its dynamic kernels, narrowest first."""
        known = [(key, family) for key, family in self.published.items() if family is not None]
        return sorted(known, key=lambda item: sum(map(len, item[1].dims)))


@dataclass
class _Ints:
    """What this process knows of the ints given to one op's calls of one
    shape family, whatever their numbers (:func:`ints_key`), by position: an
    argument's index, or an int list's and its item's
    (:attr:`CallSignature.int_arguments`).

    The first call compiles its ints in, unless the cache holds a kernel that
    takes them at run time (another process saw them move). Once an int
    moves, kernels take it as a runtime int: one kernel for every later
    positive value, instead of one per value (``arange``'s end, a batch
    size, a sequence length, the ``n`` of a pad ``[0, n]``; the 0 stays
    compiled in). An int whose kernel fails (export cannot trace an int used
    as a dim index, the kernel disagrees with eager) is compiled in from then on.
    """

    first: dict[Position, int]  # the values of the first call that missed
    runtime: frozenset[Position] = frozenset()  # taken as runtime ints
    constant: frozenset[Position] = frozenset()  # compiled in: their runtime kernel failed

    def to_take(self, signature: CallSignature) -> frozenset[Position]:
        """The ints a kernel for ``signature`` takes at run time: those that
        moved and have not failed; none where one of them cannot be an input
        in this call (a value of 0 or below, a device that reads no runtime
        numbers)."""
        values = signature.int_arguments
        moved = {i for i, value in values.items() if value != self.first.get(i, value)}
        wanted = (self.runtime | moved) - self.constant
        return frozenset(wanted) if wanted and signature.can_take_runtime_ints(wanted) else frozenset()

    def failed(self, tried: frozenset[Position]) -> None:
        """A kernel taking ``tried`` at run time failed: the ints it added to
        those already taken (all of them, if it added none) are compiled in."""
        self.constant |= (tried - self.runtime) or tried
        self.runtime -= self.constant


@dataclass
class OpStats:
    """What happened to one op overload on one device since it was enabled."""

    compiles: int = 0
    cache_loads: int = 0
    compile_seconds: float = 0.0
    queued: int = 0  # background compiles
    last_fallback_reason: str | None = None


@dataclass
class Override:
    """One op overload overridden at one device's dispatch key."""

    op: OpOverload
    device: str  # the device type: "cpu" or "cuda"
    root: Path
    token: int
    handle: Any = None
    # Where misses are recorded (see aoti_eager.manifest), if anywhere.
    recorder: Recorder | None = None
    # "now": a miss compiles before the call returns; "background": in a
    # worker process, while calls run eagerly; "never": misses run eagerly.
    compile: str = "now"
    # The fleet cache's URL (cache/remote.py); None: $AOTI_EAGER_REMOTE, if set.
    remote: str | None = None
    stats: OpStats = field(default_factory=OpStats)
    # CallSignature.decision_key -> what its calls run (never RetryLater).
    decisions: dict[tuple[str, str], Decision] = field(default_factory=dict)
    _caches: dict[str, EntryStore] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # CallSignature.shape_key -> compiles attempted for it in this process.
    _value_variants: dict[str, int] = field(default_factory=dict)
    # CallSignature.decision_key -> the manifest entry compiling in the background
    # for that signature, and its future.
    _queued: dict[tuple[str, str], tuple[ManifestEntry, Any]] = field(default_factory=dict)
    # CallSignature.decision_key of signatures kept eager because eager is faster.
    _eager_faster: set[tuple[str, str]] = field(default_factory=set)
    # (device, family_key) -> what this process knows of the shape family.
    _families: dict[tuple[str, str], _Family] = field(default_factory=dict)
    # (device, kinds_key) of the calls that compiled a kernel.
    _compiled_kinds: set[tuple[str, str]] = field(default_factory=set)
    # ints_key -> what this process knows of the family's ints.
    _ints: dict[str, _Ints] = field(default_factory=dict)
    # A miss ran eagerly while the CPU's vector ISAs were probed: its compile
    # is to come, at its next call after the probe.
    _waits_for_probe: bool = False
    # Times kernels against eager (kernels/speed.py); None: the pipeline's own.
    timer: Timer | None = None

    # A call's first miss looks for kernels taking its ints at run time only
    # where it has this many ints at most (every subset is a cache key).
    RUNTIME_INT_LOOKUPS: ClassVar[int] = 3

    @property
    def name(self) -> str:
        return qualified_name(self.op)

    def cache(self, device: torch.device) -> EntryStore:
        """The cache of kernels for ``device`` (keyed by its capability, not its index)."""
        if str(device) not in self._caches:
            cache = KernelCache(self.root, environment_name(device, compile_options(device.type)))
            url = self.remote or settings.remote.get()
            if url is not None:
                cache.behind = remote.tier(url, cache.directory.name, wait=fleet_wait)
            self._caches[str(device)] = cache
        return self._caches[str(device)]

    def compiles_running(self) -> int:
        """Background compiles of this op not finished yet, counting as one
        those that wait for the CPU's vector-ISA probe."""
        queued = list(self._queued.values())  # a copy under the GIL: _lock may be held by a compile
        return len({id(future) for _, future in queued if not future.done()}) + self._waits_for_probe

    def decide(self, args: list[Any]) -> Decision:
        """The miss path: what calls of the signature of ``args`` run."""
        self._waits_for_probe = self.compile == "background" and self.device == "cpu" and not _background.vec_isas_known()
        if self._waits_for_probe:
            return RetryLater("probing the CPU's vector ISAs in the background", retry_after=BACKGROUND_RETRY_SECONDS)
        try:
            signature = CallSignature.of(self.op, self.device, args)
        except Unsupported as e:
            return self._eager(f"unsupported input: {e}")
        key = ints_key(signature)
        with self._lock:
            ints = self._ints.get(key)
            first = ints is None
            if first:
                ints = self._ints[key] = _Ints(signature.int_arguments)
            runtime_ints = ints.to_take(signature)
        if first and (published := self._published_runtime_ints(signature)):
            # Another process saw these ints move: its kernel serves this value too.
            with self._lock:
                ints.runtime |= published
                runtime_ints = ints.to_take(signature)
        if runtime_ints:
            # Ints that moved: one kernel takes them at run time, for every later value.
            with_ints = signature.with_runtime_ints(runtime_ints)
            decision = self._decide(with_ints)
            if not self._falls_back(decision, with_ints):
                with self._lock:
                    ints.runtime |= runtime_ints
                return decision
            with self._lock:
                ints.failed(runtime_ints)
            log.info("aoti_eager: %s on %s compiles the values of %s in: %s", self.name, self.device,
                     ", ".join(signature.name_of(p) for p in signature.int_arguments if p in runtime_ints), decision.reason)
        decision = self._decide(signature)
        if self._falls_back(decision, signature):
            # No kernel takes these numbers as inputs: compile their values in.
            # (A recording run records the first form only: compiling it tries both.)
            decision = self._decide(signature.with_constant_numbers())
        return decision

    def _published_runtime_ints(self, signature: CallSignature) -> frozenset[Position]:
        """The ints that a kernel in the cache takes at run time for calls like
        ``signature`` (the most of them, where several are), or none. The
        kernel is one of its shape, or a dynamic-shape one of its family: a
        runtime-int signature is a family new to an op that compiled the first
        value already, whose first kernel is general (:meth:`_kernel_to_compile`)."""
        ints = [p for p in signature.int_arguments if signature.can_take_runtime_ints([p])]
        if not ints or len(ints) > self.RUNTIME_INT_LOOKUPS:
            return frozenset()
        try:
            cache = self.cache(signature.device)
            published = {key for _, key in cache.entries(self.name)}
            for n in range(len(ints), 0, -1):
                for taken in itertools.combinations(ints, n):
                    with_ints = signature.with_runtime_ints(taken)
                    family = family_key(with_ints) + "-"
                    kernels = [key for key in published if key == with_ints.key or key.startswith(family)]
                    if any((entry := cache.lookup(self.name, key)) is not None and entry.library is not None for key in kernels):
                        return frozenset(taken)
        except (DamagedEntry, UntrustedEntry, OSError):
            pass  # the miss finds it out again, and says so
        return frozenset()

    def _falls_back(self, decision: Decision, signature: CallSignature) -> bool:
        """Whether ``signature``'s call, whose kernel would take runtime
        numbers, is tried next with its numbers compiled in: where no such
        kernel is used, unless nothing is compiled here or eager was measured
        faster (a kernel with the numbers compiled in would be no faster)."""
        return (
            isinstance(decision, RunEagerly) and not decision.numbers and bool(signature.runtime_arguments)
            and self.compile != "never" and signature.decision_key not in self._eager_faster
        )

    def _decide(self, signature: CallSignature) -> Decision:
        known = self.decisions.get(signature.decision_key)
        if known is not None:
            return known
        if signature.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return RetryLater("no compile or load inside CUDA graph capture")
        with self._lock:  # threads that miss the same signature decide it once
            known = self.decisions.get(signature.decision_key)
            if known is not None:
                return known
            try:
                cache = self.cache(signature.device)
                queued = self._queued.get(signature.decision_key)
                if queued is not None:
                    entry, compiling = queued
                    if not compiling.done():
                        return RetryLater("compiling in the background", retry_after=BACKGROUND_RETRY_SECONDS)
                    # Every shape that waited for it: the others may never ask again
                    # (a dynamic kernel found in C++ serves them), and must not stay queued.
                    for waiting in [key for key, (_, future) in self._queued.items() if future is compiling]:
                        del self._queued[waiting]
                    outcome = compiling.result()
                    if outcome.status == "failed":
                        if entry.dynamic is None:
                            return self._eager(f"background compile failed: {outcome.reason}", signature)
                        # As after a dynamic compile that fails here: the family's shapes
                        # compile alone (the worker may have compiled this one).
                        self._family(signature).dynamic_failed = outcome.reason
                decision = self._from_cache(cache, signature) or self._from_family(cache, signature)
                if decision is None:
                    missed = self._manifest_entry(signature)
                    self._record(missed)
                    if self.compile != "now":
                        # No compile here sees the shape; the family must, for the dims of its next one.
                        self._family(signature).see(signature)
                    if self.compile == "never":
                        return self._remember(signature, RunEagerly("compile='never'"))
                    if self.compile == "background":
                        return self._queue(signature, missed)
                    if (still_full := _still_full(self.root)) is not None:
                        return still_full
                    # Inductor's lock innermost: no other compile of this process waits on the caches' locks.
                    with cache.lock_signature(self.name, signature.key, timeout=settings.lock_timeout.get()), _compile_lock:
                        # Another process may have compiled it while we waited.
                        decision = self._from_cache(cache, signature) or self._from_family(cache, signature)
                        if decision is None:
                            decision = self._compile(cache, signature)
                return decision
            except UntrustedEntry as e:
                return self._eager(f"refused an untrusted cache entry: {e}", signature)
            except LockedElsewhere as e:
                self.stats.last_fallback_reason = f"{e}; running eagerly meanwhile"
                return RetryLater(self.stats.last_fallback_reason, retry_after=e.retry_after)
            except TimeoutError:
                reason = f"waited over {settings.lock_timeout.get():.0f} s for another process's compile; running eagerly meanwhile"
                self._log(reason)
                return RetryLater(reason)
            except OSError as e:  # after TimeoutError, which is one
                if e.errno in _DISK_FULL:
                    reason = _disk_full(self.root)
                    self.stats.last_fallback_reason = reason
                    self._log(reason)
                    return RetryLater(reason, retry_after=DISK_FULL_RETRY_SECONDS)
                return self._eager(_unusable_cache(self.root, e), signature)

    def _from_cache(self, cache: EntryStore, signature: CallSignature) -> Decision | None:
        """The decision a published entry holds, or None if there is none."""
        try:
            with cache.hold(self.name, signature.key) as entry:
                if entry is None:
                    return None
                # A shape another process compiled is one of its family's shapes here too.
                self._family(signature).see(signature)
                return self._adopt(signature, entry, loaded=True)
        except DamagedEntry:  # set aside: compiled again, as a damaged entry is
            return None

    def _family(self, signature: CallSignature) -> _Family:
        return self._families.setdefault((str(signature.device), family_key(signature)), _Family())

    def _from_family(self, cache: EntryStore, signature: CallSignature) -> Decision | None:
        """The decision of a dynamic kernel whose guards admit ``signature``
        (this process's, or one another process published), or None."""
        family = self._family(signature)
        prefix = family_key(signature) + "-"
        # The local cache's, and the fleet's (looking one up publishes it locally, verified).
        for key in cache.keys(self.name, prefix):
            if key not in family.published:
                try:
                    entry = cache.lookup(self.name, key)
                except DamagedEntry:
                    entry = None
                try:
                    family.published[key] = ShapeFamily.from_json(entry.dynamic) if entry is not None and entry.dynamic else None
                except NotDynamic:  # an entry of an earlier format: its guards meant something else
                    family.published[key] = None
        for key, dynamic in family.dynamic():
            if not dynamic.admits(signature, key):
                continue
            decision = family.decisions.get(key)
            if decision is None:
                try:
                    with cache.hold(self.name, key) as entry:
                        decision = None if entry is None else self._adopt(signature, entry, loaded=True, dynamic=dynamic)
                        if isinstance(decision, UseKernel) and entry.timing is not None:
                            # Timed against eager at the call that compiled it: not slower there.
                            family.verdicts.setdefault((key, dynamic.size_range(tensor_sizes(entry.signature))), None)
                except DamagedEntry:
                    decision = None
                if decision is None:
                    family.published.pop(key)
                    continue
                family.decisions[key] = decision
            return self._remember(signature, self._in_range(signature, family, key, decision))
        return None

    def _in_range(self, signature: CallSignature, family: _Family, key: str, decision: Decision) -> Decision:
        """``decision``, its dynamic kernel's for every shape its guards admit,
        for ``signature``'s range of sizes: the kernel where it was not
        measured slower than eager there (timed at this call the first time),
        else eager, for that range only."""
        if not isinstance(decision, UseKernel) or decision.dynamic is None or not settings.keep_faster.get():
            return decision
        size_range = (key, decision.dynamic.size_range([t.sizes for t in tensor_args(signature)]))
        if size_range not in family.verdicts:
            family.verdicts[size_range] = self._slower_here(decision.kernel, signature)
        reason = family.verdicts[size_range]
        if reason is None:
            return replace(decision, per_range=True)
        self.stats.last_fallback_reason = reason
        self._eager_faster.add(signature.decision_key)  # no kernel with its numbers compiled in is tried
        return RunEagerly(reason, decision.dynamic, judged=decision.kernel)

    def _slower_here(self, kernel: Any, signature: CallSignature) -> str | None:
        """Why eager is faster than the dynamic ``kernel`` at ``signature``'s
        call, or None where it is not (or the timing failed)."""
        try:
            timing = measured(kernel, signature, self.op, self.timer or time_against_eager)
        except Exception as e:  # noqa: BLE001 - the kernel passed validation: keep it
            log.debug("aoti_eager: timing %s against eager failed; keeping the kernel", self.name, exc_info=e)
            return None
        if not timing.eager_faster:
            return None
        reason = f"eager is faster at these sizes: kernel {timing.ratio:.2f}x eager's time"
        log.info("aoti_eager: %s on %s keeps eager for sizes like (%s): %s", self.name, self.device, signature.short(), reason)
        return reason

    def _kernel_to_compile(self, signature: CallSignature, family: _Family) -> ShapeFamily | None:
        """The dynamic kernel to compile for ``signature``, which none of its
        family's kernels admits: at the family's second shape, one with the
        dims that changed, or a general one where only strides or sizes of 1
        changed; after that, a general one (a widening). None for a static
        kernel: the first of a family, unless the op's calls of these dtypes
        and ranks compiled in another family."""
        if not settings.dynamic_shapes.get():
            return None
        planned = next((p for key, p in _planned.items() if p.entry_key(signature) == key), None)
        if planned is not None:
            return planned
        if family.dynamic_failed:
            return None

        def general() -> ShapeFamily | None:
            # Asked of the op on meta tensors: only where it is the answer.
            kernel = ShapeFamily.general_for(signature)
            return kernel if any(kernel.dims) else None  # else no sizes to move

        if not family.seen:
            # The op compiled already for calls of these dtypes and ranks, in another
            # family: its shapes move, so the family's first kernel is general.
            kinds = (str(signature.device), kinds_key(signature))
            return general() if kinds in self._compiled_kinds else None
        known = {key for key, _ in family.dynamic()}
        if known:
            # Where the general kernel refuses it (a size export fixed), the shape compiles alone.
            kernel = general()
            return None if kernel is None or kernel.entry_key(signature) in known else kernel
        if signature.key in family.keys:
            return None
        changed = changed_dims(signature, family.seen)
        # Where only strides changed, or a size to 1, a general kernel (a broadcast, a slice, a batch of one).
        return ShapeFamily(changed) if any(changed) else general()

    def report_unkeyable(self, args: list[Any]) -> None:
        """Records why the C++ side could not key a call (it runs eagerly)."""
        try:
            CallSignature.of(self.op, self.device, args)
            reason = "arguments of a kind the C++ call key does not cover"
        except Unsupported as e:
            reason = str(e)
        self._eager(f"unsupported input: {reason}")

    def _record(self, entry: ManifestEntry) -> None:
        if self.recorder is not None:
            self.recorder.record(entry)

    def _manifest_entry(self, signature: CallSignature) -> ManifestEntry:
        """What a miss of ``signature`` would compile: its own kernel, or the
        dynamic kernel of the dims that moved in its family (:meth:`_compile`
        decides the same way), with the span of sizes seen of each."""
        family = self._family(signature)
        dynamic = self._kernel_to_compile(signature, family)
        key = dynamic.entry_key(signature) if dynamic is not None else None
        if key is None:
            return ManifestEntry(self.name, self.device, signature.key, signature.to_json())
        span = {"dims": [list(d) for d in dynamic.dims], "seen": dynamic.size_span(signature, family.seen), "general": dynamic.general}
        return ManifestEntry(self.name, self.device, key, signature.to_json(), dynamic=span)

    def _too_many_variants(self, signature: CallSignature) -> RunEagerly | None:
        """Counts a compile of ``signature``; eager past the limit, for every
        further value, in this process and (recorded in the cache) in others."""
        variants = self._value_variants.get(signature.shape_key, 0)
        # Like dynamo's cache size limit: further values run eagerly instead of compiling forever.
        limit = settings.max_value_variants.get()
        if variants >= limit:
            reason = (
                f"{variants} kernels already compiled for new values of its numeric arguments "
                f"({settings.max_value_variants.name}={limit}); further values run eagerly"
            )
            self._record_verdict(signature, signature.values_key, reason)
            return self._eager_for_values(signature, reason)
        self._value_variants[signature.shape_key] = variants + 1
        return None

    def _record_verdict(self, signature: CallSignature, key: str, reason: str) -> None:
        """Records in the cache that calls like ``signature`` run eagerly,
        under ``key`` (see :meth:`_recorded_verdict`), so that another process
        does not compile them to find out again."""
        try:
            publish_verdict(self.cache(signature.device), self.name, signature, key, reason)
        except OSError as e:
            log.debug("aoti_eager: recording a verdict on %s failed: %s", self.name, e)

    def _recorded_verdict(self, cache: EntryStore, signature: CallSignature, of_family: bool = True) -> RunEagerly | None:
        """A verdict that a process recorded for calls like ``signature``:
        for every value of its numbers, or (with ``of_family``) for every
        shape of its family."""
        keys = [(signature.values_key, False)] + [(family_limit_key(signature), True)] * of_family
        for key, of_family in keys:
            try:
                entry = cache.lookup(self.name, key)
            except (DamagedEntry, UntrustedEntry):
                entry = None
            if entry is not None and entry.library is None:
                reason = entry.reason or "decided eager"
                if not of_family:
                    return self._eager_for_values(signature, reason)
                self.stats.last_fallback_reason = reason
                self._log(reason)
                return self._remember(signature, RunEagerly(reason, ShapeFamily.any_shape(signature)))
        return None

    def _eager_for_values(self, signature: CallSignature, reason: str) -> RunEagerly:
        """Eager for the signature and every value of its numbers (the C++
        side then keys its calls without them), logged once."""
        self.stats.last_fallback_reason = reason
        self._log(reason)
        return self._remember(signature, RunEagerly(reason, numbers=tuple(signature.number_positions)))

    def _queue(self, signature: CallSignature, entry: ManifestEntry) -> Decision:
        """Starts a background compile of ``entry``, the kernel a miss of
        ``signature`` needs; this call and those until it ends run eagerly."""
        if (too_many := self._too_many_variants(signature)) is not None:
            return too_many
        # The shapes of one dynamic kernel wait for its one compile.
        compiling = next((future for queued, future in self._queued.values() if queued.id == entry.id), None)
        if compiling is None:
            compiling = _background.submit(entry, self.root, self.remote)
            self.stats.queued += 1
            log.info("aoti_eager: compiling %s for (%s) in the background%s", self.name, signature.short(),
                     " as a dynamic-shape kernel" if entry.dynamic else "")
        self._queued[signature.decision_key] = (entry, compiling)
        return RetryLater("compiling in the background", retry_after=BACKGROUND_RETRY_SECONDS)

    def _compile(self, cache: EntryStore, signature: CallSignature) -> Decision:
        """The compile pipeline (kernels/pipeline.py), then what the store holds
        for the signature (another process's entry if it published first)."""
        if _compiler_failures.given_up is not None:
            return self._eager(f"the C++ compiler failed on several signatures in this process: {_compiler_failures.given_up}", signature)
        crash = runtime_crashes(cache.directory.name)
        if crash is not None:
            return self._eager(_not_loaded(crash), signature)
        if (recorded := self._recorded_verdict(cache, signature)) is not None:
            return recorded
        if (too_many := self._too_many_variants(signature)) is not None:
            return too_many
        family = self._family(signature)
        limit = settings.max_shape_compiles.get()
        if family.compiles >= limit:
            reason = (
                f"{family.compiles} kernels already compiled for shapes of this family "
                f"({settings.max_shape_compiles.name}={limit}); further shapes run eagerly"
            )
            self._eager(reason, signature)
            self._record_verdict(signature, family_limit_key(signature), reason)
            # The C++ side keeps it for the whole family: its further shapes do not ask again.
            return self._remember(signature, RunEagerly(reason, ShapeFamily.any_shape(signature)))
        family.compiles += 1
        load = lambda library, counts: self._load(library, counts, signature, known_good=False)  # noqa: E731
        dynamic = self._kernel_to_compile(signature, family)
        outcome: Outcome | None = None
        if dynamic is not None:
            outcome = compile_signature(self.op, signature, cache, load, dynamic, seen=family.seen, timer=self.timer)
            # Where the compiler itself failed, a static compile would too.
            if isinstance(outcome, NotCompiled) and not outcome.eager_raised and outcome.compiler_error is None:
                family.dynamic_failed = outcome.reason
                log.info("aoti_eager: no dynamic-shape kernel for %s (%s): %s; compiling this shape alone",
                         self.name, signature.short(), outcome.reason)
                outcome = None
        family.see(signature)
        if outcome is None:
            outcome = compile_signature(self.op, signature, cache, load, timer=self.timer)
        if isinstance(outcome, NotCompiled):
            if outcome.eager_raised:
                # An error of these values, not of the signature, when numbers are inputs.
                return RetryLater(outcome.reason) if signature.runtime_arguments else self._remember(signature, RunEagerly(outcome.reason))
            if outcome.compiler_error is not None:
                _compiler_failures.add(outcome.compiler_error)
            if outcome.any_values:
                return self._eager_for_values(signature, outcome.reason)
            return self._eager(outcome.reason, signature)
        self.stats.compiles += 1
        self.stats.compile_seconds += outcome.seconds
        self._compiled_kinds.add((str(signature.device), kinds_key(signature)))
        stages = ", ".join(f"{stage} {t:.1f} s" for stage, t in outcome.stages.items())
        described = outcome.family.short(signature.to_json()) if outcome.family else signature.short()
        log.info("aoti_eager: compiled %s for (%s) in %.1f s (%s)", self.name, described, outcome.seconds, stages)
        try:
            # What the store holds now: this entry, or another process's that won the race.
            with cache.hold(self.name, outcome.key) as published:
                if published is None:  # removed or set aside meanwhile
                    decision = self._eager("its new cache entry is gone", signature)
                else:
                    # None: another process won with a verdict on speed, which is not kept here.
                    decision = self._adopt(signature, published, loaded=False, dynamic=outcome.family) or RetryLater("eager was measured faster")
                    if outcome.family is not None:
                        family.published[outcome.key] = outcome.family
                        family.decisions[outcome.key] = decision
                        # Timed against eager at this call when it was published.
                        family.verdicts.setdefault((outcome.key, outcome.family.size_range([t.sizes for t in tensor_args(signature)])), None)
                        decision = self._remember(signature, self._in_range(signature, family, outcome.key, decision))
        except DamagedEntry as e:
            decision = self._eager(f"its new cache entry is damaged: {e}", signature)
        self._keep_size_limit()
        return decision

    def _keep_size_limit(self) -> None:
        # The size limit is the whole root's, every environment of it: housekeeping
        # of the local cache, not an operation of one store.
        limit = settings.cache_size.get()
        eviction = inventory.evict(self.root, max_bytes=limit)
        if eviction.removed:
            log.info(
                "aoti_eager: evicted %d least recently used cache entries (%d bytes) to stay under %d bytes",
                len(eviction.removed), sum(listing.bytes for listing in eviction.removed), limit,
            )

    def _adopt(self, signature: CallSignature, entry: Entry, loaded: bool, dynamic: ShapeFamily | None = None) -> Decision | None:
        """What ``entry`` decides; None for a verdict on speed that is not kept
        (compile again). ``dynamic``: the entry is that dynamic kernel's."""
        if entry.library is None and entry.timing is not None:
            if not settings.keep_faster.get():
                return None  # a verdict on speed, which the timing's switch turned off: compile
            return self._keep_eager(signature, entry.reason or "eager is faster")
        if entry.library is None:
            # Recorded for every value too, where its numbers did not matter (a kernel of the op cannot run).
            values = self._recorded_verdict(self.cache(signature.device), signature, of_family=False)
            return values or self._eager(entry.reason or "decided eager", signature)
        try:
            kernel = self._load(entry.library, entry.output_counts, signature, known_good=True)
        except UnsafeToLoad as e:
            return self._eager(_not_loaded(str(e)), signature)
        except DamagedEntry:
            raise
        except Exception as e:  # noqa: BLE001 - the entry's problem, not the environment's
            raise DamagedEntry(f"its kernel does not load: {e}") from e
        if loaded:
            self.stats.cache_loads += 1
        return self._remember(signature, UseKernel(kernel, dynamic))

    def _remember(self, signature: CallSignature, decision: Decision) -> Decision:
        self.decisions[signature.decision_key] = decision
        return decision

    def _load(self, library: Path, output_counts: list[int], signature: CallSignature, known_good: bool) -> Any:
        """The kernel of ``library``, checked against what the call will give it
        (its outputs against ``output_counts``: the C++ constructor checks them)."""
        device = signature.device
        check_loads(self.cache(device).directory.name, library, str(device), output_counts, known_good)
        kernel = _extension.load().CompiledKernel(str(library), str(device), output_counts, signature.runtime_arguments)
        inputs = len(flat_tensor_inputs(signature))
        if kernel.num_inputs != inputs:
            raise DamagedEntry(f"its library takes {kernel.num_inputs} inputs, a call ({signature.short()}) gives {inputs}")
        return kernel

    def _keep_eager(self, signature: CallSignature, reason: str) -> RunEagerly:
        """Eager for good, where it was measured faster than the kernel: for
        every value of the signature's runtime numbers too."""
        self._eager_faster.add(signature.decision_key)
        self.stats.last_fallback_reason = reason
        log.info("aoti_eager: %s on %s keeps eager for (%s): %s", self.name, self.device, signature.short(), reason)
        return self._remember(signature, RunEagerly(reason, numbers=tuple(signature.runtime_arguments)))

    def _eager(self, reason: str, signature: CallSignature | None = None) -> RunEagerly:
        """Eager for the signature (remembered, if given) and logged, once."""
        decision = RunEagerly(reason)
        if signature is not None:
            self._remember(signature, decision)
            if signature.runtime_arguments:
                # Not final: decide() tries the call next with its numbers compiled in.
                log.debug("aoti_eager: %s on %s takes no runtime numbers: %s", self.name, self.device, reason)
                return decision
        self.stats.last_fallback_reason = reason
        self._log(reason)
        return decision

    def _log(self, reason: str) -> None:
        if (self.name, self.device, reason) not in _logged:
            _logged.add((self.name, self.device, reason))
            log.warning("aoti_eager: %s on %s runs eagerly: %s", self.name, self.device, reason)


def _not_loaded(crash: str) -> str:
    return f"kernels of this cache environment are not loaded: {crash}"


def _unusable_cache(root: Path, error: OSError) -> str:
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


def _disk_full(root: Path) -> str:
    """Why a kernel could not be published into the cache at ``root``: its
    disk is full (not the compile's scratch, which the error names)."""
    _full_disks[root] = free = _free_bytes(root)
    try:
        where = f"the file system mounted at {_mount_point(root)}"
    except OSError:
        where = "its file system"
    return (f"the cache at {root} is full ({where} has {free} bytes free); calls run eagerly, and the kernel is "
            f"compiled again once space is freed (`aoti-eager cache prune`, or a smaller {settings.cache_size.name})")


def _still_full(root: Path) -> RetryLater | None:
    """RetryLater while the disk of the cache at ``root``, found full, has no more space free than then."""
    full_at = _full_disks.get(root)
    if full_at is None:
        return None
    if _free_bytes(root) <= full_at:
        return RetryLater(f"the cache at {root} is still full", retry_after=DISK_FULL_RETRY_SECONDS)
    del _full_disks[root]
    return None


# (op, device, reason) already logged: one line per process, not per call.
_logged: set[tuple[str, str, str]] = set()
_tokens = itertools.count()
_by_token: dict[int, Override] = {}
_installed: dict[tuple[OpOverload, str], Override] = {}
# Overrides that uninstall() took out of the dispatcher, with what they know:
# install() puts one back as it was (decisions, loaded kernels, verdicts),
# so that enabling again costs no lookup, load or compile.
_removed: dict[tuple[OpOverload, str], Override] = {}
_handler_set = False


# Entry key -> the dynamic kernel a prewarm worker compiles under it (see
# plan()): a fresh process has not seen the shapes that chose it.
_planned: dict[str, ShapeFamily] = {}


def plan(key: str, family: ShapeFamily) -> None:
    """A miss whose kernel of ``family`` has the entry ``key`` compiles that kernel."""
    _planned[key] = family


# Per thread: how deep it is in misses_held_back().
_holding_back = threading.local()


@contextlib.contextmanager
def misses_held_back() -> Iterator[None]:
    """Misses of enabled ops on this thread run the original kernel, and are
    decided at their next call after the block: nothing is compiled or
    loaded. Hits run their kernels, and other threads are unaffected."""
    _holding_back.depth = getattr(_holding_back, "depth", 0) + 1
    try:
        yield
    finally:
        _holding_back.depth -= 1


def _on_miss(token: int, args: list[Any], decide: bool) -> Decision:
    """The miss handler of csrc/op_override.h. With ``decide`` false the call
    could not be keyed: it runs eagerly, and only why is recorded."""
    override = _by_token.get(token)
    if override is None:
        return RetryLater("the override was removed")
    if decide and getattr(_holding_back, "depth", 0):
        return RetryLater("misses are held back on this thread")
    try:
        if not decide:
            override.report_unkeyable(args)
            return RetryLater("arguments the C++ call key does not cover")
        return override.decide(args)
    except Exception:  # noqa: BLE001 - never let a miss take the user's call down
        log.exception("aoti_eager: internal error while handling a call of %s; running it eagerly", override.name)
        return RetryLater("internal error")


def install(
    op: OpOverload, device: str, root: Path, recorder: Recorder | None = None, compile: str = "now",
    remote: str | None = None,
) -> Override | None:
    """Overrides ``op`` at ``device``'s dispatch key; for an op already
    overridden, only the recorder, the compile mode and the fleet cache change."""
    global _handler_set
    key = (op, device)
    if key in _installed:
        _installed[key].recorder, _installed[key].compile = recorder, compile
        if remote is not None and remote != _installed[key].remote:
            _installed[key].remote = remote
            _installed[key]._caches.clear()
        return _installed[key]
    if (restored := _restore(key, root, remote, recorder, compile)) is not None:
        return restored
    if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), DISPATCH_KEYS[device]):
        return None
    C = _extension.load()
    if not _handler_set:
        C.set_miss_handler(_on_miss)
        _handler_set = True
    override = Override(op, device, root, next(_tokens), recorder=recorder, compile=compile, remote=remote)
    override.handle = C.Override(op._schema.name, op._schema.overload_name, DISPATCH_KEYS[device], override.token)
    _by_token[override.token] = override
    _installed[key] = override
    return override


def _restore(
    key: tuple[OpOverload, str], root: Path, remote: str | None, recorder: Recorder | None, compile: str
) -> Override | None:
    """The override that uninstall() removed for ``key``, installed again with
    its stats at zero, where it was enabled the same way (cache, compile mode,
    manifest: a run that records its misses, or compiles them, starts from
    the cache); else None."""
    override = _removed.pop(key, None)
    path = lambda r: None if r is None else r.path  # noqa: E731
    if override is None or (override.root, override.remote, override.compile, path(override.recorder)) != (
        root, remote, compile, path(recorder)
    ):
        return None
    override.stats = OpStats()
    override.handle.restore()
    _by_token[override.token] = override
    _installed[key] = override
    return override


def uninstall(op: OpOverload | None = None, device: str | None = None) -> None:
    """Restores the original kernels of ``op`` (every op if None) on ``device``
    (every device if None). What the overrides know stays, for :func:`install`."""
    for key in [k for k in _installed if op in (None, k[0]) and device in (None, k[1])]:
        override = _installed.pop(key)
        override.handle.remove()
        _by_token.pop(override.token, None)
        _removed[key] = override


def forget() -> None:
    """Drops what removed overrides knew: ops enabled again start as in a new
    process, from the cache."""
    _removed.clear()


def installed() -> list[Override]:
    return list(_installed.values())
