"""The hit path of fused regions: a fused instance and its calls.

A fused module's ``forward`` is :meth:`_Instance.forward`. The instance's
state is prepared once (:class:`_Prepared`); on each call the C++ side
(csrc/region_state.h) checks it unchanged, keys the call and finds its
decision, and a hit runs the kernel on the state's tensors and the call's.
A call decided nowhere yet goes to the miss policy
(:mod:`aoti_eager._region_misses`); one decided eager runs the original
forward. A kernel loaded from the cache learns the structure of its results
from eager's first (:func:`_learnt`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree
import torch.utils.checkpoint

from aoti_eager import _extension, _mechanism
from aoti_eager._options import Options
from aoti_eager._region_misses import _NO_KWARGS, _NOT_RUN, _decide
from aoti_eager._decisions import Decision, RunEagerly
from aoti_eager._region_state import COMPILING, RegionKernel, _log_eager_once, regions
from aoti_eager._stats import Stats
from aoti_eager.kernels import region_caches, region_values
from aoti_eager.kernels.region import (
    NotARegion, Outputs, bypassed, call_tensors, shared_writes, state_of, state_structure,
)


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
    # The calls decided with this state: their key (_keyed) -> their decision (shared through regions.decided),
    # found while nothing the state depends on changed; those no kernel may serve (NotARegion, _refused) apart,
    # found while the state's tensors are as they were (RegionState.find): a decision of the cache or a compile
    # holds for the state's values (a training flag), a refusal of the call for any.
    memo: dict[Any, Decision] = field(default_factory=dict)
    refused: dict[Any, Decision] = field(default_factory=dict)
    layer: int | None = None  # the KV cache layer the block updates, once a call passed a cache (_layer)
    # A cache call's key less its layer's length (_shapeless) -> the dynamic kernel its family decided (_stepped).
    steps: dict[Any, Decision] = field(default_factory=dict)


_RegionState: Any = None


def _native() -> Any:
    """The C++ side of the hit path (csrc/region_state.h)."""
    global _RegionState
    if _RegionState is None:
        _RegionState = _extension.load().RegionState
    return _RegionState


# What a kernel's call raises that is no failure of the kernel: torch.utils.checkpoint's recompute stops so
# (from the saved tensors hook of a training kernel's forward) once it has what the backward needs.
_PASSED_THROUGH = tuple(filter(None, [getattr(torch.utils.checkpoint, "_StopRecomputationError", None)]))

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
    stats: Stats  # its region's
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
        # Traced (by the region's own compile, torch.export, torch.compile or torch.jit.trace), under a torch.func
        # transform (grad, vmap: its tensors are wrappers, with no storage a kernel could read) or a dispatch mode
        # (FakeTensorMode, a FLOP counter: it is to see each op): the code.
        if (bypassed() or torch.compiler.is_compiling() or torch.compiler.is_exporting() or torch._C._is_tracing()
                or torch._C._functorch.peek_interpreter_stack() is not None or torch._C._len_torch_dispatch_stack()):
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
    instance = _Instance(weakref.ref(module), name, options, regions.stats_of(name), refused=refused, replaced=replaced)
    regions.live[name].add(module)
    return instance


def _call(instance: _Instance, stats: Stats, decided: Decision | None, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> Any:
    """A call that RegionState.find did not find decided eager: ``decided`` is what it found."""
    if instance.refused is not None:
        return _eagerly(instance, stats, instance.refused, args, kwargs)
    given = args, kwargs  # what the original forward takes
    leaves, named, cached = args, kwargs, None
    if decided is None:
        if region_caches.holds_cache(args, kwargs):
            try:
                cached = region_caches.adapted(_layer(instance), args, kwargs)
            except region_caches.Refused as e:
                return _eagerly(instance, stats, _refused(instance, _keyed(args, kwargs)[0], str(e)).reason, *given)
            args, kwargs = cached.args, cached.kwargs
        key, leaves, named = _keyed(args, kwargs) if cached is None else _keyed_cached(cached)
        decided = _memoized(instance, key) or (None if cached is None else _stepped(instance, cached, leaves, named))
    if decided is None:
        try:
            decided, leaves, named, ran = _decide(instance, args, kwargs, key, given)
        except NotARegion as e:
            decided, ran = _refused(instance, key, str(e)), _NOT_RUN
        if (cached is not None and decided.dynamic is not None and (p := instance.valid()) is not None
                and (shapeless := _shapeless(cached)) is not None):
            # The next step's call, its cache a token longer, finds it without a key of its own.
            p.steps[shapeless] = decided
        if ran is not _NOT_RUN:
            # The original forward ran, to learn what it reads: its result checks a kernel loaded from the cache.
            return _learnt(instance, decided, ran, args, kwargs, cached)
    if decided.kernel is None:
        return _eagerly(instance, stats, decided.reason, *given)
    kernel = decided.kernel
    if kernel.outputs is None:
        return _learnt(instance, decided, instance.original(*given[0], **given[1]), args, kwargs, cached)
    if kernel.outputs.writes and (shared := shared_writes(kernel.outputs.writes, call_tensors(args, kwargs),
                                                          instance.prepared.tensors)) is not None:
        return _eagerly(instance, stats, shared, *given)
    try:
        tensors = instance.prepared.native.run(kernel.compiled, leaves, named)
    except _PASSED_THROUGH:
        raise
    except Exception as e:  # noqa: BLE001 - one line, not the runtime's C++ error
        said = (str(e).strip().splitlines() or [""])[0][:200]
        eager = _decided_again(instance, decided, RunEagerly(f"compiled kernel failed to run: {type(e).__name__}: {said}"))
        return _eagerly(instance, stats, eager.reason, *given)
    stats.hits += 1
    result = kernel.outputs.rebuild(tensors, call_tensors(args, kwargs) if kernel.outputs.passes else ())
    return result if cached is None else cached.written(result)


def _keyed_cached(cached: region_caches.Adapted) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """As :func:`_keyed`, for a call whose cache was adapted: keyed in C++
    with its layer as a tuple, apart from every call without a cache (and
    from one with its cache elsewhere)."""
    args, kwargs = cached.plain()
    key = (_RegionState or _native()).key(args, kwargs, _NODES)
    return _keyed(cached.args, cached.kwargs) if key is None else (("cache", cached.where, key), args, kwargs)


def _shapeless(cached: region_caches.Adapted) -> Any:
    """The C++ key of a cache call with its cache layer's length left out."""
    args, kwargs = cached.shapeless()
    return (_RegionState or _native()).key(args, kwargs, _NODES)


def _stepped(instance: _Instance, cached: region_caches.Adapted, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> Decision | None:
    """The dynamic kernel an earlier step of a generation decided, where its
    guards and layout admit this call (its cache layer longer); else None."""
    p = instance.valid()
    shapeless = None if p is None or not p.steps else _shapeless(cached)
    # No C++ key (a value only the slow path describes): its numbers and strings are unchecked here.
    decided = None if shapeless is None else p.steps.get(shapeless)
    if decided is None:
        return None
    tensors: list[torch.Tensor] = []
    _tensors_in((args, kwargs), tensors)
    family = decided.dynamic
    admitted = (len(tensors) == len(family.dims) and family.symbol_values_of_sizes([t.shape for t in tensors]) is not None
                and family.layout_admitted([_Layout(t.shape, t.stride()) for t in tensors])
                and all(layer.data_ptr() % 16 == 0 for layer in cached.layer_tensors()))
    return decided if admitted else None


class _Layout(NamedTuple):
    """A tensor's sizes and strides, as ShapeFamily.layout_admitted reads a TensorArg's."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]


def _tensors_in(value: Any, into: list[torch.Tensor]) -> None:
    """The tensors of ``value`` (tuples, lists and dicts of them), in the order pytree flattens them."""
    if isinstance(value, torch.Tensor):
        into.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors_in(v, into)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, into)


def _layer(instance: _Instance) -> int:
    """The KV cache layer the instance's block updates, found once per prepared state. Raises region_caches.Refused."""
    p = instance.valid()
    if p is None:
        return region_caches.layer_index(instance.module)
    if p.layer is None:
        p.layer = region_caches.layer_index(instance.module)
    return p.layer


def _memoized(instance: _Instance, key: Any) -> Decision | None:
    """The decision of a call with ``key`` that this instance's state
    decided before, while nothing it depends on changed; else None."""
    p = instance.valid() if key is not None else None
    return None if p is None else p.refused.get(key) or p.memo.get(key)


def _refused(instance: _Instance, key: Any, reason: str) -> Decision:
    """Eager for ``reason``, which holds for the calls with ``key`` while the
    instance's state is as it is (as every reason NotARegion gives does):
    they run the original forward with no description of theirs again."""
    decided = RunEagerly(reason)
    p = instance.valid() if key is not None else None
    if p is not None:
        p.refused[key] = decided
    return decided


def _decided_again(instance: _Instance, old: Decision, new: Decision) -> Decision:
    """``new`` for the calls that ``old`` decided: this instance's and those
    deciding from now on. Another instance's calls that kept ``old`` find the
    same (a kernel failing to run there too, a result's structure learnt
    again)."""
    regions.replace(old, new)
    p = instance.valid()
    if p is not None:
        for key in [key for key, decided in p.memo.items() if decided is old]:
            p.memo[key] = new
        for key in [key for key, decided in p.steps.items() if decided is old]:
            del p.steps[key]
            if new.kernel is not None:
                p.steps[key] = new
    return new


def _learnt(instance: _Instance, decided: Decision, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
            cached: region_caches.Adapted | None = None) -> Any:
    """``result``, eager's, whose structure a kernel loaded from the cache
    gives its results in this process where it fits the kernel and the
    structure its entry keeps (with ``cached``, paired with the cache layer
    as eager's update left it). Else the entry is damaged in a way its
    digests, recorded again, do not show: it is set aside, the calls of its
    key run eagerly here, and a new process compiles it again."""
    kernel = decided.kernel
    if kernel is None or kernel.outputs is not None:
        return result
    try:
        outputs = Outputs.of(result if cached is None else cached.paired(result), call_tensors(args, kwargs))
    except NotARegion as e:
        _decided_again(instance, decided, RunEagerly(str(e)))
        return result
    misfit = _misfit(kernel, outputs)
    if misfit is None:
        # What the kernel writes into, which eager's result does not show: as its entry keeps it.
        kept = kernel.loaded.structure or {}
        outputs = dataclasses.replace(outputs, writes=tuple(kept.get("writes", ())))
        _decided_again(instance, decided, dataclasses.replace(decided, kernel=dataclasses.replace(kernel, outputs=outputs)))
        return result
    loaded = kernel.loaded
    loaded.cache.set_aside(loaded.name, loaded.key, misfit)
    _decided_again(instance, decided, RunEagerly(
        f"its cache entry was set aside as damaged ({misfit}); a new process compiles it again"))
    return result


def _misfit(kernel: RegionKernel, outputs: Outputs) -> str | None:
    """How eager's result, of structure ``outputs``, does not fit the kernel
    loaded from the cache or the structure its entry keeps; None where it
    fits (or where a type it holds has no name to compare by)."""
    tensors = kernel.compiled.num_outputs
    if len(outputs.orders) != tensors:
        return f"its library returns {tensors} tensors, eager's result holds {len(outputs.orders)}"
    kept, eager = kernel.loaded.structure, _kept_form(outputs)
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


def _eagerly(instance: _Instance, stats: Stats, reason: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    stats.fallbacks += 1
    stats.fallback_reason = reason
    if (instance.name, reason) not in regions.logged_eager:
        _log_eager_once(instance.name, reason)
    # While its kernel compiles, the ops inside are that kernel's to run: none compiled apart meanwhile.
    with _mechanism.own_work() if reason == COMPILING else contextlib.nullcontext():
        return instance.original(*args, **kwargs)
