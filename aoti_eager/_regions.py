"""Fused regions: a model's repeated blocks, each call one compiled library.

:func:`fuse` replaces the ``forward`` of each chosen instance with
:meth:`_Instance.forward` (an instance attribute; :func:`unfuse` deletes it).
A call describes itself (kernels/region.py), finds what its key runs in this
process, else in the cache, else compiles it (as ``compile`` says), and runs
the library on the instance's state and the call's tensors. Calls no kernel
serves run the original forward, with one log line per region and reason.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import itertools
import json
import logging
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.utils._pytree as pytree

from aoti_eager import _background, _extension, _mechanism, settings
from aoti_eager._options import Compile, Options
from aoti_eager._planner import Family
from aoti_eager.cache import DamagedEntry, UntrustedEntry
from aoti_eager.cache.entry_store import EntryStore
from aoti_eager.kernels import region_shapes, region_values
from aoti_eager.kernels.inductor.load_probe import UnsafeToLoad
from aoti_eager.kernels.region_target import RegionTarget
from aoti_eager.kernels.dynamic import ShapeFamily
from aoti_eager.kernels.pipeline import NotCompiled, Published, compile_target, publish_verdict
from aoti_eager.kernels.region import (
    NotARegion, Outputs, ReadsMore, RegionCall, RegionRequest, bypassed, call_tensors, code_digest, region_name,
    shared_writes, state_of, state_structure,
)
from aoti_eager.manifest import Recorder

@dataclass
class RegionStats:
    """What the calls of one region's instances did in this process."""

    calls: int = 0
    hits: int = 0
    # Calls that ran the original forward, and the last reason why.
    fallbacks: int = 0
    fallback_reason: str | None = None
    compiles: int = 0
    compile_seconds: float = 0.0
    cache_loads: int = 0
    queued: int = 0  # compiles started in the background


@dataclass
class _Decided:
    """What the calls of one key run: ``kernel`` with the result's ``outputs``, else eagerly for ``reason``."""

    kernel: Any = None
    outputs: Outputs | None = None
    reason: str | None = None
    # False: this call's own (eager raised on its values): the next call with the key decides again.
    lasting: bool = True
    # A kernel loaded from the cache: its entry, which eager's first result in this process checks (_learnt).
    loaded: _Loaded | None = None


@dataclass(frozen=True)
class _Loaded:
    """The entry a kernel was loaded from, and the structure of the result that it keeps."""

    cache: EntryStore
    name: str
    key: str
    structure: dict[str, Any] | None


log = logging.getLogger("aoti_eager")

_stats: dict[str, RegionStats] = {}
# Each region's fused modules alive: stats() has rows for those regions.
_live: dict[str, weakref.WeakSet] = collections.defaultdict(weakref.WeakSet)
# (cache directory of the environment, key, compile mode) -> what its calls run.
_decided: dict[tuple[str, str, str], _Decided] = {}
# (root, device, fleet cache's URL, how long its lock is waited for) -> the cache.
_caches: dict[tuple[Path, str, str | None, float], EntryStore] = {}
_lock = threading.RLock()


@dataclass
class _Prepared:
    """An instance's state as its kernel takes it, prepared once: valid while
    ``native`` finds its tree as it was (kernels/region_values.py: the
    modules, parameters, buffers and values it holds, their tensors'
    metadata, its training flags and hooks). What is assigned outside the
    tree does not concern it."""

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    native: Any  # _C.RegionState: the check, and the kernel run on these tensors then a call's
    structure: str
    hooked: str | None  # why hooks keep its calls from a kernel (region_values.hooked)
    # The calls decided with this state: their key (_keyed) -> their decision (shared through _decided);
    # those that run eagerly apart, found while the state's tensors are as they were (RegionState.find).
    memo: dict[Any, _Decided] = field(default_factory=dict)
    refused: dict[Any, _Decided] = field(default_factory=dict)

    def keep(self, key: Any, decided: _Decided) -> None:
        (self.memo if decided.kernel is not None else self.refused)[key] = decided


_RegionState: Any = None


def _native() -> Any:
    """The C++ side of the hit path (csrc/region_state.h)."""
    global _RegionState
    if _RegionState is None:
        _RegionState = _extension.load().RegionState
    return _RegionState


_NO_KWARGS: dict[str, Any] = {}
# The types pytree flattens (registered ones may be added later: the dict itself, not a copy).
_NODES = pytree.SUPPORTED_NODES


def _keyed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The memo key of a call (None where it has none) and the arguments its
    kernel's tensors are taken from: ``args`` and ``kwargs`` themselves where
    the C++ side keys them whole, else the leaves of their pytree, keyed with its spec."""
    native = _RegionState or _native()
    key = native.key(args, kwargs, _NODES)
    if key is not None:
        return key, args, kwargs
    leaves, spec = pytree.tree_flatten((args, kwargs))
    key = native.key(tuple(leaves), _NO_KWARGS, _NODES)
    return (None if key is None else (spec, key)), tuple(leaves), _NO_KWARGS


@dataclass
class _Instance:
    """A fused instance: its original forward and its prepared state. It
    holds its module weakly: the module holds it (its ``forward``), and a
    model let go of is freed at once, its regions' rows gone from stats()."""

    module_ref: weakref.ReferenceType
    name: str
    options: Options  # its compile mode, cache, fleet cache and manifest
    stats: RegionStats  # its region's
    prepared: _Prepared | None = None
    refused: str | None = None  # why no call of it is compiled
    # A forward set on the instance before fuse() (refused), called instead of its class's.
    replaced: Any = None

    @property
    def module(self) -> torch.nn.Module:
        return self.module_ref()

    def original(self, *args: Any, **kwargs: Any) -> Any:
        if self.replaced is not None:
            return self.replaced(*args, **kwargs)
        module = self.module_ref()
        return type(module).forward(module, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Traced (by the region's own compile, torch.export, torch.compile or torch.jit.trace): the code, not a kernel.
        if bypassed() or torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch._C._is_tracing():
            return self.original(*args, **kwargs)
        stats, p = self.stats, self.prepared
        stats.calls += 1
        # The C++ side keys the call and finds its decision at once, where its state and arguments allow.
        decided = None if p is None else p.native.find(p.refused, p.memo, args, kwargs, _NODES)
        if decided is not None and decided.kernel is None:
            # Decided eager (and said so) before: a refused call costs what its forward costs.
            stats.fallbacks += 1
            stats.fallback_reason = decided.reason
            module = self.module_ref()
            return type(module).forward(module, *args, **kwargs)
        return _call(self, stats, decided, args, kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A copy of a fused module (copy.deepcopy, pickle, torch.save) is fused alike, with its own state.
        return _fused_again, (self.module, self.name, self.options.kept_by_copies(), self.refused, self.replaced)

    def valid(self) -> _Prepared | None:
        """The prepared state where nothing it depends on changed, else None."""
        p = self.prepared
        return p if p is not None and p.native.unchanged() else None

    def state(self) -> _Prepared:
        """The prepared state, prepared again where it changed. Raises NotARegion."""
        p = self.valid()
        if p is None:
            module = self.module
            names, tensors = state_of(module)
            native = _native()(list(tensors), region_values.watched(module), list(region_values.sized(module)))
            p = self.prepared = _Prepared(names, tensors, native, state_structure(module, names, tensors),
                                          region_values.hooked(module))
        return p


def _fused_again(module: torch.nn.Module, name: str, options: Options, refused: str | None, replaced: Any) -> _Instance:
    """The instance of a copy of a fused module (see :meth:`_Instance.__reduce__`),
    made before the copy's attributes are set."""
    instance = _Instance(weakref.ref(module), name, options, _stats_of(name), refused=refused, replaced=replaced)
    _live[name].add(module)
    return instance


def _stats_of(name: str) -> RegionStats:
    return _stats.setdefault(name, RegionStats())


def _call(instance: _Instance, stats: RegionStats, decided: _Decided | None, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> Any:
    """A call that RegionState.find did not find decided eager: ``decided`` is what it found."""
    if instance.refused is not None:
        return _eagerly(instance, stats, instance.refused, args, kwargs)
    leaves, named = args, kwargs
    if decided is None:
        key, leaves, named = _keyed(args, kwargs)
        decided = _memoized(instance, key)
    if decided is None:
        try:
            decided, leaves, named, ran = _decide(instance, args, kwargs, key)
        except NotARegion as e:
            decided, ran = _refused(instance, key, str(e)), _NOT_RUN
        if ran is not _NOT_RUN:
            # The original forward ran, to learn what it reads: its result checks a kernel loaded from the cache.
            return _learnt(decided, ran, args, kwargs)
    if decided.kernel is None:
        return _eagerly(instance, stats, decided.reason or "decided eager", args, kwargs)
    if decided.outputs is None:
        return _learn_outputs(instance, decided, args, kwargs)
    if decided.outputs.writes and (shared := shared_writes(decided.outputs.writes, call_tensors(args, kwargs),
                                                           instance.prepared.tensors)) is not None:
        return _eagerly(instance, stats, shared, args, kwargs)
    try:
        tensors = instance.prepared.native.run(decided.kernel, leaves, named)
    except Exception as e:  # noqa: BLE001 - one line, not the runtime's C++ error
        said = (str(e).strip().splitlines() or [""])[0][:200]
        decided.kernel, decided.reason = None, f"compiled kernel failed to run: {type(e).__name__}: {said}"
        return _eagerly(instance, stats, decided.reason, args, kwargs)
    stats.hits += 1
    return decided.outputs.rebuild(tensors, call_tensors(args, kwargs) if decided.outputs.passes else ())


def _memoized(instance: _Instance, key: Any) -> _Decided | None:
    """The decision of a call with ``key`` that this instance's state
    decided before, while nothing it depends on changed; else None."""
    p = instance.valid() if key is not None else None
    return None if p is None else p.refused.get(key) or p.memo.get(key)


def _refused(instance: _Instance, key: Any, reason: str) -> _Decided:
    """Eager for ``reason``, which holds for the calls with ``key`` while the
    instance's state is as it is (as every reason NotARegion gives does):
    they run the original forward with no description of theirs again."""
    decided = _Decided(reason=reason)
    p = instance.valid() if key is not None else None
    if p is not None:
        p.keep(key, decided)
    return decided


def _learn_outputs(instance: _Instance, decided: _Decided, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The result of the original forward, from which a kernel loaded from
    the cache learns the structure of its results (see :func:`_learnt`)."""
    return _learnt(decided, instance.original(*args, **kwargs), args, kwargs)


def _learnt(decided: _Decided, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``result``, eager's, whose structure a kernel loaded from the cache
    gives its results in this process where it fits the kernel and the
    structure its entry keeps. Else the entry is damaged in a way its
    digests, recorded again, do not show: it is set aside, the calls of its
    key run eagerly here, and a new process compiles it again."""
    if decided.kernel is None or decided.outputs is not None:
        return result
    try:
        outputs = Outputs.of(result, call_tensors(args, kwargs))
    except NotARegion as e:
        decided.kernel, decided.reason = None, str(e)
        return result
    misfit = _misfit(decided, outputs)
    if misfit is None:
        # What the kernel writes into, which eager's result does not show: as its entry keeps it.
        kept = decided.loaded.structure or {}
        decided.outputs = dataclasses.replace(outputs, writes=tuple(kept.get("writes", ())))
        return result
    loaded = decided.loaded
    loaded.cache.set_aside(loaded.name, loaded.key, misfit)
    decided.kernel = None
    decided.reason = f"its cache entry was set aside as damaged ({misfit}); a new process compiles it again"
    return result


def _misfit(decided: _Decided, outputs: Outputs) -> str | None:
    """How eager's result, of structure ``outputs``, does not fit the kernel
    loaded from the cache or the structure its entry keeps; None where it
    fits (or where a type it holds has no name to compare by)."""
    tensors = decided.kernel.num_outputs
    if len(outputs.orders) != tensors:
        return f"its library returns {tensors} tensors, eager's result holds {len(outputs.orders)}"
    kept, eager = decided.loaded.structure, _kept_form(outputs)
    if kept is None or eager is None:
        return None
    try:
        kept = _kept_form(Outputs.from_json(kept, tensors))
    except NotARegion as e:
        return f"the structure of its result cannot be eager's: {e}"
    return None if kept[0] == eager[0] else f"the structure of its result, {kept[1]}, is not eager's, {eager[1]}"


def _kept_form(outputs: Outputs) -> tuple[str, str] | None:
    """``outputs`` as a cache entry keeps them, less their tensors' dims
    orders (which follow the call's sizes): as JSON text to compare (where
    True is not 1), and in words; None where pytree cannot name a type they hold."""
    kept = outputs.to_json()
    if kept is None:
        return None
    leaves = ["tensor" if "tensor" in leaf else f"input {leaf['passed']}" if "passed" in leaf else json.dumps(leaf["value"])
              for leaf in kept["leaves"]]
    return json.dumps([kept["spec"], leaves]), f"{' '.join(str(outputs.spec).split())} of [{', '.join(leaves)}]"


def _eagerly(instance: _Instance, stats: RegionStats, reason: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stats.fallbacks += 1
    stats.fallback_reason = reason
    if (instance.name, reason) not in _logged_eager:
        _log_eager_once(instance.name, reason)
    # While its kernel compiles, the ops inside are that kernel's to run: none compiled apart meanwhile.
    with _mechanism.own_work() if reason == COMPILING else contextlib.nullcontext():
        return instance.original(*args, **kwargs)


# (region, what was said) and (region, why it ran eagerly) already logged: one line per process, not per call.
_logged: set[tuple[str, str]] = set()
_logged_eager: set[tuple[str, str]] = set()


def _log_eager_once(name: str, reason: str) -> None:
    _logged_eager.add((name, reason))
    # Compiling in the background is what was asked for: no warning.
    _log_once(name, f" runs eagerly: {reason}", logging.INFO if reason == COMPILING else logging.WARNING)


def _log_once(name: str, said: str, level: int = logging.WARNING) -> None:
    if (name, said) not in _logged:
        _logged.add((name, said))
        log.log(level, "aoti_eager: %s%s", name, said)


def _decide(
    instance: _Instance, args: tuple[Any, ...], kwargs: dict[str, Any], key: Any
) -> tuple[_Decided, tuple[Any, ...], dict[str, Any], Any]:
    """What this call runs, the arguments its kernel's tensors are taken
    from, and the original forward's result where it ran to learn what it
    reads (else _NOT_RUN); raises NotARegion where no kernel may serve it. A
    lasting decision is kept in the state's memo under ``key``."""
    if instance.refused is not None:
        raise NotARegion(instance.refused)
    state = instance.state()
    if state.hooked is not None:
        raise NotARegion(state.hooked)
    call = RegionCall.of(instance.name, state.names, state.tensors, state.structure, args, kwargs)
    if torch.is_grad_enabled() and any(t.requires_grad for t in call.inputs()):
        raise NotARegion("grad is enabled and its parameters or inputs require grad (regions run without autograd)")
    if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        raise NotARegion("autocast is on (regions are compiled without it)")
    call, ran = _valued(instance, call, lambda: instance.original(*args, **kwargs))
    decided = _decision(instance, call)
    if decided.lasting and key is not None:
        state.keep(key, decided)
    return decided, call.leaves, _NO_KWARGS, ran


# The result of a call that did not run the original forward.
_NOT_RUN = object()
# A state's structure (state_structure) -> the attributes its forwards were seen to read in this process:
# its calls' keys hold their values. A superset of what one call reads keys it soundly, so it only grows.
_reads: dict[str, frozenset] = {}


def _valued(instance: _Instance, call: RegionCall, run: Any) -> tuple[RegionCall, Any]:
    """``call`` keyed with the values its forward reads (kernels/region_values.py),
    and the result of ``run`` (the original forward) where it ran to learn
    them (the state's first call here), else _NOT_RUN. Raises NotARegion for values no key holds."""
    reads, ran = _reads.get(call.structure), _NOT_RUN
    if reads is None:
        try:
            # The original kernels: ops enabled inside a block are the block's kernel's to run, not compiled apart.
            with _mechanism.own_work():
                ran, reads = region_values.recorded(instance.module, run)
        except region_values.UnkeyedValue as e:
            raise NotARegion(str(e)) from None
        reads = _reads[call.structure] = reads | _reads.get(call.structure, frozenset())
    return call.valued(instance.module, reads), ran


def _decision(instance: _Instance, call: RegionCall, compile: Compile | None = None) -> _Decided:
    """What ``call`` runs: decided before in this process, else by a miss
    compiling as ``compile`` says (default the instance's mode)."""
    cache = _cache(instance, call.device)
    with _lock:
        where = (str(cache.directory), call.key, instance.options.compile)
        decided = _decided.get(where)
        if decided is None:
            decided = _miss(instance, cache, call, compile or instance.options.compile)
            if decided.lasting:
                _decided[where] = decided
    return decided


def _cache(instance: _Instance, device: torch.device, wait: float = 0.0) -> EntryStore:
    """The instance's cache of kernels for ``device``, with its fleet cache
    behind, whose lock a miss waits ``wait`` seconds for (a call's: none)."""
    root, remote = instance.options.root, instance.options.remote
    where = (root, str(device), remote, wait)
    if where not in _caches:
        _caches[where] = _mechanism.open_cache(root, device, remote, wait=wait)
    return _caches[where]


def _miss(instance: _Instance, cache: EntryStore, call: RegionCall, compile: Compile) -> _Decided:
    try:
        if (compiled := _compiled_apart(cache, call)) is not None:
            return compiled
        _family_of(cache, call).saw(region_shapes.call_sizes(call), call.key)
        found = _from_cache(instance, cache, call) or _from_family(instance, cache, call)
        if found is None and instance.options.recorder is not None:
            _record(instance.options.recorder, call)
        if found is not None or compile == Compile.NEVER:
            return found or _Decided(reason="compile='never' and no kernel in the cache")
        if (why := _mechanism.cannot_compile(cache) or _over_limit(cache, call)) is not None:
            return _Decided(reason=why)
        if compile == Compile.BACKGROUND:
            return _compile_apart(instance, cache, call)
        with cache.lock_signature(call.name, call.key, timeout=settings.lock_timeout.get()), _mechanism.compile_lock:
            return (_from_cache(instance, cache, call) or _from_family(instance, cache, call)
                    or _compile_dynamic(instance, cache, call) or _compile(instance, cache, call))
    except TimeoutError as e:  # another's compile: the next call asks the caches again
        return _Decided(reason=_mechanism.waited_for(e), lasting=False)
    except (UntrustedEntry, UnsafeToLoad, OSError) as e:
        return _Decided(reason=f"{type(e).__name__}: {e}")


# (cache directory of the environment, region_shapes.values_key) -> kernels compiled here for those calls' numbers.
_value_variants: collections.Counter = collections.Counter()


def _over_limit(cache: EntryStore, call: RegionCall) -> str | None:
    """Why ``call`` runs eagerly instead of compiling, past a limit on the
    compiles of its numbers' values or of its family's shapes; else None,
    the compile counted. As dynamo's cache size limit: never compiling forever."""
    values = (str(cache.directory), region_shapes.values_key(call))
    limit = settings.max_value_variants.get()
    if _value_variants[values] >= limit:
        return (f"{_value_variants[values]} kernels already compiled for new values of the numbers in its call "
                f"({settings.max_value_variants.name}={limit}); further values run eagerly")
    why = _family_of(cache, call).over_limit()
    if why is None:
        _value_variants[values] += 1
    return why


def _record(recorder: Recorder, call: RegionCall) -> None:
    try:
        recorder.record(RegionRequest.of(call))
    except NotARegion as e:
        _log_once(call.name, f": a miss is not recorded into {recorder.path}: {e}")


def _from_cache(instance: _Instance, cache: EntryStore, call: RegionCall, compiled: bool = False,
                key: str | None = None) -> _Decided | None:
    """What the cache holds for ``call`` (under ``key``, else its own), its kernel loaded; None where it holds
    nothing usable (a damaged entry is set aside). ``compiled``: the entry was just published here (not counted
    as a load)."""
    key = key or call.key
    try:
        with cache.hold(call.name, key) as entry:
            if entry is None:
                return None
            if entry.library is None and entry.timing is not None and not settings.keep_faster.get():
                return None  # a verdict on speed, which the timing's switch turned off: compile
            if entry.library is None:
                return _Decided(reason=entry.reason or "decided eager")
            kernel = _mechanism.entry_kernel(_loader(cache, call, known_good=True), entry)
    except DamagedEntry:
        return None
    _stats_of(instance.name).cache_loads += not compiled
    # The structure of its results: eager's, once its first result here fits what the entry keeps (_learnt).
    return _Decided(kernel=kernel, loaded=_Loaded(cache, call.name, key, entry.result_structure))


COMPILING = "its kernel is compiling in the background"
# (cache directory of the environment, key) -> the background compile its calls wait for, and its region.
_compiling: dict[tuple[str, str], tuple[Future, str]] = {}


def _compile_apart(instance: _Instance, cache: EntryStore, call: RegionCall) -> _Decided:
    """Queues the compile of ``call``'s key for a thread of this process
    (``compile="background"``); the calls with the key run eagerly meanwhile."""
    # Its tensors as they are now: the caller goes on with them, and may write into them (a forward that does).
    call = call.copied()

    def compile_here() -> _Decided:
        module = instance.module
        if module is None:
            return _Decided(reason="its module was freed before it was compiled", lasting=False)
        apart = _sharing_state(module)
        # As an op's worker: it waits for another machine's compile of the key, no call does.
        waiting = _cache(instance, call.device, wait=settings.lock_timeout.get())
        with waiting.lock_signature(call.name, call.key, timeout=settings.lock_timeout.get()), _mechanism.compile_lock:
            return _from_cache(instance, waiting, call) or _compile(instance, waiting, call, apart=apart)

    _compiling[(str(cache.directory), call.key)] = (_background.submit_here(compile_here), instance.name)
    _stats_of(instance.name).queued += 1
    log.info("aoti_eager: compiling %s for (%s) in the background", call.name, call.short())
    return _Decided(reason=COMPILING, lasting=False)


def _compiled_apart(cache: EntryStore, call: RegionCall) -> _Decided | None:
    """What the background compile of ``call``'s key decided, once it ended
    (eager while it runs); None where none was queued."""
    where = (str(cache.directory), call.key)
    if where not in _compiling:
        return None
    future, _ = _compiling[where]
    if not future.done():
        return _Decided(reason=COMPILING, lasting=False)
    del _compiling[where]
    try:
        return future.result()
    except TimeoutError as e:  # another's compile outlasted the wait: the next call asks the caches again
        return _Decided(reason=_mechanism.waited_for(e), lasting=False)
    except Exception as e:  # noqa: BLE001 - the cache's errors: this key's calls run eagerly
        return _Decided(reason=f"its background compile failed: {type(e).__name__}: {e}")


def compiling(name: str) -> int:
    """The background compiles of region ``name`` not finished yet."""
    return sum(1 for future, region in list(_compiling.values()) if region == name and not future.done())


def _sharing_state(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``'s tree that runs its class's forward: new module
    objects with dicts of their own holding the same parameters, buffers and
    other values (nothing deep-copied, which a lock or a file would refuse).
    A compile traces it (the trace swaps its tensors for its own while it
    runs, and the recording of what it reads swaps its classes) while calls
    of other threads run ``module``."""
    apart = copy.copy(module)
    state = apart.__dict__
    state.pop("forward", None)
    state["_parameters"], state["_buffers"] = dict(module._parameters), dict(module._buffers)
    state["_modules"] = {name: None if m is None else _sharing_state(m) for name, m in module._modules.items()}
    return apart


def _compile(instance: _Instance, cache: EntryStore, call: RegionCall, dims: ShapeFamily | None = None,
             apart: torch.nn.Module | None = None) -> _Decided | None:
    """Compiles ``call``'s kernel (``dims``: its family's dynamic kernel of
    those dims; ``apart``: from a copy of the instance's module, in the
    background), and what the store then holds; None where a dynamic kernel
    failed (the shape then compiles alone)."""
    family = _family_of(cache, call)
    # A copy is traced: the module's own tensors stay real for calls of other threads meanwhile.
    target = RegionTarget(apart or _sharing_state(instance.module), call)
    try:
        with _mechanism.own_work():
            outcome = compile_target(target, cache, _loader(cache, call), dims, family.seen, in_background=apart is not None)
    except ReadsMore as e:
        # Its next call is keyed with these values too.
        _reads[call.base] = _reads.get(call.base, frozenset()) | e.reads
        return _Decided(reason=str(e), lasting=False)
    if isinstance(outcome, NotCompiled):
        if outcome.compiler_error is not None:
            _mechanism.compiler_failures.add(outcome.compiler_error)
        if dims is None:
            return _Decided(reason=outcome.reason, lasting=not outcome.eager_raised)
        return _dynamic_failed(cache, call, family, outcome)
    _count_compile(instance, call, outcome)
    if dims is not None:
        # What the store holds: another process's kernel where it published first.
        family.published[outcome.key] = dynamic = _mechanism.dynamic_kernel(cache, call.name, outcome.key)
        if dynamic is None or not region_shapes.admits(dynamic, outcome.key, call):
            return None
    decided = _from_cache(instance, cache, call, compiled=True, key=outcome.key)
    if decided is None or decided.kernel is None:
        return None if dims is not None else decided or _Decided(reason="its published kernel is not in the cache")
    decided.outputs = target.outputs
    if dims is not None:
        family.decisions[outcome.key] = decided
    return decided


def _dynamic_failed(cache: EntryStore, call: RegionCall, family: Family, outcome: NotCompiled) -> None:
    """The family's shapes compile alone from now on, recorded in the cache
    for every process, unless it may pass in a later one (the compiler's
    failure; eager's, of this call's values)."""
    if not outcome.eager_raised:
        family.dynamic_failed = outcome.reason
        if outcome.compiler_error is None:
            publish_verdict(cache, call.name, call, region_shapes.static_key(call), outcome.reason)
    log.info("aoti_eager: %s for (%s): %s; compiling this shape alone", call.name, call.short(), outcome.reason)


def _loader(cache: EntryStore, call: RegionCall, known_good: bool = False) -> Any:
    def load(library: Path, output_counts: list[int]) -> Any:
        return _mechanism.load_library(cache, call.device, library, output_counts, len(call.inputs()), call.short(),
                                       known_good=known_good)

    return load


def _count_compile(instance: _Instance, call: RegionCall, outcome: Published) -> None:
    stats = _stats_of(instance.name)
    stats.compiles += 1
    stats.compile_seconds = round(stats.compile_seconds + outcome.seconds, 3)
    log.info("aoti_eager: compiled %s for (%s) in %.1f s", call.name, call.short(), outcome.seconds)


# (cache directory of the environment, family key) -> what this process knows of the region family.
_families: dict[tuple[str, str], Family] = {}


def _family_of(cache: EntryStore, call: RegionCall) -> Family:
    return _families.setdefault((str(cache.directory), region_shapes.family_key(call)), Family())


def _from_family(instance: _Instance, cache: EntryStore, call: RegionCall) -> _Decided | None:
    """What a dynamic kernel whose guards admit ``call`` runs (this process's, or another's), or None."""
    family = _family_of(cache, call)
    # The local cache's, and the fleet's (looking one up publishes it locally, verified).
    keys = [key for key in cache.keys(call.name, region_shapes.family_key(call) + "-") if key not in family.published]
    family.published.update({key: _mechanism.dynamic_kernel(cache, call.name, key) for key in keys})
    for key, dynamic in family.dynamic():
        if region_shapes.admits(dynamic, key, call):
            decided = family.decisions.get(key) or _from_cache(instance, cache, call, key=key)
            if decided is not None:
                # One decision for every shape it admits: a result's structure is learnt once.
                return family.decisions.setdefault(key, decided)
            family.published.pop(key)
    return None


def _compile_dynamic(instance: _Instance, cache: EntryStore, call: RegionCall) -> _Decided | None:
    """Compiles the dynamic kernel the family's policy asks for, and what it
    decides; None where it asks for none or the kernel failed."""
    family = _family_of(cache, call)
    if family.dynamic_failed is None and (verdict := _mechanism.recorded_verdict(cache, call.name, [(region_shapes.static_key(call), "family")])):
        family.dynamic_failed = verdict.reason
    dims = family.moved_dims(region_shapes.call_sizes(call))
    return None if dims is None else _compile(instance, cache, call, dims)


def _fused(module: torch.nn.Module) -> _Instance | None:
    forward = module.__dict__.get("forward")
    owner = getattr(forward, "__self__", None)
    return owner if isinstance(owner, _Instance) else None


def _has_forward(module: torch.nn.Module) -> bool:
    return type(module).forward is not torch.nn.Module.forward


def _is_block(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a block that a region is made of by default: a
    forward of its own, of a class outside torch.nn or over two submodules or
    more. A leaf of torch.nn (a Linear, a norm, an activation, a dropout)
    gains little compiled alone, and is a region only where named."""
    if not _has_forward(module):
        return False
    return not type(module).__module__.startswith("torch.nn.") or next(itertools.islice(module.modules(), 2, None), None) is not None


def _listed(model: torch.nn.Module) -> set[type]:
    """The classes of the modules that ``model``'s layer lists (ModuleList, Sequential, ModuleDict) hold."""
    lists = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
    return {type(c) for m in model.modules() if isinstance(m, lists) for c in m.children()}


def chosen(model: torch.nn.Module, modules: Iterable[Any] | None) -> list[torch.nn.Module]:
    """The instances ``fuse`` makes regions of: those of ``modules`` (module
    instances or classes), else the blocks whose class repeats (two or more
    instances outside each other, whatever their parameters: one kernel per
    structure); never one inside another chosen one."""
    if modules is not None:
        wanted = list(modules)
        picks = lambda m: any(m is w or (isinstance(w, type) and isinstance(m, w)) for w in wanted)  # noqa: E731
    else:
        counts = collections.Counter(type(m) for m in model.modules() if m is not model and _is_block(m))
        repeated = {cls for cls, n in counts.items() if n >= 2}
        # The unit of a layer list where there is one (T5's blocks, not its encoder and decoder stacks).
        repeated = (repeated & _listed(model)) or repeated
        picks = lambda m: m is not model and type(m) in repeated and _is_block(m)  # noqa: E731
    result: list[torch.nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():  # outer modules first
        if id(m) in inside or not picks(m):
            continue
        result.append(m)
        inside.update(id(sub) for sub in m.modules())
    if modules is None:
        # A class that repeats only inside the regions (a final block like the blocks' own) is no region of its own.
        left = collections.Counter(type(m) for m in result)
        result = [m for m in result if left[type(m)] >= 2]
    return result


def fuse(model: torch.nn.Module, modules: Iterable[Any] | None, options: Options) -> list[str]:
    """Makes regions of the instances :func:`chosen` picks, compiling and
    keeping their kernels as ``options`` say; the regions' names."""
    names = []
    for module in chosen(model, modules):
        if _fused(module) is not None:
            continue
        name = region_name(module)
        instance = _Instance(weakref.ref(module), name, options, _stats_of(name), replaced=module.__dict__.get("forward"))
        instance.refused = _refusal(module)
        if instance.refused is not None:
            _log_eager_once(instance.name, instance.refused)
        module.forward = instance.forward
        _live[instance.name].add(module)
        names.append(instance.name)
    if options.compile == Compile.NOW and not _compiles_together(model):
        model.register_forward_pre_hook(_begin_together)
        model.register_forward_hook(_end_together, always_call=True)
    return names


# On the model fuse() was given, with compile="now": the op misses of its
# forward compile side by side in workers, and the forward returns once all
# have ended (_background.begin_together); a region's compiles where it is
# called, its kernel serving that call. Functions of the module, which a pickled model names.
def _begin_together(model: torch.nn.Module, args: Any) -> None:
    if not torch.compiler.is_compiling():
        _background.begin_together(model)


def _end_together(model: torch.nn.Module, args: Any, result: Any) -> None:
    if not torch.compiler.is_compiling():
        _background.end_together(model)


def _compiles_together(model: torch.nn.Module) -> bool:
    return _begin_together in model._forward_pre_hooks.values()


def _refusal(module: torch.nn.Module) -> str | None:
    """Why no call of ``module`` is compiled, or None."""
    if "forward" in module.__dict__:
        return "its forward is replaced on the instance, which its class's code does not describe"
    try:
        code_digest(module)
    except NotARegion as e:
        return str(e)
    return None


def forget() -> None:
    """Drops what this process decided of region calls and learnt of their
    families: calls of instances fused from now on decide again from the
    cache, as in a new process (an instance's own memo stays with it)."""
    with _lock:
        _decided.clear()
        _families.clear()


def unfuse(model: torch.nn.Module) -> None:
    """Restores the original forward of every fused instance in ``model``."""
    for module in model.modules():
        if (instance := _fused(module)) is not None:
            del module.__dict__["forward"]
            _live[instance.name].discard(module)
    for hooks in (model._forward_pre_hooks, model._forward_hooks):
        for handle in [h for h, hook in hooks.items() if hook in (_begin_together, _end_together)]:
            del hooks[handle]
            model._forward_hooks_always_called.pop(handle, None)


def stats() -> dict[str, dict[str, Any]]:
    """The :class:`RegionStats` of each region with fused modules alive, as a dict."""
    return {name: {**vars(s), "compiling": compiling(name)} for name, s in _stats.items() if _live[name]}


def fused_instances(model: torch.nn.Module) -> dict[tuple[str, str], list[_Instance]]:
    """The fused instances of ``model`` whose calls may compile, by (region
    name, state structure): what a recorded region request is matched with
    (the values their forwards read tell them apart, :func:`prewarm`)."""
    found: dict[tuple[str, str], list[_Instance]] = {}
    for module in model.modules():
        instance = _fused(module)
        if instance is None or instance.refused is not None:
            continue
        try:
            found.setdefault((instance.name, instance.state().structure), []).append(instance)
        except NotARegion:
            continue
    return found


def prewarm(instances: list[_Instance], request: RegionRequest) -> tuple[str, str | None, float]:
    """Compiles the kernel of the call ``request`` recorded, rebuilt with
    example tensors, for the first of ``instances`` whose call it keys
    (their values may differ), unless the cache has it: as a miss
    with ``compile="now"`` does (checked against eager, timed, published),
    its decision kept for this process's calls. Returns the status
    (``compiled``, ``cached``, ``eager`` or ``failed``), its reason and the compile's seconds."""
    stats = instances[0].stats
    compiles, seconds = stats.compiles, stats.compile_seconds
    before = torch.get_default_dtype()
    try:
        # The call's key holds the default dtype, which a forward's new tensors take.
        torch.set_default_dtype(getattr(torch, request.default_dtype))
        decided = _prewarm_any(instances, request)
        if not decided.lasting and (decided.reason or "").startswith("eager raised"):
            # Random integers can index past a short table (an embedding of 2 rows); zeros index any.
            decided = _prewarm_any(instances, request, zero_integers=True)
    except (NotARegion, TypeError, AttributeError) as e:
        return "failed", str(e), 0.0
    finally:
        torch.set_default_dtype(before)
    spent = stats.compile_seconds - seconds
    if decided.kernel is None:
        return ("eager" if decided.lasting else "failed"), decided.reason, spent
    return ("compiled" if stats.compiles > compiles else "cached"), None, spent


def _prewarm_any(instances: list[_Instance], request: RegionRequest, zero_integers: bool = False) -> _Decided:
    """What the call ``request`` recorded runs, for the first of ``instances`` it keys."""
    for instance in instances:
        decided = _prewarm_call(instance, request, zero_integers)
        if decided is not None:
            return decided
    raise NotARegion("its call rebuilt here is keyed differently from the recorded one (the values its forward "
                     "reads, or its code, differ)")


def _prewarm_call(instance: _Instance, request: RegionRequest, zero_integers: bool = False) -> _Decided | None:
    """What the call ``request`` recorded, rebuilt for ``instance``, runs (a
    miss compiles it now); None where the call is keyed otherwise for it."""
    state = instance.state()
    # The device of the instance's state: the model may have moved since (cuda:1).
    device = state.tensors[0].device if state.tensors else torch.device(request.device)
    args, kwargs = request.arguments(device, zero_integers)
    call = RegionCall.of(instance.name, state.names, state.tensors, state.structure, args, kwargs)
    with torch.no_grad():
        try:
            call, _ = _valued(instance, call, lambda: instance.original(*args, **kwargs))
        except NotARegion:
            raise
        except Exception as e:  # noqa: BLE001 - the example's values, as a compile's eager run would say
            return _Decided(reason=f"eager raised {type(e).__name__}", lasting=False)
        return _decision(instance, call, Compile.NOW) if call.key == request.key else None
