"""A region: one module's forward compiled whole, shared by every instance.

A region's kernel takes the module's parameters and buffers as inputs, then
the tensors of the call: twelve blocks of one class, with different weights,
use one library, and changed weights need no compile. Its cache key holds
what shapes the kernel besides the weights' values: the class and its code
(its own and its submodules' classes' source), the names, sizes, strides,
dtypes and devices of its parameters and buffers, its submodules' training
flags, and the call (the pytree structure of its arguments, its tensors as
an op's signature describes them, other values by value). The environment
(torch, compiler, ISA or GPU) is the store's, as for ops.

The compile (kernels/region_target.py, through kernels/pipeline.py) exports
:class:`RegionModule`, whose forward calls the instance with its state as
inputs, and publishes the result under the op name ``region::<module>.<class>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import operator
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch.nn.utils.stateless import _reparametrize_module

from aoti_eager.kernels import region_caches, region_values
from aoti_eager.kernels.compile import dense_order, in_order
from aoti_eager.kernels.examples import example_value
from aoti_eager.kernels.region_values import Read
from aoti_eager.kernels.signature import (
    Arg, ConstantArg, NoneArg, NumberArg, TensorArg, Unsupported, argument_from_json, clone_exact,
)

log = logging.getLogger("aoti_eager")

REGION_PREFIX = "region::"

# Python values a call or a result may hold besides tensors, kept by value.
_VALUES = (bool, int, float, str, type(None))


class NotARegion(Exception):
    """A module, or one call of it, that no region kernel serves; the message says why."""


class ReadsMore(NotARegion):
    """The forward, traced for a call, read attributes whose values the call's key does not hold."""

    def __init__(self, reads: frozenset[Read], unkeyed: frozenset[Read]):
        named = ", ".join(f"{path}.{name}".lstrip(".") for path, name in sorted(unkeyed))
        super().__init__(f"its forward read attributes here that its key does not hold yet ({named})")
        self.reads = reads


def region_name(module: torch.nn.Module) -> str:
    """The op name of the region of ``module``'s class, as the cache lists it."""
    cls = type(module)
    return f"{REGION_PREFIX}{cls.__module__}.{cls.__qualname__}".replace("<locals>.", "")


_sources: dict[type, str] = {}


def _class_source(cls: type) -> str:
    """The source of ``cls`` and of the forward it calls (which a base class may define)."""
    if cls not in _sources:
        try:
            _sources[cls] = inspect.getsource(cls) + inspect.getsource(cls.forward)
        except (OSError, TypeError) as e:
            raise NotARegion(f"the source of {cls.__qualname__} cannot be read ({e}), so its code cannot be keyed") from None
    return _sources[cls]


def code_digest(module: torch.nn.Module) -> str:
    """A digest of the code of ``module``'s class and its submodules' classes.
    Raises NotARegion where a source cannot be read."""
    classes = sorted({type(m) for m in module.modules()}, key=lambda c: f"{c.__module__}.{c.__qualname__}")
    digest = hashlib.sha256()
    for cls in classes:
        digest.update(f"{cls.__module__}.{cls.__qualname__}\n{_class_source(cls)}".encode())
    return digest.hexdigest()


def state_of(module: torch.nn.Module) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    """The names and tensors of ``module``'s parameters, then its buffers."""
    named = [*module.named_parameters(), *module.named_buffers()]
    return tuple(n for n, _ in named), tuple(t for _, t in named)


def state_structure(module: torch.nn.Module, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> str:
    """A digest of what a region kernel of ``module`` depends on besides the
    call: its class and code, its parameters' and buffers' names and metadata
    (never their values) and its submodules' training flags. Raises NotARegion."""
    described = [[name, _tensor(t, t.device).to_json()] for name, t in zip(names, tensors)]
    training = [m.training for m in module.modules()]
    return _digest([region_name(module), code_digest(module), described, training])


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:24]


def _tensor(t: torch.Tensor, device: torch.device) -> TensorArg:
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        # Eager's result would be of its class (__torch_function__ carries it), a kernel's plain tensors.
        raise NotARegion(f"unsupported input: a {type(t).__name__}, a subclass of torch.Tensor")
    try:
        return TensorArg.of(t, device)
    except Unsupported as e:
        raise NotARegion(f"unsupported input: {e}") from None


def _leaf(value: Any, device: torch.device) -> Arg:
    if isinstance(value, torch.Tensor):
        return _tensor(value, device)
    if value is None:
        return NoneArg()
    if isinstance(value, (bool, str)):
        return ConstantArg(value)
    if isinstance(value, (int, float)):
        return NumberArg(value)
    raise NotARegion(f"unsupported input: a value of type {type(value).__name__} (tensors, numbers, strings and None are)")


@dataclass(frozen=True)
class RegionCall:
    """One call of a region's instance: its state (parameters, buffers), the
    call's arguments flattened, and the cache key of their kernel."""

    name: str
    device: torch.device
    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    structure: str  # state_structure() of the instance, with the values its forward reads (valued())
    leaves: tuple[Any, ...]
    spec: pytree.TreeSpec
    described: tuple[tuple[str, Arg], ...]  # (path, description) of each leaf
    base: str = ""  # state_structure() alone, where valued() added values
    reads: frozenset[Read] = frozenset()  # the attributes whose values the structure holds
    # Under autograd, the inputs (kernels/region_training.py) that require grad: a forward and a backward are compiled.
    grads: tuple[int, ...] = ()
    autocast: tuple[str, ...] = ()  # the devices autocast is on for, with the dtype it casts to ("cuda:bfloat16")

    @classmethod
    def of(cls, name: str, names: tuple[str, ...], tensors: tuple[torch.Tensor, ...], structure: str,
           args: tuple[Any, ...], kwargs: dict[str, Any]) -> "RegionCall":
        """The call; raises NotARegion for inputs no kernel takes."""
        with_paths, spec = pytree.tree_flatten_with_path((args, kwargs))
        leaves = tuple(v for _, v in with_paths)
        device = _device(tensors, leaves)
        described = tuple((_path_name(path), _leaf(v, device)) for path, v in with_paths)
        return cls(name, device, names, tensors, structure, leaves, spec, described)

    def valued(self, module: torch.nn.Module, reads: frozenset[Read]) -> "RegionCall":
        """The call with the values of ``reads`` in ``module``'s tree in its
        structure (kernels/region_values.py). Raises NotARegion for a value no key holds."""
        try:
            values = region_values.described(module, reads)
        except region_values.UnkeyedValue as e:
            raise NotARegion(f"its forward reads {e}") from None
        base = self.base or self.structure
        return dataclasses.replace(self, structure=_digest([base, values]), base=base, reads=reads)

    def with_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> "RegionCall":
        """A call of the same state with other arguments."""
        call = RegionCall.of(self.name, self.names, self.tensors, self.structure, args, kwargs)
        return dataclasses.replace(call, base=self.base, reads=self.reads, grads=self.grads, autocast=self.autocast)

    def copied(self) -> "RegionCall":
        """The call on copies of its tensors (not of its state's)."""
        return dataclasses.replace(self, leaves=tuple(clone_exact(v) if isinstance(v, torch.Tensor) else v for v in self.leaves))

    @property
    def key(self) -> str:
        """The digest naming the call's cache entry."""
        # The default dtype: a forward's new tensors (torch.ones(n)) take it.
        default_dtype = str(torch.get_default_dtype())
        described = [self.structure, default_dtype, str(self.spec), [d.to_json() for _, d in self.described]]
        under = {"grads": list(self.grads), "autocast": list(self.autocast)} if self.grads or self.autocast else None
        return _digest(described if under is None else [*described, under])

    def to_json(self) -> list[dict[str, Any]]:
        """The call's inputs as a cache entry lists them."""
        return [{"name": path, **d.to_json()} for path, d in self.described]

    def inputs(self) -> list[torch.Tensor]:
        """The kernel's inputs: the state's tensors, then the call's."""
        return [*self.tensors, *(v for v in self.leaves if isinstance(v, torch.Tensor))]

    def arguments(self, inputs: Iterator[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's (args, kwargs) with its tensors taken from ``inputs``."""
        leaves = [next(inputs) if isinstance(v, torch.Tensor) else v for v in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)

    def short(self) -> str:
        return ", ".join(f"{path}={d.short()}" for path, d in self.described)


@dataclass(frozen=True)
class RegionRequest:
    """A region's miss as a manifest line holds it: enough to rebuild the
    call's arguments (:meth:`arguments`) for a fused instance whose state has
    ``structure``, in the process that holds the model::

        {"region": "region::m.Block", "structure": "1c0e...", "device": "cpu", "key": "77ab...",
         "signature": [{"name": "args[0]", "kind": "tensor", ...}], "spec": "[1, ...]", "default_dtype": "float32"}

    ``signature`` is :meth:`RegionCall.to_json`, ``spec`` the pytree spec of
    the call's ``(args, kwargs)`` (``treespec_dumps``)."""

    region: str
    structure: str
    device: str
    key: str
    signature: list[dict[str, Any]]
    spec: str
    default_dtype: str

    @classmethod
    def of(cls, call: RegionCall) -> "RegionRequest":
        """The request of ``call``; raises NotARegion where its arguments'
        structure holds a type pytree cannot name."""
        try:
            spec = pytree.treespec_dumps(call.spec)
        except Exception as e:  # noqa: BLE001 - pytree raises NotImplementedError, json TypeError
            raise NotARegion(f"its arguments' structure cannot be written down ({type(e).__name__}: {e})") from None
        dtype = str(torch.get_default_dtype()).removeprefix("torch.")
        # The state's structure alone: what an instance is matched with (its values are in the key).
        return cls(call.name, call.base or call.structure, str(call.device), call.key, call.to_json(), spec, dtype)

    @property
    def id(self) -> tuple[str, str, str]:
        """What makes two requests the same kernel (the key holds the structure)."""
        return (self.region, self.device, self.key)

    @property
    def op(self) -> str:
        """The name the cache lists the region's entries under."""
        return self.region

    # A region's request names no dynamic kernel: its family's policy decides, as a run's would.
    dynamic = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RegionRequest":
        """The request :meth:`to_json` gave. Raises KeyError, TypeError or ValueError for data that is not one."""
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(data) != fields:
            raise ValueError(f"a region line has the fields {sorted(fields)}, not {sorted(data)}")
        if not isinstance(data["signature"], list) or not all(isinstance(v, str) for k, v in data.items() if k != "signature"):
            raise TypeError("a region line's fields are strings and a list")
        return cls(**data)

    def arguments(self, device: torch.device, zero_integers: bool = False) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Example ``(args, kwargs)`` of the recorded call on ``device``: its
        tensors random with the recorded layout (``zero_integers``: its
        integer tensors zeros), its other values as recorded. Raises
        NotARegion where the description cannot be rebuilt here."""
        try:
            spec = pytree.treespec_loads(self.spec)
            leaves = [example_value(argument_from_json(d), device) for d in self.signature]
            if zero_integers:
                leaves = [v.zero_() if _integer(v) else v for v in leaves]
            return pytree.tree_unflatten(leaves, spec)
        except Exception as e:  # noqa: BLE001 - pytree raises NotImplementedError for a type unknown here
            raise NotARegion(f"its recorded call cannot be rebuilt here ({type(e).__name__}: {e})") from None


def _integer(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)


def _path_name(path: tuple[Any, ...]) -> str:
    """``args[0]``, ``kwargs['mask']``: where a leaf of (args, kwargs) is."""
    return ("args" if path[0].idx == 0 else "kwargs") + pytree.keystr(path[1:])


def _device(tensors: tuple[torch.Tensor, ...], leaves: tuple[Any, ...]) -> torch.device:
    for t in (*tensors, *leaves):
        if isinstance(t, torch.Tensor):
            return t.device
    raise NotARegion("no tensor in its state or its call")


# Where a tensor of the kernel goes in a result.
_TENSOR = object()


@dataclass(frozen=True)
class Passed:
    """A result that is the call's tensor ``index`` itself (T5's position bias,
    handed from block to block): the call returns that tensor, as eager does."""

    index: int


def call_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The call's tensors, in the order :meth:`RegionCall.inputs` gives them after the state's."""
    return [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]


def written(tensors: Sequence[torch.Tensor], run: Callable[[], Any]) -> tuple[Any, tuple[int, ...]]:
    """``run()``'s result and the indices of ``tensors`` it wrote into (an
    in-place op on a tensor or a view of it moves its version counter)."""
    before = [t._version for t in tensors]
    result = run()
    return result, tuple(i for i, (t, version) in enumerate(zip(tensors, before)) if t._version != version)


def writable(call: RegionCall, outputs: Outputs) -> frozenset[int]:
    """The inputs of ``call``'s kernel (the state's tensors, then the call's)
    that its library may write into: the call's tensors eager wrote into."""
    return frozenset(len(call.tensors) + i for i in outputs.writes)


def shared_writes(writes: tuple[int, ...], tensors: Sequence[torch.Tensor], state: Sequence[torch.Tensor]) -> str | None:
    """Why a kernel that writes into the call's tensors ``writes`` may not
    serve a call of ``tensors``: one of them shares memory with another
    tensor of the call or of the state (eager's later reads see its writes;
    a kernel compiled for separate tensors does not); else None."""
    for i in writes:
        storage = tensors[i].untyped_storage().data_ptr()
        others = [*(t for j, t in enumerate(tensors) if j != i), *state]
        if any(t.untyped_storage().data_ptr() == storage for t in others):
            return (f"its forward writes into its input tensor {i}, which shares memory with another of its "
                    "tensors in this call (a kernel compiled for separate tensors would read other values)")
    return None


@dataclass(frozen=True)
class Outputs:
    """The structure of a region's result: its tensors come from the kernel
    (in the order the result flattens), but for those the call passed in
    (:class:`Passed`); its other values are kept."""

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]  # _TENSOR where a kernel's tensor goes
    orders: tuple[Any, ...]  # each kernel tensor's dims in memory (see compile.dense_order)
    # The call's tensors the forward writes into, which the kernel writes as it does (see :func:`written`).
    writes: tuple[int, ...] = ()

    @classmethod
    def of(cls, result: Any, passed: Sequence[torch.Tensor] = (), writes: tuple[int, ...] = ()) -> "Outputs":
        """The structure of eager's ``result``, of a call of tensors
        ``passed`` of which it wrote into ``writes``; raises NotARegion for a
        value a kernel cannot return."""
        leaves, spec = pytree.tree_flatten(result)
        for value in leaves:
            if not isinstance(value, (torch.Tensor, *_VALUES)):
                raise NotARegion(
                    f"its result holds a {type(value).__name__}: register the type with torch.utils._pytree "
                    "(register_dataclass, register_pytree_node) for its tensors to be returned"
                )
        kinds = tuple(_kind(v, passed) for v in leaves)
        outputs = cls(spec, kinds, tuple(dense_order(v) for v, kind in zip(leaves, kinds) if kind is _TENSOR), writes)
        if writes and outputs.to_json() is None:
            # A process that loads the kernel learns what it writes from its cache entry alone.
            raise NotARegion("its forward writes into its inputs, and its result holds a type that pytree cannot name "
                             "(register it with a serialized_type_name) for the cache to keep")
        return outputs

    def to_json(self) -> dict[str, Any] | None:
        """The structure as a cache entry keeps it; None where the result holds
        a type that pytree cannot name (registered without ``serialized_type_name``)."""
        try:
            spec = pytree.treespec_dumps(self.spec)
        except Exception as e:  # noqa: BLE001 - pytree raises NotImplementedError, json TypeError
            log.debug("aoti_eager: the structure of a region's result is not kept in the cache: %s", e)
            return None
        orders = iter(self.orders)
        leaves = [{"tensor": _order_json(next(orders))} if v is _TENSOR else {"passed": v.index} if isinstance(v, Passed)
                  else {"value": v} for v in self.leaves]
        return {"spec": spec, "leaves": leaves, **({"writes": list(self.writes)} if self.writes else {})}

    @classmethod
    def from_json(cls, data: dict[str, Any], tensors: int) -> "Outputs":
        """The structure :meth:`to_json` kept, for a kernel of ``tensors``
        outputs. Raises NotARegion where this process cannot rebuild it (a
        type not registered with pytree here) or it does not fit the kernel."""
        try:
            spec = pytree.treespec_loads(data["spec"])
            leaves = tuple(_TENSOR if "tensor" in leaf else Passed(leaf["passed"]) if "passed" in leaf else leaf["value"]
                           for leaf in data["leaves"])
            orders = tuple(_order_of(leaf["tensor"]) for leaf in data["leaves"] if "tensor" in leaf)
            writes = tuple(int(i) for i in data.get("writes", ()))
        except Exception as e:  # noqa: BLE001 - pytree raises NotImplementedError for a type unknown here
            raise NotARegion(f"{type(e).__name__}: {e}") from None
        values_ok = all(v is _TENSOR or isinstance(v, (Passed, *_VALUES)) for v in leaves)
        if spec.num_leaves != len(leaves) or len(orders) != tensors or not values_ok:
            raise NotARegion(f"it does not fit a kernel of {tensors} outputs")
        return cls(spec, leaves, orders, writes)

    def tensors(self, result: Any) -> list[torch.Tensor]:
        """The tensors of ``result`` (of this structure) that a kernel returns."""
        return [v for v, kind in zip(pytree.tree_leaves(result), self.leaves) if kind is _TENSOR]

    @functools.cached_property
    def _plain(self) -> Callable[[list[torch.Tensor]], Any] | None:
        """The result rebuilt without the pytree, where it is a tensor or
        tuples of tensors (a block's result beside its cache layer's)."""
        if not all(v is _TENSOR for v in self.leaves):
            return None
        if self.spec.is_leaf():
            return operator.itemgetter(0)
        if self.spec.type is tuple and all(child.is_leaf() for child in self.spec.children()):
            return tuple
        build = _tuples(self.spec)
        return None if build is None else lambda tensors: build(iter(tensors))

    @functools.cached_property
    def passes(self) -> bool:
        """Whether the result holds tensors of the call's."""
        return any(isinstance(v, Passed) for v in self.leaves)

    def rebuild(self, tensors: list[torch.Tensor], passed: Sequence[torch.Tensor] = ()) -> Any:
        """The result, with the kernel's ``tensors`` and the call's ``passed``."""
        plain = self._plain
        if plain is not None:
            return plain(tensors)
        it = iter(tensors)
        leaves = [next(it) if v is _TENSOR else passed[v.index] if isinstance(v, Passed) else v for v in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)


def _tuples(spec: pytree.TreeSpec) -> Callable[[Iterator[torch.Tensor]], Any] | None:
    """What builds a result of ``spec`` from its tensors, where it is a tensor or tuples of them; else None."""
    if spec.is_leaf():
        return next
    children = [_tuples(child) for child in spec.children()]
    if spec.type is not tuple or None in children:
        return None
    return lambda tensors: tuple(child(tensors) for child in children)


def _kind(value: Any, passed: Sequence[torch.Tensor]) -> Any:
    """What :attr:`Outputs.leaves` holds for a leaf ``value`` of a result."""
    if not isinstance(value, torch.Tensor):
        return value
    return next((Passed(i) for i, t in enumerate(passed) if t is value), _TENSOR)


def _order_json(order: tuple[int, ...] | None) -> list[int] | None:
    return None if order is None else list(order)


def _order_of(data: Any) -> tuple[int, ...] | None:
    if data is not None and not (isinstance(data, list) and all(type(d) is int for d in data)):
        raise ValueError(f"a tensor's dims order {data!r}")
    return None if data is None else tuple(data)


class _Local(threading.local):
    bypass = False  # a class default: no AttributeError raised and caught on each call


_local = _Local()


@contextlib.contextmanager
def original_forward() -> Iterator[None]:
    """Within the block, fused instances run their original forward (see :func:`bypassed`)."""
    before = _local.bypass
    _local.bypass = True
    try:
        yield
    finally:
        _local.bypass = before


def bypassed() -> bool:
    """Whether a fused instance called now runs its original forward: while
    its region is traced or run as eager's reference."""
    return _local.bypass


class RegionModule(torch.nn.Module):
    """``forward(*state, *tensors)`` calls the instance with ``state`` as its
    parameters and buffers and the call's other values fixed; it returns the
    result's tensors, flat, in eager's layout (with a cache layer in the
    call, the result is the pair of the forward's result and the layer's
    tensors after its update).

    The instance is not a submodule: its parameters are inputs of the
    exported program, never constants compiled into the library."""

    def __init__(self, instance: torch.nn.Module, call: RegionCall, outputs: Outputs | None = None):
        super().__init__()
        object.__setattr__(self, "_instance", instance)
        self.call = call
        self.outputs = outputs

    def forward(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = len(self.call.names)
        # A cache layer of the call's is given to the block as a cache that holds it (kernels/region_caches.py).
        args, kwargs, caches = region_caches.with_layers(*self.call.arguments(iter(flat[n:])))
        instance = self._instance
        with original_forward(), _reparametrize_module(instance, dict(zip(self.call.names, flat[:n])), tie_weights=True):
            # Its class's forward, not the module's __call__: the instance's own hooks run around the kernel, not in it.
            result = type(instance).forward(instance, *args, **kwargs)
        if caches:
            # The layer as the block's update left it, returned beside the result for the caller's cache.
            result = (result, tuple(cache.after() for cache in caches))
        if self.outputs is None:
            return result
        for value in pytree.tree_leaves(result):
            if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                # A number the kernel does not return: eager's value would be kept for every call.
                raise NotARegion("its result holds a number computed from its tensors (their data or sizes), "
                                 "which a kernel does not return")
        return tuple(in_order(t, order) for t, order in zip(self.outputs.tensors(result), self.outputs.orders))
