"""The miss path: what one overridden op's calls of a new signature run.

The C++ kernel (csrc/op_override.cpp) serves every call whose signature it has
seen. On a new signature its miss handler (:mod:`aoti_eager._overrides`, which
installs the overrides) asks the op's :class:`Override`, which decides once per
signature: a kernel from the persistent cache, a fresh compile, or eager.

The decision is one of the classes of :mod:`aoti_eager._decisions`; which
kernel to compile, the planner's (:mod:`aoti_eager._planner`).

A dynamic kernel is timed against eager again in each range of sizes
(:meth:`ShapeFamily.size_range`) that a call brings it to, and keeps eager in
the ranges where it loses: the first call of a new range misses.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._ops import OpOverload

from aoti_eager import _background, _mechanism, settings
from aoti_eager._options import Compile, Options
from aoti_eager._decisions import BACKGROUND_RETRY_SECONDS, Decision, RetryLater, RunEagerly, UseKernel
from aoti_eager._planner import Eager, IntLookup, Planner
from aoti_eager._stats import Stats
from aoti_eager.cache import DamagedEntry, Entry, UntrustedEntry
from aoti_eager.cache.entry_store import EntryStore, LockedElsewhere
from aoti_eager.kernels import CallSignature, Unsupported
from aoti_eager.kernels.dynamic import ShapeFamily, tensor_args, tensor_sizes
from aoti_eager.kernels.inductor.load_probe import UnsafeToLoad
from aoti_eager.kernels.op_target import OpTarget
from aoti_eager.kernels.pipeline import NotCompiled, Published, publish_verdict
from aoti_eager.kernels.signature import Position, qualified_name
from aoti_eager.kernels.speed import Timer

log = logging.getLogger("aoti_eager")


@dataclass
class Override:
    """One op overload overridden at one device's dispatch key: the miss
    path's decisions, locks, loads, stats and logs (which kernel to compile is its planner's)."""

    op: OpOverload
    device: str  # the device type: "cpu" or "cuda"
    # Its cache, fleet cache and manifest; BACKGROUND compiles in a worker, its calls eager meanwhile.
    options: Options
    token: int
    handle: Any = None
    stats: Stats = field(default_factory=Stats)
    # CallSignature.decision_key -> what its calls run (never RetryLater).
    decisions: dict[tuple[str, str], Decision] = field(default_factory=dict)
    planner: Planner = field(default_factory=Planner)
    _caches: dict[str, EntryStore] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    queued: _background.Queued = field(default_factory=_background.Queued)
    # A miss ran eagerly while the CPU's vector ISAs were probed: it compiles at its next call after the probe.
    _waits_for_probe: bool = False
    # Times kernels against eager (kernels/speed.py); None: the pipeline's own.
    timer: Timer | None = None

    @property
    def name(self) -> str:
        return qualified_name(self.op)

    def cache(self, device: torch.device) -> EntryStore:
        """The cache of kernels for ``device``; a miss here waits for no other machine's compile (calls run eagerly)."""
        if str(device) not in self._caches:
            self._caches[str(device)] = _mechanism.open_cache(self.options.root, device, self.options.remote, wait=0.0)
        return self._caches[str(device)]

    def compiles_running(self) -> int:
        """Background compiles of this op not finished yet, and one for those that wait for the CPU's vector-ISA probe."""
        return self.queued.running() + self._waits_for_probe

    def enabled_again(self, options: Options) -> None:
        """Takes ``options``' recorder and compile mode, and its fleet cache
        where one is given; the cache's root stays."""
        remote = self.options.remote if options.remote is None else options.remote
        if remote != self.options.remote:
            self._caches.clear()  # each was opened with the old fleet cache behind it
        self.options = dataclasses.replace(options, root=self.options.root, remote=remote)

    def unkeyable(self, args: list[Any]) -> Decision:
        """A call the C++ side could not key: it runs eagerly, and only why is recorded."""
        try:
            CallSignature.of(self.op, self.device, args)
            why = "arguments of a kind the C++ call key does not cover"
        except Unsupported as e:
            why = str(e)
        return RetryLater(self._eager(f"unsupported input: {why}").reason)

    def decide(self, args: list[Any]) -> Decision:
        """The miss path: what calls of the signature of ``args`` run."""
        self._waits_for_probe = self.options.compile == Compile.BACKGROUND and self.device == "cpu" and not _background.vec_isas_known()
        if self._waits_for_probe:
            return RetryLater("probing the CPU's vector ISAs in the background", retry_after=BACKGROUND_RETRY_SECONDS)
        try:
            signature = CallSignature.of(self.op, self.device, args)
        except Unsupported as e:
            return self._eager(f"unsupported input: {e}")
        with self._lock:
            runtime_ints, lookups = self.planner.runtime_ints(signature)
        if lookups and (published := _published_ints(self, signature.device, lookups)):
            with self._lock:  # another process saw these ints move: its kernel serves this value too
                runtime_ints = self.planner.ints_published(signature, published)
        if runtime_ints:
            # Ints that moved: one kernel takes them at run time, for every later value.
            with_ints = signature.with_runtime_ints(runtime_ints)
            decision = self._decide(with_ints)
            served = not self._falls_back(decision, with_ints)
            with self._lock:
                self.planner.ints_served(signature, runtime_ints, served)
            if served:
                return decision
            log.info("aoti_eager: %s on %s compiles the values of %s in: %s", self.name, self.device,
                     ", ".join(signature.name_of(p) for p in signature.int_arguments if p in runtime_ints), decision.reason)
        decision = self._decide(signature)
        # No kernel takes these numbers as inputs: compile their values in (a recorded request is the first form).
        return self._decide(signature.with_constant_numbers()) if self._falls_back(decision, signature) else decision

    def _falls_back(self, decision: Decision, signature: CallSignature) -> bool:
        return self.planner.falls_back(decision, signature, compiles=self.options.compile != Compile.NEVER)

    def _decide(self, signature: CallSignature) -> Decision:
        if (known := self.decisions.get(signature.decision_key)) is not None:
            return known
        if signature.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return RetryLater("no compile or load inside CUDA graph capture")
        with self._lock:  # threads that miss the same signature decide it once
            if (known := self.decisions.get(signature.decision_key)) is not None:
                return known
            try:
                return self._miss(self.cache(signature.device), signature)
            except UntrustedEntry as e:
                return self._eager(f"refused an untrusted cache entry: {e}", signature)
            except LockedElsewhere as e:
                return RetryLater(_mechanism.waited_for(e), retry_after=e.retry_after)
            except TimeoutError as e:
                reason = _mechanism.waited_for(e)
                _mechanism.log_eager_once(self.name, self.device, reason)
                return RetryLater(reason)
            except OSError as e:  # after TimeoutError, which is one
                if e.errno not in _mechanism.DISK_FULL:
                    return self._eager(_mechanism.unusable_cache(self.options.root, e), signature)
                reason = _mechanism.disk_full(self.options.root)
                _mechanism.log_eager_once(self.name, self.device, reason)
                return RetryLater(reason, retry_after=_mechanism.DISK_FULL_RETRY_SECONDS)

    def _miss(self, cache: EntryStore, signature: CallSignature) -> Decision:
        """A kernel of the cache, else what the compile mode says. Under the lock."""
        if decision := self._background_ended(signature) or self._from_cache(cache, signature) or self._from_family(cache, signature):
            return decision
        request = self.planner.request(signature)
        if self.options.recorder is not None:
            self.options.recorder.record(request)
        together = self.options.compile == Compile.NOW and _background.together()
        compile = Compile.BACKGROUND if together else self.options.compile
        if compile != Compile.NOW:
            # No compile here sees the shape; the family must, for the dims of its next one.
            self.planner.family(signature).see(signature)
        if compile == Compile.NEVER:
            return self._remember(signature, RunEagerly("compile='never'"))
        if compile == Compile.BACKGROUND:
            # A forward that waits for its compiles counts them as a compile here would: within the family's limits.
            planned = self.planner.to_compile(signature) if together else self.planner.count_variant(signature) or request
            if isinstance(planned, Eager):
                return self._run_eagerly(signature, planned)
            self.stats.queued += self.queued.add(signature.decision_key, planned, self.options.root, self.options.remote)
            if not together or not self.planner.waited_for(signature):
                return RetryLater("compiling in the background", retry_after=BACKGROUND_RETRY_SECONDS)
            _background.join(self.queued.get(signature.decision_key), lambda: self._decide(signature))
            # Asked again at the next call: the forward's end has decided it by then.
            return RetryLater("compiling beside the forward's other misses")
        if (full := _mechanism.still_full(self.options.root)) is not None:
            return RetryLater(full, retry_after=_mechanism.DISK_FULL_RETRY_SECONDS)
        # Inductor's lock innermost: no other compile of this process waits on the caches' locks.
        with cache.lock_signature(self.name, signature.key, timeout=settings.lock_timeout.get()), _mechanism.compile_lock:
            # Another process may have compiled it while we waited.
            return self._from_cache(cache, signature) or self._from_family(cache, signature) or self._compile(cache, signature)

    def _background_ended(self, signature: CallSignature) -> Decision | None:
        """RetryLater while the signature's background compile runs; eager where it failed; else None."""
        if (compiling := self.queued.get(signature.decision_key)) is None or not compiling.done():
            # In a forward that waits for it (_background.together), the next call asks again: its end decides it.
            retry_after = 0.0 if _background.together() else BACKGROUND_RETRY_SECONDS
            return compiling and RetryLater("compiling in the background", retry_after=retry_after)
        request, outcome = self.queued.finish(signature.decision_key)
        if outcome.status == "failed":
            if request.family is None:
                return self._eager(f"background compile failed: {outcome.reason}", signature)
            # As after a dynamic compile that fails here: the family's shapes compile alone (this one may be compiled).
            self.planner.family(signature).dynamic_failed = outcome.reason
        return None

    def _from_cache(self, cache: EntryStore, signature: CallSignature, key: str | None = None, dynamic: ShapeFamily | None = None) -> Decision | None:
        """The decision the published entry ``key`` holds (None: the signature's
        own; ``dynamic``: that dynamic kernel's), or None if there is none."""

        def adopt(entry: Entry) -> Decision | None:
            if dynamic is None:  # a shape another process compiled is one of its family's shapes here too
                self.planner.family(signature).see(signature)
            decision = self._adopt(signature, entry, loaded=True, dynamic=dynamic)
            if dynamic is not None and isinstance(decision, UseKernel) and entry.timing is not None:
                self.planner.judged_at_compile(signature, key, dynamic, tensor_sizes(entry.signature))
            return decision

        return _mechanism.held(cache, self.name, key or signature.key, adopt)

    def _from_family(self, cache: EntryStore, signature: CallSignature) -> Decision | None:
        """The decision of a dynamic kernel whose guards admit ``signature`` (this process's, or another's), or None."""
        found = _mechanism.from_family(cache, self.planner.family(signature), OpTarget(self.op, signature),
                                       lambda key, dynamic: self._from_cache(cache, signature, key, dynamic))
        return None if found is None else self._use_dynamic(signature, *found)

    def _use_dynamic(self, signature: CallSignature, key: str, dynamic: ShapeFamily, decision: Decision) -> Decision:
        """The dynamic kernel ``key``'s ``decision`` for ``signature``'s range of sizes."""
        in_range = self.planner.use_dynamic(signature, key, dynamic, decision, lambda k: _mechanism.slower_here(k, signature, self.op, self.timer))
        return self._remember(signature, in_range)

    def _compile(self, cache: EntryStore, signature: CallSignature) -> Decision:
        """Compiles what the planner asks for: then what the store holds (another process's, if it published first)."""
        if (why_not := _mechanism.cannot_compile(cache)) is not None:
            return self._eager(why_not, signature)
        request = _mechanism.recorded_verdict(cache, self.name, self.planner.verdict_keys(signature)) or self.planner.to_compile(signature)
        if isinstance(request, Eager):
            return self._run_eagerly(signature, request)
        outcome, failed = _mechanism.compile_kernel(self.op, signature, cache, request.family, self.planner.family(signature).seen, self.timer)
        self.planner.compiled(signature, failed, kernel=isinstance(outcome, Published))
        if isinstance(outcome, NotCompiled):
            if outcome.eager_raised:
                # An error of these values, not of the signature, when numbers are inputs.
                return RetryLater(outcome.reason) if signature.runtime_arguments else self._remember(signature, RunEagerly(outcome.reason))
            return self._run_eagerly(signature, Eager(outcome.reason, "values")) if outcome.any_values else self._eager(outcome.reason, signature)
        self.stats.compiled(outcome.seconds)
        decision = self._published(cache, signature, outcome)
        _mechanism.keep_size_limit(self.options.root)
        return decision

    def _published(self, cache: EntryStore, signature: CallSignature, outcome: Published) -> Decision:
        """What the store holds now: ``outcome``'s entry, or another process's that won the race."""
        try:
            with cache.hold(self.name, outcome.key) as published:
                if published is None:  # removed or set aside meanwhile
                    return self._eager("its new cache entry is gone", signature)
                # None: another process won with a verdict on speed, which is not kept here.
                decision = self._adopt(signature, published, loaded=False, dynamic=outcome.family) or RetryLater("eager was measured faster")
                if outcome.family is None:
                    return decision
                # Timed against eager at this call when it was published.
                self.planner.judged_at_compile(signature, outcome.key, outcome.family, [t.sizes for t in tensor_args(signature)])
                return self._use_dynamic(signature, outcome.key, outcome.family, decision)
        except DamagedEntry as e:
            return self._eager(f"its new cache entry is damaged: {e}", signature)

    def _adopt(self, signature: CallSignature, entry: Entry, loaded: bool, dynamic: ShapeFamily | None = None) -> Decision | None:
        """What ``entry`` (of ``dynamic``, if given) decides; None for a verdict on speed not kept (compile again)."""
        if entry.library is None and entry.timing is not None:
            if not settings.keep_faster.get():
                return None  # a verdict on speed, which the timing's switch turned off: compile
            return self._keep_eager(signature, entry.reason or "eager is faster")
        if entry.library is None:
            # Recorded for every value too, where its numbers did not matter (a kernel of the op cannot run).
            values = _mechanism.recorded_verdict(self.cache(signature.device), self.name, self.planner.verdict_keys(signature, of_family=False))
            return self._run_eagerly(signature, values) if values else self._eager(entry.reason or "decided eager", signature)
        try:
            kernel = _mechanism.load_entry(self.cache(signature.device), signature, entry)
        except UnsafeToLoad as e:
            return self._eager(_mechanism.not_loaded(str(e)), signature)
        if loaded:
            self.stats.cache_loads += 1
        return self._remember(signature, UseKernel(kernel, dynamic))

    def _remember(self, signature: CallSignature, decision: Decision) -> Decision:
        self.decisions[signature.decision_key] = decision
        return decision

    def _keep_eager(self, signature: CallSignature, reason: str) -> RunEagerly:
        """Eager for good, where it was measured faster than the kernel."""
        log.info("aoti_eager: %s on %s keeps eager for (%s): %s", self.name, self.device, signature.short(), reason)
        return self._remember(signature, self.planner.eager_is_faster(signature, reason))

    def _eager(self, reason: str, signature: CallSignature | None = None) -> RunEagerly:
        """Eager for the signature (remembered, if given) and logged, once."""
        decision = RunEagerly(reason)
        if signature is not None:
            self._remember(signature, decision)
            if signature.runtime_arguments:
                # Not final: decide() tries the call next with its numbers compiled in.
                log.debug("aoti_eager: %s on %s takes no runtime numbers: %s", self.name, self.device, reason)
                return decision
        _mechanism.log_eager_once(self.name, self.device, reason)
        return decision

    def _run_eagerly(self, signature: CallSignature, verdict: Eager) -> RunEagerly:
        """Eager as the planner's ``verdict`` says, logged once, and recorded in the cache where it says so."""
        if verdict.record is not None:
            _record(self.cache(signature.device), signature, verdict)
        _mechanism.log_eager_once(self.name, self.device, verdict.reason)
        return self._remember(signature, self.planner.eager(signature, verdict))


def _published_ints(override: Override, device: torch.device, lookups: list[IntLookup]) -> frozenset[Position]:
    """The ints of the first of ``lookups`` (the planner's) whose kernel the cache holds, or none."""
    try:
        cache = override.cache(device)
        published = {key for _, key in cache.entries(override.name)}
        for taken, key, family in lookups:
            kernels = [k for k in published if k == key or k.startswith(family)]
            if any((entry := cache.lookup(override.name, k)) is not None and entry.library is not None for k in kernels):
                return taken
    except (DamagedEntry, UntrustedEntry, OSError):
        pass  # the miss finds it out again, and says so
    return frozenset()


def _record(cache: EntryStore, signature: CallSignature, verdict: Eager) -> None:
    """Records ``verdict`` in the cache, so that other processes do not compile to find out again."""
    try:
        publish_verdict(cache, qualified_name(signature.op), signature, verdict.record, verdict.reason)
    except OSError as e:
        log.debug("aoti_eager: recording a verdict on %s failed: %s", qualified_name(signature.op), e)
