"""What a region's kernel depends on of its modules' Python values and hooks.

A forward reads attributes of its modules (``self.eps``, ``self.layer_idx``,
``self.config.sliding_window``); traced, their values become constants of
the kernel. So a region's key holds the values its forward read, recorded
while the forward runs: :func:`recorded` swaps each module of the tree to a
subclass that notes the names read from its ``__dict__``. Blocks that differ
only in an attribute their forward does not read (GPT-2's ``layer_idx``
without a KV cache) share one kernel; blocks whose read values differ get one
each.

What a forward reads follows its control flow, and its control flow follows
what it read: an instance whose values equal another's on the attributes
that one read takes the same path and reads the same ones. So a recording
serves every instance whose values on its reads are the recorded ones; the
runtime keeps the recordings (``_region_state.regions.reads``).

Hooks on a submodule (or global module hooks) would be traced into a kernel
that every instance shares: :func:`hooked` says so, and such calls run the
original forward. The instance's own hooks run around its kernel, as around
its forward.
"""

from __future__ import annotations

import enum
import functools
import threading
import types
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.nn.modules.module as module_globals

T = TypeVar("T")

# (submodule path, attribute name): one attribute a forward read.
Read = tuple[str, str]

# A module's own bookkeeping in its __dict__ (parameters, buffers, hooks, training), keyed elsewhere.
_INTERNAL = frozenset(torch.nn.Module().__dict__) | {"forward"}
_TREE = ("_parameters", "_buffers", "_modules")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
# How deep a value's objects are described (a config within a config).
_DEPTH = 4


class UnkeyedValue(Exception):
    """A value read by a forward that no key can hold; the message says which."""


class _Local(threading.local):
    reads: set[tuple[int, str]] | None = None


_local = _Local()
_recording_classes: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    """``cls`` with a ``__getattribute__`` that notes what is read, named as ``cls``."""
    if cls not in _recording_classes:
        get = cls.__getattribute__

        def __getattribute__(self: Any, name: str) -> Any:
            reads = _local.reads
            if reads is not None:
                reads.add((id(self), name))
            return get(self, name)

        body = {"__getattribute__": __getattribute__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _recording_classes[cls] = type(cls)(cls.__name__, (cls,), body)
    return _recording_classes[cls]


def recorded(module: torch.nn.Module, run: Callable[[], T]) -> tuple[T, frozenset[Read]]:
    """``run()``'s result and the attributes of ``module``'s tree that it read
    from their ``__dict__`` (parameters, buffers, submodules and a module's
    bookkeeping aside). Raises UnkeyedValue where a module's class cannot be
    swapped for the recording (``__slots__``, a C type)."""
    modules = dict(module.named_modules(remove_duplicate=False))
    swapped: list[tuple[torch.nn.Module, type]] = []
    before, _local.reads = _local.reads, set()
    try:
        for m in {id(m): m for m in modules.values()}.values():
            cls = type(m)
            try:
                m.__class__ = _recording_class(cls)
            except TypeError as e:
                raise UnkeyedValue(f"what the forward of {cls.__qualname__} reads cannot be recorded ({e})") from None
            swapped.append((m, cls))
        result = run()
        reads = _local.reads
    finally:
        _local.reads = before
        for m, cls in swapped:
            m.__class__ = cls
    paths: dict[int, str] = {}
    for path, m in modules.items():
        paths.setdefault(id(m), path)
    return result, frozenset(
        (paths[i], name) for i, name in reads
        if i in paths and name not in _INTERNAL and name in vars(modules[paths[i]]))


def described(module: torch.nn.Module, reads: frozenset[Read]) -> list[Any]:
    """The values of ``reads`` in ``module``'s tree, by value, in a form JSON
    keeps. Raises UnkeyedValue for a value no key can hold."""
    modules = dict(module.named_modules(remove_duplicate=False))
    result = []
    for path, name in sorted(reads):
        where = f"{path}.{name}" if path else name
        found = vars(modules[path]) if path in modules else {}
        result.append([where, _describe(found[name], where, 0) if name in found else ["absent"]])
    return result


def _describe(value: Any, where: str, depth: int) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return ["float", repr(value)]  # nan and inf, which JSON has not
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return [type(value).__name__, str(value)]
    if isinstance(value, enum.Enum):
        return ["enum", _qualified(type(value)), value.name]
    if isinstance(value, (tuple, list)):
        return [type(value).__name__, [_describe(v, f"{where}[{i}]", depth) for i, v in enumerate(value)]]
    if isinstance(value, (set, frozenset)):
        return ["set", sorted((_describe(v, where, depth) for v in value), key=repr)]
    if isinstance(value, dict):
        return ["dict", [[repr(k), _describe(v, f"{where}[{k!r}]", depth)] for k, v in value.items()]]
    if isinstance(value, torch.Tensor):
        # A constant of the kernel, whose in-place changes no check on a call would see.
        raise UnkeyedValue(f"{where} holds a tensor that is not a parameter or buffer (register it as a buffer)")
    if isinstance(value, torch.nn.Module):
        raise UnkeyedValue(f"{where} holds a module that is not a submodule: its tensors would be constants of the kernel")
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, functools.partial)):
        return _callable(value, where, depth)
    if hasattr(value, "__dict__") and depth < _DEPTH:
        # A config object: its values.
        return ["object", _qualified(type(value)),
                [[k, _describe(v, f"{where}.{k}", depth + 1)] for k, v in sorted(vars(value).items())]]
    raise UnkeyedValue(f"{where} holds a {type(value).__qualname__}, whose value a kernel's key cannot hold")


def _callable(value: Any, where: str, depth: int) -> list[Any]:
    if isinstance(value, functools.partial):
        return ["partial", _describe(value.func, where, depth), _describe(value.args, where, depth),
                _describe(value.keywords, where, depth)]
    if isinstance(value, types.MethodType):
        return ["method", _describe(value.__func__, where, depth), _describe(value.__self__, where, depth + 1)]
    cells = getattr(value, "__closure__", None) or ()
    captured = [_describe(c.cell_contents, f"{where} (closure)", depth + 1) for c in cells]
    defaults = _describe(getattr(value, "__defaults__", None), f"{where} (defaults)", depth + 1)
    return ["callable", _qualified(value), captured, defaults]


def _qualified(value: Any) -> str:
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


def watched(module: torch.nn.Module) -> list[tuple[dict, str, Any]]:
    """(mapping, name, value) for each value of ``module``'s tree that its
    state depends on: each module's training flag, parameters, buffers and
    submodules, the attributes a forward may read, and one level into the
    objects they hold (a config's values). The hit path checks each still
    there, the same object."""
    result: list[tuple[dict, str, Any]] = []
    seen: set[int] = set()

    def watch(mapping: dict, skip: frozenset[str]) -> None:
        if id(mapping) in seen:
            return
        seen.add(id(mapping))
        for name, value in mapping.items():
            if name in skip or not isinstance(name, str):
                continue
            result.append((mapping, name, value))
            inner = getattr(value, "__dict__", None)
            if skip and isinstance(inner, dict) and not isinstance(value, (torch.nn.Module, type, types.ModuleType)):
                watch(inner, frozenset())

    for m in module.modules():
        watch(vars(m), _INTERNAL)
        # True and False are one object each; a training flag missing from the dict is never found the same.
        result.append((vars(m), "training", vars(m).get("training")))
        # Its parameters, buffers and submodules: one assigned anew is another object.
        for name in _TREE:
            result.append((vars(m), name, vars(m)[name]))
            watch(vars(m)[name], frozenset())
    return result


def sized(module: torch.nn.Module) -> Iterator[dict]:
    """The dicts whose sizes must stay as they are for a kernel to serve
    ``module``: each module's parameters, buffers and submodules (one
    registered anew changes the state), each submodule's hooks (its own run
    around the kernel) and the global ones."""
    for i, m in enumerate(module.modules()):
        yield from (vars(m)[name] for name in _TREE)
        if i > 0:
            yield from (vars(m)[name] for name in _HOOKS)
    for name in _GLOBAL_HOOKS:
        yield getattr(module_globals, name)


def hooked(module: torch.nn.Module) -> str | None:
    """Why hooks keep ``module``'s calls from a kernel, or None."""
    for path, m in list(module.named_modules())[1:]:
        if any(vars(m)[name] for name in _HOOKS):
            return (f"its submodule {path} has hooks, which a kernel shared by every instance cannot run "
                    "(remove them, or register them on the fused module itself)")
    if any(getattr(module_globals, name) for name in _GLOBAL_HOOKS):
        return "global module hooks are registered, which would run inside its kernel"
    return None
