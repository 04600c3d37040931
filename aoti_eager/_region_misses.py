"""The miss policy of fused regions: what a call that no decision serves runs.

A call is keyed with the values its forward reads (:func:`_valued`), and
its key decided once in this process (:func:`_decision`): a kernel from the
cache, one of its family's dynamic kernels, a compile (in the call, or in a
thread of this process with ``compile="background"``), or eager with its
reason. :func:`prewarm` decides a recorded call the same way.

An instance here is one of the hit path's (:mod:`aoti_eager._region_calls`,
which imports this module): :class:`_Fused` says what the policy uses of it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from aoti_eager import _background, _mechanism, settings
from aoti_eager._options import Compile, Options
from aoti_eager._planner import Family
from aoti_eager._decisions import Decision, RetryLater, RunEagerly, UseKernel
from aoti_eager._region_state import COMPILING, RegionKernel, _Loaded, _log_once, regions
from aoti_eager._stats import Stats
from aoti_eager.cache import UntrustedEntry
from aoti_eager.cache.entry_store import Entry, EntryStore
from aoti_eager.cache.store import beside
from aoti_eager.kernels import region_caches, region_joint, region_shapes, region_training, region_values
from aoti_eager.kernels.dynamic import ShapeFamily
from aoti_eager.kernels.inductor.load_probe import UnsafeToLoad
from aoti_eager.kernels.pipeline import NotCompiled, Published, compile_target, publish_verdict
from aoti_eager.kernels.region import NotARegion, ReadsMore, RegionCall, RegionRequest
from aoti_eager.kernels.region_joint import Plan
from aoti_eager.kernels.region_target import RegionTarget
from aoti_eager.kernels.region_training import BACKWARD_FILES, TrainingKernel, TrainingTarget
from aoti_eager.manifest import Recorder

log = logging.getLogger("aoti_eager")


class _Fused(Protocol):
    """A fused instance (``_region_calls._Instance``), as the miss policy uses it."""

    name: str
    options: Options
    stats: Stats
    refused: str | None

    @property
    def module(self) -> torch.nn.Module: ...

    def original(self, *args: Any, **kwargs: Any) -> Any: ...

    def state(self) -> Any: ...  # its _Prepared; raises NotARegion


# The result of a call that did not run the original forward.
_NOT_RUN = object()
# The keyword arguments of a call whose kernel's tensors are taken from its arguments' leaves.
_NO_KWARGS: dict[str, Any] = {}


def _decide(
    instance: _Fused, args: tuple[Any, ...], kwargs: dict[str, Any], key: Any,
    given: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
) -> tuple[Decision, tuple[Any, ...], dict[str, Any], Any]:
    """What this call runs, the arguments its kernel's tensors are taken
    from, and the original forward's result where it ran to learn what it
    reads (else _NOT_RUN; run on ``given``, the arguments as the caller gave
    them, where its cache was adapted); raises NotARegion where no kernel
    may serve it. A decision to remember is kept in the state's memo under ``key``."""
    given_args, given_kwargs = given or (args, kwargs)
    if instance.refused is not None:
        raise NotARegion(instance.refused)
    state = instance.state()
    if state.hooked is not None:
        raise NotARegion(state.hooked)
    call = RegionCall.of(instance.name, state.names, state.tensors, state.structure, args, kwargs)
    grads, autocast = region_training.requiring_grad(call.inputs()), region_joint.autocast_state()
    if grads and getattr(instance.module, "gradient_checkpointing", False) is True:
        # transformers' GradientCheckpointingLayer: its class's forward is the checkpoint, whose recompute replays it.
        raise NotARegion("gradient checkpointing is on for it (its forward is a checkpoint's, replayed in the backward)")
    if grads and (why := region_training.undecidable_here()) is not None:
        # Not decided (nor its forward's reads recorded) here: the recompute of a checkpoint runs what its forward ran.
        return RetryLater(why), call.leaves, _NO_KWARGS, _NOT_RUN
    if autocast and not grads:
        raise NotARegion("autocast is on without autograd (regions are compiled under autocast as a training step's only)")
    if grads:
        # Under autograd (and autocast): a forward and a backward, from the block's joint graph.
        call = dataclasses.replace(call, grads=grads, autocast=autocast)
    call, ran = _valued(instance, call, lambda: instance.original(*given_args, **given_kwargs))
    decided = _decision(instance, call)
    if decided.remember and key is not None:
        state.memo[key] = decided
    return decided, call.leaves, _NO_KWARGS, ran


def _valued(instance: _Fused, call: RegionCall, run: Any) -> tuple[RegionCall, Any]:
    """``call`` keyed with the values its forward reads (kernels/region_values.py),
    and the result of ``run`` (the original forward) where it ran to learn
    them (the state's first call here), else _NOT_RUN. Raises NotARegion for values no key holds."""
    reads, ran = regions.reads.get(call.structure), _NOT_RUN
    if reads is None:
        try:
            # The original kernels: ops enabled inside a block are the block's kernel's to run, not compiled apart.
            with _mechanism.own_work():
                ran, reads = region_values.recorded(instance.module, run)
        except region_values.UnkeyedValue as e:
            raise NotARegion(str(e)) from None
        reads = regions.reads[call.structure] = reads | regions.reads.get(call.structure, frozenset())
    return call.valued(instance.module, reads), ran


def _decision(instance: _Fused, call: RegionCall, compile: Compile | None = None) -> Decision:
    """What ``call`` runs: decided before in this process, else by a miss
    compiling as ``compile`` says (default the instance's mode)."""
    cache = regions.cache(instance.options, call.device)
    with regions.lock:
        where = (str(cache.directory), call.key, instance.options.compile)
        decided = regions.decided.get(where)
        if decided is None:
            decided = _miss(instance, cache, call, compile or instance.options.compile)
            if decided.remember:
                regions.decided[where] = decided
    return decided


def _miss(instance: _Fused, cache: EntryStore, call: RegionCall, compile: Compile) -> Decision:
    try:
        if (compiled := _compiled_apart(cache, call)) is not None:
            return compiled
        if not call.grads:
            _family_of(cache, call).saw(region_shapes.call_sizes(call), call.key)
        found = _from_cache(instance, cache, call) or _from_family(instance, cache, call)
        if found is None and instance.options.recorder is not None and not call.grads:
            _record(instance.options.recorder, call)
        if found is not None or compile == Compile.NEVER:
            return found or RunEagerly("compile='never' and no kernel in the cache")
        if compile == Compile.BACKGROUND and call.grads:
            return RunEagerly(_NOT_APART)
        if (why := _mechanism.cannot_compile(cache) or _over_limit(cache, call)) is not None:
            return RunEagerly(why)
        if compile == Compile.BACKGROUND:
            return _compile_apart(instance, cache, call)
        with cache.lock_signature(call.name, call.key, timeout=settings.lock_timeout.get()), _mechanism.compile_lock:
            return (_from_cache(instance, cache, call) or _from_family(instance, cache, call)
                    or _compile_dynamic(instance, cache, call) or _compile(instance, cache, call))
    except TimeoutError as e:  # another's compile: the next call asks the caches again
        return RetryLater(_mechanism.waited_for(e))
    except (UntrustedEntry, UnsafeToLoad, OSError) as e:
        return RunEagerly(f"{type(e).__name__}: {e}")


def _over_limit(cache: EntryStore, call: RegionCall) -> str | None:
    """Why ``call`` runs eagerly instead of compiling, past a limit on the
    compiles of its numbers' values or of its family's shapes; else None,
    the compile counted. As dynamo's cache size limit: never compiling forever."""
    values = (str(cache.directory), region_shapes.values_key(call))
    limit = settings.max_value_variants.get()
    if regions.value_variants[values] >= limit:
        return (f"{regions.value_variants[values]} kernels already compiled for new values of the numbers in its call "
                f"({settings.max_value_variants.name}={limit}); further values run eagerly")
    why = _family_of(cache, call).over_limit()
    if why is None:
        regions.value_variants[values] += 1
    return why


def _record(recorder: Recorder, call: RegionCall) -> None:
    try:
        recorder.record(RegionRequest.of(call))
    except NotARegion as e:
        _log_once(call.name, f": a miss is not recorded into {recorder.path}: {e}")


def _from_cache(instance: _Fused, cache: EntryStore, call: RegionCall, compiled: bool = False,
                key: str | None = None) -> Decision | None:
    """What the cache holds for ``call`` (under ``key``, else its own), its kernel loaded; None where it holds
    nothing usable (:func:`_mechanism.held`). ``compiled``: the entry was just published here (not counted
    as a load)."""
    key = key or call.key

    def adopt(entry: Entry) -> Decision:
        if entry.library is None:
            return RunEagerly(entry.reason or "decided eager")
        plan = lambda: Plan.from_json((entry.result_structure or {})["training"])  # noqa: E731
        kernel = _mechanism.entry_kernel(_loader(cache, call, known_good=True, plan=plan), entry)
        regions.stats_of(instance.name).cache_loads += not compiled
        # The structure of its results: eager's, once its first result here fits what the entry keeps (_learnt).
        return UseKernel(RegionKernel(kernel, loaded=_Loaded(cache, call.name, key, entry.result_structure)))

    return _mechanism.held(cache, call.name, key, adopt)


# A compile sets torch's compiling and exporting flags for the whole process
# (torch.compiler.is_exporting()): a training loop running beside one in a thread sees them, and its
# optimizer's methods, disabled for dynamo, then write into the trace's node metadata meanwhile.
_NOT_APART = ("compile='background' compiles no call under autograd: a compile in a thread would be seen by the "
              "training loop beside it (torch's compiling flags are process-wide); compile='now' compiles it at its call")


def _compile_apart(instance: _Fused, cache: EntryStore, call: RegionCall) -> Decision:
    """Queues the compile of ``call``'s key for a thread of this process
    (``compile="background"``); the calls with the key run eagerly meanwhile."""
    # Its tensors as they are now: the caller goes on with them, and may write into them (a forward that does).
    call = call.copied()

    def compile_here() -> Decision:
        module = instance.module
        if module is None:
            return RetryLater("its module was freed before it was compiled")
        apart = _sharing_state(module)
        # As an op's worker: it waits for another machine's compile of the key, no call does.
        waiting = regions.cache(instance.options, call.device, wait=settings.lock_timeout.get())
        with waiting.lock_signature(call.name, call.key, timeout=settings.lock_timeout.get()), _mechanism.compile_lock:
            return _from_cache(instance, waiting, call) or _compile(instance, waiting, call, apart=apart)

    compiling = _background.submit(_background.Here(compile_here))
    regions.compiling[(str(cache.directory), call.key)] = (compiling, instance.name)
    regions.stats_of(instance.name).queued += 1
    log.info("aoti_eager: compiling %s for (%s) in the background", call.name, call.short())
    return RetryLater(COMPILING)


def _compiled_apart(cache: EntryStore, call: RegionCall) -> Decision | None:
    """What the background compile of ``call``'s key decided, once it ended
    (eager while it runs); None where none was queued."""
    where = (str(cache.directory), call.key)
    if where not in regions.compiling:
        return None
    future, _ = regions.compiling[where]
    if not future.done():
        return RetryLater(COMPILING)
    del regions.compiling[where]
    try:
        return future.result()
    except TimeoutError as e:  # another's compile outlasted the wait: the next call asks the caches again
        return RetryLater(_mechanism.waited_for(e))
    except Exception as e:  # noqa: BLE001 - the cache's errors: this key's calls run eagerly
        return RunEagerly(f"its background compile failed: {type(e).__name__}: {e}")


def compiling(name: str) -> int:
    """The background compiles of region ``name`` not finished yet."""
    return sum(1 for future, region in list(regions.compiling.values()) if region == name and not future.done())


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


def _compile(instance: _Fused, cache: EntryStore, call: RegionCall, dims: ShapeFamily | None = None,
             apart: torch.nn.Module | None = None) -> Decision | None:
    """Compiles ``call``'s kernel (``dims``: its family's dynamic kernel of
    those dims; ``apart``: from a copy of the instance's module, in the
    background), and what the store then holds; None where a dynamic kernel
    failed (the shape then compiles alone)."""
    family = _family_of(cache, call)
    # A copy is traced: the module's own tensors stay real for calls of other threads meanwhile.
    module = apart or _sharing_state(instance.module)
    if call.grads:
        target = TrainingTarget(module, call, _twin(cache), functools.partial(_mechanism.load_ahead, cache, call.device))
    else:
        target = RegionTarget(module, call, _twin(cache))
    try:
        with _mechanism.own_work():
            outcome = compile_target(target, cache, _loader(cache, call, plan=lambda: target.plan), dims, family.seen,
                                     in_background=apart is not None)
    except ReadsMore as e:
        # Its next call is keyed with these values too.
        regions.reads[call.base] = regions.reads.get(call.base, frozenset()) | e.reads
        return RetryLater(str(e))
    if isinstance(outcome, NotCompiled):
        if outcome.compiler_error is not None:
            _mechanism.compiler_failures.add(outcome.compiler_error)
        if dims is None:
            return (RetryLater if outcome.eager_raised else RunEagerly)(outcome.reason)
        return _dynamic_failed(cache, call, family, outcome)
    _count_compile(instance, call, outcome)
    for file, graph in target.graphs.items():
        # Its library serves every later program of the same graph (the next layer's): copied, not compiled.
        regions.twins.setdefault((str(cache.directory), graph), (call.name, outcome.key, file))
    if dims is not None:
        # What the store holds: another process's kernel where it published first.
        family.published[outcome.key] = dynamic = _mechanism.dynamic_kernel(cache, call.name, outcome.key)
        if dynamic is None or not region_shapes.admits(dynamic, outcome.key, call):
            return None
    decided = _from_cache(instance, cache, call, compiled=True, key=outcome.key)
    if decided is None or decided.kernel is None:
        return None if dims is not None else decided or RunEagerly("its published kernel is not in the cache")
    decided = UseKernel(dataclasses.replace(decided.kernel, outputs=target.outputs), dynamic=dynamic if dims is not None else None)
    if dims is not None:
        family.decisions[outcome.key] = decided
    return decided


def _twin(cache: EntryStore) -> Any:
    """Copies the library of an exported program of digest ``graph`` that
    this process published into ``cache``, where there is one, to
    ``library``: its entry's timing (:func:`_mechanism.copy_library`)."""
    def twin(graph: str, library: Path) -> dict | None:
        where = regions.twins.get((str(cache.directory), graph))
        if where is None:
            return None
        name, key, file = where
        return _mechanism.copy_library(cache, name, key, library, file)

    return twin


def _dynamic_failed(cache: EntryStore, call: RegionCall, family: Family, outcome: NotCompiled) -> None:
    """The family's shapes compile alone from now on, recorded in the cache
    for every process, unless it may pass in a later one (the compiler's
    failure; eager's, of this call's values)."""
    if not outcome.eager_raised:
        family.dynamic_failed = outcome.reason
        if outcome.compiler_error is None:
            publish_verdict(cache, call.name, call, region_shapes.static_key(call), outcome.reason)
    log.info("aoti_eager: %s for (%s): %s; compiling this shape alone", call.name, call.short(), outcome.reason)


def _loader(cache: EntryStore, call: RegionCall, known_good: bool = False, plan: Callable[[], Plan] | None = None) -> Any:
    """Loads a library of ``cache`` as the kernel of ``call``; under autograd,
    with its backward's beside it, connected as ``plan()`` says."""
    def load(library: Path, output_counts: list[int]) -> Any:
        kernel = _mechanism.load_library(cache, call.device, library, output_counts, len(call.inputs()), call.short(),
                                         known_good=known_good)
        if not call.grads:
            return kernel
        how = plan()
        backward = _mechanism.load_library(cache, call.device, beside(library, BACKWARD_FILES[0]), [-1] * len(how.grads),
                                           len(how.saved) + len(how.tangents), call.short(), known_good=known_good)
        return TrainingKernel(kernel, backward, how)

    return load


def _count_compile(instance: _Fused, call: RegionCall, outcome: Published) -> None:
    regions.stats_of(instance.name).compiled(outcome.seconds)
    log.debug("aoti_eager: %s for (%s): seconds by stage %s", call.name, call.short(),
              {stage: round(seconds, 2) for stage, seconds in outcome.stages.items()})
    log.info("aoti_eager: compiled %s for (%s) in %.1f s%s", call.name, call.short(), outcome.seconds,
             " (its exported program is one compiled before: that library, checked again)" if "twin" in outcome.stages else "")


def _family_of(cache: EntryStore, call: RegionCall) -> Family:
    return regions.families.setdefault((str(cache.directory), region_shapes.family_key(call)), Family())


def _from_family(instance: _Fused, cache: EntryStore, call: RegionCall) -> Decision | None:
    """What a dynamic kernel whose guards admit ``call`` runs (this process's, or another's), or None."""
    if call.grads:
        return None  # a training kernel is one shape's
    family = _family_of(cache, call)
    found = _mechanism.from_family(cache, family, RegionTarget(instance.module, call),
                                   lambda key, dynamic: _from_cache(instance, cache, call, key=key))
    if found is None:
        return None
    key, dynamic, decided = found
    if isinstance(decided, UseKernel):
        decided = dataclasses.replace(decided, dynamic=dynamic)
    # One decision for every shape it admits: a result's structure is learnt once.
    return family.decisions.setdefault(key, decided)


def _compile_dynamic(instance: _Fused, cache: EntryStore, call: RegionCall) -> Decision | None:
    """Compiles the dynamic kernel the family's policy asks for, and what it
    decides; None where it asks for none or the kernel failed."""
    if call.grads:
        return None
    family = _family_of(cache, call)
    if family.dynamic_failed is None and (verdict := _mechanism.recorded_verdict(cache, call.name, [(region_shapes.static_key(call), "family")])):
        family.dynamic_failed = verdict.reason
    dims = family.moved_dims(region_shapes.call_sizes(call)) or _growing(call, family)
    return None if dims is None else _compile(instance, cache, call, dims)


def _growing(call: RegionCall, family: Family) -> ShapeFamily | None:
    """A decode step's dynamic kernel at its family's first call, where the
    family has none: its cache layer's length, which the next step grows."""
    if family.dynamic_failed is not None or not settings.dynamic_shapes.get() or family.dynamic():
        return None
    dims = region_caches.growing_dims(*call.arguments(iter(call.inputs()[len(call.tensors):])))
    return ShapeFamily(dims) if any(dims) else None


def prewarm(instances: list[_Fused], request: RegionRequest) -> tuple[str, str | None, float]:
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
        if not decided.remember and (decided.reason or "").startswith("eager raised"):
            # Random integers can index past a short table (an embedding of 2 rows); zeros index any.
            decided = _prewarm_any(instances, request, zero_integers=True)
    except (NotARegion, TypeError, AttributeError) as e:
        return "failed", str(e), 0.0
    finally:
        torch.set_default_dtype(before)
    spent = stats.compile_seconds - seconds
    if decided.kernel is None:
        return ("eager" if decided.remember else "failed"), decided.reason, spent
    return ("compiled" if stats.compiles > compiles else "cached"), None, spent


def _prewarm_any(instances: list[_Fused], request: RegionRequest, zero_integers: bool = False) -> Decision:
    """What the call ``request`` recorded runs, for the first of ``instances`` it keys."""
    for instance in instances:
        decided = _prewarm_call(instance, request, zero_integers)
        if decided is not None:
            return decided
    raise NotARegion("its call rebuilt here is keyed differently from the recorded one (the values its forward "
                     "reads, or its code, differ)")


def _prewarm_call(instance: _Fused, request: RegionRequest, zero_integers: bool = False) -> Decision | None:
    """What the call ``request`` recorded, rebuilt for ``instance``, runs (a
    miss compiles it now); None where the call is keyed otherwise for it."""
    state = instance.state()
    # The device of the instance's state: the model may have moved since (cuda:1).
    device = state.tensors[0].device if state.tensors else torch.device(request.device)
    args, kwargs = request.arguments(device, zero_integers)
    call = RegionCall.of(instance.name, state.names, state.tensors, state.structure, args, kwargs)
    with torch.no_grad():
        try:
            # A recorded cache layer: the forward is given a cache that holds it.
            given, named, _ = region_caches.with_layers(args, kwargs)
            call, _ = _valued(instance, call, lambda: instance.original(*given, **named))
        except NotARegion:
            raise
        except Exception as e:  # noqa: BLE001 - the example's values, as a compile's eager run would say
            return RetryLater(f"eager raised {type(e).__name__}")
        return _decision(instance, call, Compile.NOW) if call.key == request.key else None
