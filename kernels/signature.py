"""The static input signature of one op call.

A signature describes every argument the way the compiled kernel depends on
it, as one of the frozen descriptions below: a tensor by dtype, device, sizes,
strides and alignment; a number by its value, compiled into the kernel, unless
the kernel takes it as an input at run time; any other argument by its value.
It is stored as JSON beside the kernel (:meth:`CallSignature.to_json`, read
back by :func:`argument_from_json`), and its digest names the cache entry.

Keys
----
A call is keyed on both paths, from the same arguments:

- C++, on every call: ``compute_call_key`` (csrc/call_key.cpp) appends 64-bit
  words to ``CallKey.words`` and hashes them. The key finds a loaded kernel in
  one override's table (one op, one dispatch key) and lives with the process.
- Python, on a miss: :attr:`CallSignature.key`, the first 24 hex digits of the
  sha256 of ``[str(schema), to_json()]`` as JSON with sorted keys, each runtime
  number's ``"value"`` left out. It names the cache entry on disk: what it
  hashes changes only with a new cache layout (tests/test_signature.py pins it).

What each side hashes, argument by argument:

==================  ==================================  ==========================================
argument            C++ words                           Python JSON
==================  ==================================  ==========================================
(the op)            none: one table per override        the schema string
tensor              tag, dtype, device type and index,  ``TensorArg``: dtype, device type, sizes,
                    rank, sizes, strides (not those of  strides (a size-1 dim's as a contiguous
                    size-1 dims), 16-byte alignment     tensor's), aligned (to ``ALIGNMENT``
                                                        bytes); the index is in ``decision_key`` only
undefined tensor    tag                                 ``NoneArg`` (Python receives None)
int, float          tag, value (a double's bits)        ``NumberArg``: value (a float's ``repr``)
a number given for  tag, dtype, value: the dispatcher   ``NumberArg``: as an int or float, which
a Tensor argument   passes a wrapped number             Python receives for a wrapped number; a
                                                        wrapped tensor: its dtype and value's repr
runtime number      as a constant in the exact key; in  ``RuntimeNumberArg``: as a number, without
                    the key of the kernel's family      its value: a float (also an item of a
                    (op_override.cpp), a tag without    ``Scalar[]``), or a positive int or int
                    the value, so that a new value      list item once its value moved (see
                    hits. The value is read into a 0-d  ``with_runtime_ints``). Its ``"kind"``
                    CPU tensor: int64 for an int,       gives the kernel input's dtype
                    float64 for a double
bool                tag, value                          ``ConstantArg``: value
str                 tag, length, ``std::hash``          ``ConstantArg``: the string
dtype, layout,      tag of an int (the stack holds      ``ConstantArg``: kind, ``str`` of the value
memory format       them as ints), value
device              tag, type, index                    ``ConstantArg``: ``str``, e.g. ``cuda:0``
None                tag                                 ``NoneArg``
list                tag, length, each item              ``ListArg``: each item
anything else       no key: the call runs eagerly       raises ``Unsupported``: eagerly too
==================  ==================================  ==========================================

Both refuse a call of an op that writes into an argument when two of its
tensors share memory.

:attr:`CallSignature.shape_key` is the Python key without the value of any
number (an int, a float, a wrapped or a runtime number) and without whether a
number is a kernel input: calls that share it differ only in numbers, whose
compiles a process counts (a kernel with runtime numbers is one of them). :attr:`CallSignature.decision_key` adds the device with its index: a
process loads a kernel once per device.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Iterator, Sequence, Union

import torch

ALIGNMENT = 16  # bytes; must match is_aligned() in csrc/call_key.h


def qualified_name(op: torch._ops.OpOverload) -> str:
    """``aten::add.Tensor`` (``aten::abs`` for a default overload)."""
    name = op._schema.name
    return f"{name}.{op._schema.overload_name}" if op._schema.overload_name else name


class Unsupported(Exception):
    """An argument that no kernel is compiled for; the call runs eagerly."""


# Only C++ can read a tensor's wrapped-number flag, and the C++ extension is
# the runtime's, a layer above: it hands its test down (aoti_eager/__init__.py).
_wrapped_number_test: Callable[[torch.Tensor], bool] | None = None


def use_wrapped_number_test(test: Callable[[torch.Tensor], bool]) -> None:
    """Makes ``test`` the answer of :func:`is_wrapped_number`."""
    global _wrapped_number_test
    _wrapped_number_test = test


def is_wrapped_number(t: torch.Tensor) -> bool:
    """Whether ``t`` is a Python number that a Tensor argument received as a
    0-d tensor: it promotes like a scalar, not like a tensor."""
    if _wrapped_number_test is None:
        raise RuntimeError("aoti_eager.kernels: no test for wrapped numbers (import aoti_eager, which gives it)")
    return _wrapped_number_test(t)


def clone_exact(t: torch.Tensor) -> torch.Tensor:
    """A copy with the same sizes, strides, storage offset and dtype."""
    with torch.no_grad():
        copy = torch.empty(0, dtype=t.dtype, device=t.device)
        copy.set_(t.untyped_storage().clone(), t.storage_offset(), t.size(), t.stride())
    return copy


def clone_args(args: tuple[Any, ...] | list[Any]) -> list[Any]:
    """Copies every tensor argument (wrapped numbers stay, they are not inputs)."""

    def clone(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value if is_wrapped_number(value) else clone_exact(value)
        if isinstance(value, (list, tuple)):
            return type(value)(clone(v) for v in value)
        return value

    return [clone(a) for a in args]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _canonical_strides(sizes: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """``strides`` with a size-1 dim's stride as a contiguous tensor's: an
    index into it is always 0, so its stride never moves through memory, and
    views give it any value (``x[:, -1:]`` of a growing ``x`` a new one per
    length). Kernels and keys depend only on the strides that step.

        >>> _canonical_strides((1, 4), (37, 1))
        (4, 1)
    """
    if 1 not in sizes:
        return tuple(strides)
    canonical, step = [], 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        canonical.append(step if size == 1 else stride)
        step *= max(size, 1)
    return tuple(reversed(canonical))


@dataclass(frozen=True)
class TensorArg:
    """A tensor the kernel takes as an input, compiled for exactly these sizes
    and strides (a size-1 dim's stride as a contiguous tensor's, whatever the
    call's: see :func:`_canonical_strides`)."""

    dtype: str  # e.g. "float32"
    device: str  # the device type: "cpu" or "cuda"
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    aligned: bool  # its data pointer is a multiple of ALIGNMENT bytes

    @classmethod
    def of(cls, t: torch.Tensor, device: torch.device) -> "TensorArg":
        if t.layout != torch.strided:
            raise Unsupported(f"{t.layout} tensors")
        if t.is_conj() or t.is_neg():
            raise Unsupported("tensors with a lazy conjugate or negative bit")
        if t.device != device:
            raise Unsupported(f"a {t.device} tensor in a call on {device}")
        sizes = tuple(t.shape)
        return cls(_dtype_name(t.dtype), t.device.type, sizes, _canonical_strides(sizes, t.stride()), t.data_ptr() % ALIGNMENT == 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "tensor",
            "dtype": self.dtype,
            "device": self.device,
            "sizes": list(self.sizes),
            "strides": list(self.strides),
            "aligned": self.aligned,
        }

    def short(self) -> str:
        return f"{self.dtype}{list(self.sizes)}"


@dataclass(frozen=True)
class NumberArg:
    """A number compiled into the kernel: a Python int or float, or, with
    ``wrapped_dtype``, a wrapped number (see :func:`is_wrapped_number`)."""

    value: int | float | bool  # a bool only as a wrapped number
    wrapped_dtype: str | None = None

    @property
    def can_be_runtime(self) -> bool:
        """Whether a kernel may take it as an input instead, always: a finite
        float. Ints are inputs only once they move (:attr:`can_be_runtime_int`);
        bools pick kernels (masks); inf and nan stay constants."""
        return type(self.value) is float and math.isfinite(self.value)

    @property
    def can_be_runtime_int(self) -> bool:
        """Whether a kernel may take it as a runtime int: a positive Python int.
        Zero and negative values stay constants: a divisor or exponent of 0, a
        negative size or power are eager errors or cases of their own, which a
        kernel checked at positive values is not.

            >>> NumberArg(7).can_be_runtime_int, NumberArg(0).can_be_runtime_int, NumberArg(7.0).can_be_runtime_int
            (True, False, False)
        """
        return type(self.value) is int and self.wrapped_dtype is None and self.value >= 1

    def to_json(self) -> dict[str, Any]:
        if self.wrapped_dtype is not None:
            return {"kind": "number", "dtype": self.wrapped_dtype, "value": repr(self.value)}
        if isinstance(self.value, float):
            return {"kind": "float", "value": repr(self.value)}
        return {"kind": "int", "value": self.value}

    def short(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class RuntimeNumberArg:
    """A float, or an int, the kernel takes as an input (see
    :func:`aoti_eager.kernels.compile.runtime_number_input`), so that one
    kernel serves every value; ``number`` holds this call's value."""

    number: NumberArg

    def to_json(self) -> dict[str, Any]:
        return {**self.number.to_json(), "runtime": True}

    def short(self) -> str:
        return self.number.short()


@dataclass(frozen=True)
class ListArg:
    """A list (``int[]``, ``Tensor[]``, ``Tensor?[]``, ``Scalar[]``), item by item."""

    items: tuple[Arg, ...]

    def to_json(self) -> dict[str, Any]:
        return {"kind": "list", "items": [item.to_json() for item in self.items]}

    def short(self) -> str:
        return "[" + ", ".join(item.short() for item in self.items) + "]"


@dataclass(frozen=True)
class NoneArg:
    """None given for an optional argument (an undefined tensor included)."""

    def to_json(self) -> dict[str, Any]:
        return {"kind": "none"}

    def short(self) -> str:
        return "None"


_CONSTANT_TYPES = (bool, str, torch.dtype, torch.layout, torch.memory_format, torch.device)


@dataclass(frozen=True)
class ConstantArg:
    """Any other argument, compiled into the kernel: a bool, a string, a
    dtype, a layout, a memory format or a device."""

    value: bool | str | torch.dtype | torch.layout | torch.memory_format | torch.device

    def to_json(self) -> dict[str, Any]:
        value = self.value if isinstance(self.value, (bool, str)) else str(self.value)
        return {"kind": type(self.value).__name__, "value": value}

    def short(self) -> str:
        return str(self.value)


Arg = Union[TensorArg, NumberArg, RuntimeNumberArg, ListArg, NoneArg, ConstantArg]


def argument_from_json(d: dict[str, Any]) -> Arg:
    """The description whose ``to_json()`` is ``d``, as a cache entry or a
    manifest holds it. Raises Unsupported for a kind it does not know."""
    kind = d["kind"]
    if kind == "tensor":
        return TensorArg(d["dtype"], d["device"], tuple(d["sizes"]), tuple(d["strides"]), d["aligned"])
    if kind == "list":
        return ListArg(tuple(argument_from_json(item) for item in d["items"]))
    if kind == "none":
        return NoneArg()
    if kind in ("bool", "str"):
        return ConstantArg(d["value"])
    if kind in ("dtype", "layout", "memory_format"):
        return ConstantArg(getattr(torch, d["value"].removeprefix("torch.")))
    if kind == "device":
        return ConstantArg(torch.device(d["value"]))
    if kind == "int":
        number = NumberArg(d["value"])
    elif kind == "float":
        number = NumberArg(float(d["value"]))
    elif kind == "number":
        text, dtype = d["value"], d["dtype"]
        value = text == "True" if dtype == "bool" else int(text) if dtype.startswith(("int", "uint")) else float(text)
        number = NumberArg(value, wrapped_dtype=dtype)
    else:
        raise Unsupported(f"arguments of kind {kind!r}")
    return RuntimeNumberArg(number) if d.get("runtime") else number


def _describe(value: Any, device: torch.device) -> Arg:
    if isinstance(value, torch.Tensor):
        if is_wrapped_number(value):
            if value.is_complex():
                raise Unsupported("complex Python numbers")
            return NumberArg(value.item(), wrapped_dtype=_dtype_name(value.dtype))
        return TensorArg.of(value, device)
    if value is None:
        return NoneArg()
    if isinstance(value, _CONSTANT_TYPES):  # before int: a bool is an int too
        return ConstantArg(value)
    if isinstance(value, (int, float)):
        return NumberArg(value)
    if isinstance(value, (list, tuple)):
        return ListArg(tuple(_describe(v, device) for v in value))
    raise Unsupported(f"arguments of type {type(value).__name__}")


def kernel_inputs(args: Sequence[Any], described: Sequence[Arg]) -> Iterator[tuple[Any, TensorArg | RuntimeNumberArg]]:
    """The values of ``args`` that the kernel takes as inputs, each with its
    description: tensors and runtime numbers, in the order the arguments
    flatten (schema order; in a list, item order)."""
    for value, d in zip(args, described):
        if isinstance(d, (TensorArg, RuntimeNumberArg)):
            yield value, d
        elif isinstance(d, ListArg):
            yield from kernel_inputs(value, d.items)


def tensor_args(signature: "CallSignature") -> list[TensorArg]:
    """The call's tensor arguments in the order the C++ key meets them (lists included)."""
    return [d for _, d in kernel_inputs(signature.args, signature.described) if isinstance(d, TensorArg)]


# Where an int is in a call: an argument's index, or (an int list argument's
# index, the item's index).
Position = Union[int, tuple[int, int]]


def _items(described: Sequence[Arg]) -> Iterator[tuple[Position, Arg]]:
    """Each argument, and each item of a list argument, with its position."""
    for i, d in enumerate(described):
        yield i, d
        if isinstance(d, ListArg):
            for j, item in enumerate(d.items):
                yield (i, j), item


def _split(position: Position) -> tuple[int, int | None]:
    """The argument's index, and the item's in it (None for the whole argument)."""
    return position if isinstance(position, tuple) else (position, None)


def _at(values: Sequence[Any], position: Position) -> Any:
    """What ``values`` (arguments, or their descriptions) hold at ``position``."""
    i, j = _split(position)
    if j is None:
        return values[i]
    return (values[i].items if isinstance(values[i], ListArg) else values[i])[j]


def _with(values: tuple[Any, ...], position: Position, new: Any) -> tuple[Any, ...]:
    """``values`` (arguments, or their descriptions) with ``new`` at ``position``.

        >>> _with((1, [2, 3]), (1, 0), 7), _with((1, [2, 3]), 0, 7)
        ((1, [7, 3]), (7, [2, 3]))
    """
    i, j = _split(position)
    if j is not None:
        outer = values[i]
        new = ListArg(_with(outer.items, j, new)) if isinstance(outer, ListArg) else type(outer)(_with(tuple(outer), j, new))
    return (*values[:i], new, *values[i + 1:])


# A kernel's wrapper reads a runtime number from its 0-d CPU tensor when the
# kernel is called and hands it to the device code by value: ints and floats
# arrive right on CPU and CUDA (torch 2.11, H100: arange at 20 ends, add and
# mul at 20 floats, all equal to eager's). On CUDA a float does so only since
# kernels.inductor.wrapper_split types its launch parameter double: Inductor's int64_t
# made 3.7 a 3.
_RUNTIME_NUMBER_DEVICES = ("cpu", "cuda")


# Scalars whose value picks the computation, not a value in it: Inductor
# lowers ``x ** 3.0`` to two multiplies and an ``ord=2`` norm to a square root
# of a sum, where a number read at run time takes the general power.
_SELECTS_COMPUTATION = frozenset({"exponent", "ord", "p"})


def _takes_runtime_number(argument: torch._C.Argument) -> bool:
    """Whether a float given for ``argument`` can be a kernel input instead of a
    constant: a ``Scalar`` that scales values (``alpha``, ``min``,
    ``negative_slope``) and never shapes the output. Tensor arguments receive
    Python numbers as wrapped numbers. Not a ``float`` (``eps``): export hands
    the op the number read at run time, a SymFloat, which a ``float`` argument
    refuses, so each try failed and queued the call again with its number
    compiled in (native_layer_norm: a second round of compiles in every
    transformer's first forward)."""
    declared = argument.type
    if isinstance(declared, torch._C.OptionalType):
        declared = declared.getElementType()
    return isinstance(declared, (torch._C.NumberType, torch._C.TensorType))


def _takes_runtime_numbers(argument: torch._C.Argument) -> bool:
    """Whether the floats of a list given for ``argument`` can be kernel
    inputs: a ``Scalar[]`` (the scalars of ``_foreach_div_.ScalarList``,
    which an optimizer gives new values each step). Its length stays in the key."""
    declared = argument.type
    if isinstance(declared, torch._C.OptionalType):
        declared = declared.getElementType()
    return isinstance(declared, torch._C.ListType) and isinstance(declared.getElementType(), torch._C.NumberType)


def _as_runtime_numbers(argument: torch._C.Argument, described: Arg) -> Arg:
    """``described`` with the floats that a kernel may take as inputs (see
    :func:`_takes_runtime_number`, :func:`_takes_runtime_numbers`) as runtime
    numbers, unless they pick the computation (an exponent, a norm's order,
    ``_foreach_pow``'s exponents)."""
    if argument.name in _SELECTS_COMPUTATION:
        return described
    runtime = lambda d: RuntimeNumberArg(d) if isinstance(d, NumberArg) and d.can_be_runtime else d  # noqa: E731
    if isinstance(described, NumberArg) and _takes_runtime_number(argument):
        return runtime(described)
    if isinstance(described, ListArg) and _takes_runtime_numbers(argument):
        return ListArg(tuple(map(runtime, described.items)))
    return described


def _takes_runtime_int(op: torch._ops.OpOverload, position: Position) -> bool:
    """Whether an int at ``position`` in a call of ``op`` can be a kernel input
    once it moves: one given for an ``int``, ``SymInt`` or ``Scalar`` (a size,
    a count, a bound, a Scalar operand), or an item of an ``int[]`` or
    ``SymInt[]`` (a pad, a size), never a dtype, layout or memory format (ints
    to the dispatcher). Whether the kernel can trace it as a number read at run
    time is export's to say: an int used as a dim index cannot be."""
    declared = _declared_type(op, position)
    if _split(position)[1] is not None:
        return isinstance(declared, (torch._C.IntType, torch._C.SymIntType))
    return isinstance(declared, (torch._C.IntType, torch._C.SymIntType, torch._C.NumberType))


def _is_enum(argument: torch._C.Argument) -> bool:
    """Whether ``argument`` takes an enum that the dispatcher passes as an int
    (a ``ScalarType``, ``Layout`` or ``MemoryFormat``): no number."""
    return str(_without_optional(argument.real_type)) in ("ScalarType", "Layout", "MemoryFormat")


def _declared_type(op: torch._ops.OpOverload, position: Position) -> torch._C.JitType | None:
    """The type ``op`` declares at ``position`` (an item's, in a list), as its
    schema reads (``ScalarType``, not the ``int`` it is passed as)."""
    i, item = _split(position)
    declared = _without_optional(op._schema.arguments[i].real_type)
    if item is None:
        return declared
    return declared.getElementType() if isinstance(declared, torch._C.ListType) else None


def _without_optional(declared: torch._C.JitType) -> torch._C.JitType:
    return declared.getElementType() if isinstance(declared, torch._C.OptionalType) else declared


def _call_device(device_type: str, args: list[Any]) -> torch.device:
    """The device the call runs on: its first tensor's, or its device argument's."""

    def find(value: Any) -> torch.device | None:
        if isinstance(value, torch.Tensor) and value.device.type == device_type and not is_wrapped_number(value):
            return value.device
        if isinstance(value, torch.device) and value.type == device_type:
            return value
        if isinstance(value, (list, tuple)):
            return next((d for d in map(find, value) if d is not None), None)
        return None

    device = find(list(args))
    if device is None:
        device = torch.device(device_type)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _share_memory(args: list[Any], described: tuple[Arg, ...]) -> bool:
    storages = [t.untyped_storage()._cdata for t, d in kernel_inputs(args, described) if isinstance(d, TensorArg)]
    return len(storages) != len(set(storages))


@dataclass(frozen=True)
class CallSignature:
    """One call's arguments as the compiled kernel sees them.

    ``args`` are the op's arguments in schema order, as the dispatcher passed them.
    """

    op: torch._ops.OpOverload
    device: torch.device  # where the call runs; only its type is part of the key
    args: tuple[Any, ...]
    described: tuple[Arg, ...]

    @classmethod
    def of(
        cls, op: torch._ops.OpOverload, device_type: str, args: list[Any], runtime_numbers: bool = True
    ) -> "CallSignature":
        """The signature of a call that the dispatcher sent to ``device_type``'s kernel.

        With ``runtime_numbers``, finite floats given for numeric arguments are
        kernel inputs (:class:`RuntimeNumberArg`, whose values are left out of
        the key), so that one kernel serves every value; otherwise, and for
        other numbers, values are compiled in. Ints are compiled in until the
        caller asks for them as inputs (:meth:`with_runtime_ints`).
        """
        device = _call_device(device_type, args)
        described = tuple(_describe(a, device) for a in args)
        if runtime_numbers and device.type in _RUNTIME_NUMBER_DEVICES:
            described = tuple(_as_runtime_numbers(arg, d) for arg, d in zip(op._schema.arguments, described))
        if op._schema.is_mutable and _share_memory(args, described):
            raise Unsupported("an op that writes into an argument, given arguments that share memory")
        return cls(op, device, tuple(args), described)

    @property
    def runtime_arguments(self) -> list[Position]:
        """Where the numbers are that the kernel takes at run time, in the
        order it takes them: argument indices, and (argument, item) indices
        of items of int lists."""
        return [p for p, d in _items(self.described) if isinstance(d, RuntimeNumberArg)]

    @property
    def number_positions(self) -> list[Position]:
        """Where its numbers are, compiled in or runtime, in argument and item order."""
        return [p for p, d in _items(self.described) if isinstance(d, (NumberArg, RuntimeNumberArg))]

    @property
    def values_key(self) -> str:
        """The cache key of a verdict that holds for every value of the
        call's numbers (those :attr:`shape_key` leaves out)."""
        return f"{self.shape_key}-values"

    @property
    def int_arguments(self) -> dict[Position, int]:
        """The ints given for arguments, or as items of int lists, that may
        take them at run time (:func:`_takes_runtime_int`), compiled in here,
        by position.

            >>> CallSignature.of(torch.ops.aten.constant_pad_nd.default, "cpu", [torch.zeros(2, 3), [0, 5], 0]).int_arguments
            {(1, 0): 0, (1, 1): 5, 2: 0}
        """
        return {
            p: d.value for p, d in _items(self.described)
            if isinstance(d, NumberArg) and type(d.value) is int and d.wrapped_dtype is None and _takes_runtime_int(self.op, p)
        }

    def can_take_runtime_ints(self, positions: Iterable[Position]) -> bool:
        """Whether the ints at ``positions`` may be kernel inputs in this call:
        positive ints (see :attr:`NumberArg.can_be_runtime_int`), on a device
        whose kernels read runtime numbers as they are called."""
        ints = self.int_arguments
        return self.device.type in _RUNTIME_NUMBER_DEVICES and all(
            p in ints and _at(self.described, p).can_be_runtime_int for p in positions
        )

    def with_runtime_ints(self, positions: Iterable[Position]) -> "CallSignature":
        """The same call with the ints at ``positions`` as kernel inputs, so that
        one kernel serves every positive value of them (their values leave the key).

            >>> call = CallSignature.of(torch.ops.aten.arange.default, "cpu", [7, None, None, torch.device("cpu"), None])
            >>> call.with_runtime_ints([0]).runtime_arguments, call.with_runtime_ints([0]).short()
            ([0], 'end=7, dtype=None, layout=None, device=cpu, pin_memory=None')
            >>> pad = CallSignature.of(torch.ops.aten.constant_pad_nd.default, "cpu", [torch.zeros(2, 3), [0, 5], 0])
            >>> pad.with_runtime_ints([(1, 1)]).runtime_arguments
            [(1, 1)]
        """
        positions = list(dict.fromkeys(positions))
        if not self.can_take_runtime_ints(positions):
            raise ValueError(f"{qualified_name(self.op)}: arguments {positions} of ({self.short()}) cannot be runtime ints")
        described = self.described
        for p in positions:
            described = _with(described, p, RuntimeNumberArg(_at(described, p)))
        return replace(self, described=described)

    def with_constant_numbers(self) -> "CallSignature":
        """The same call with every number compiled into the kernel."""
        described = self.described
        for p in self.runtime_arguments:
            described = _with(described, p, _at(described, p).number)
        return replace(self, described=described)

    def with_other_numbers(self, lower: bool = False) -> "CallSignature":
        """The same call with other values for its runtime numbers: a kernel that
        takes them as inputs must match eager on these too. A float becomes
        0.75 times itself; an int the next one up, or with ``lower`` the next
        one down where that is still positive (eager may refuse the next one up:
        ``topk``'s k past the size).

            >>> call = CallSignature.of(torch.ops.aten.arange.default, "cpu", [7, None, None, None, None]).with_runtime_ints([0])
            >>> call.with_other_numbers().args[0], call.with_other_numbers(lower=True).args[0]
            (8, 6)
        """
        args, described = self.args, self.described
        for p in self.runtime_arguments:
            number = _at(described, p).number
            if type(number.value) is int:
                other = number.value - 1 if lower and number.value > 1 else number.value + 1
            else:
                other = number.value * 0.75 if number.value else 0.5
            # A Python number: where the op takes a Tensor, it wraps it as a number again.
            args = _with(args, p, other)
            described = _with(described, p, RuntimeNumberArg(replace(number, value=other)))
        return replace(self, args=args, described=described)

    def name_of(self, position: Position) -> str:
        """The argument at ``position`` as logs name it: ``end``, ``pad[1]``."""
        i, item = _split(position)
        name = self.op._schema.arguments[i].name
        return name if item is None else f"{name}[{item}]"

    def to_json(self) -> list[dict[str, Any]]:
        return [{"name": a.name, **d.to_json()} for a, d in zip(self.op._schema.arguments, self.described)]

    @property
    def key(self) -> str:
        """The digest that names this signature's cache entry (see Keys, above)."""
        named = [{"name": a.name, **_key_form(d)} for a, d in zip(self.op._schema.arguments, self.described)]
        return _digest([str(self.op._schema), named])

    @property
    def shape_key(self) -> str:
        """The key without the values of numbers, nor whether they are kernel
        inputs: signatures that share it differ only in numbers (``alpha``,
        ``lr``, ``arange``'s end, ...), never in a dtype."""
        return _digest([
            str(self.op._schema),
            [_key_form(d) if _is_enum(a) else _without_number_value(d) for a, d in zip(self.op._schema.arguments, self.described)],
        ])

    @property
    def decision_key(self) -> tuple[str, str]:
        """What a process remembers a decision by: a kernel is loaded per device."""
        return (self.key, str(self.device))

    def short(self) -> str:
        """A one-line form for logs, e.g. ``self=float32[64, 64], other=float32[64, 64], alpha=2``."""
        return ", ".join(f"{a.name}={d.short()}" for a, d in zip(self.op._schema.arguments, self.described))


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:24]


def _key_form(described: Arg) -> dict[str, Any]:
    """One argument as :attr:`CallSignature.key` hashes it: a runtime number
    without its value, in a list too (any other list as its ``to_json()``)."""
    if isinstance(described, ListArg):
        return {"kind": "list", "items": [_key_form(item) for item in described.items]}
    form = described.to_json()
    if isinstance(described, RuntimeNumberArg):
        del form["value"]
    return form


def _without_number_value(described: Arg) -> dict[str, Any]:
    """One argument as :attr:`CallSignature.shape_key` hashes it: any number
    without its value, a runtime number as the constant it may also be."""
    if isinstance(described, ListArg):
        return {"kind": "list", "items": [_without_number_value(item) for item in described.items]}
    if isinstance(described, RuntimeNumberArg):
        described = described.number
    form = described.to_json()
    if isinstance(described, NumberArg):
        del form["value"]
    return form


def short_form(signature: list[dict[str, Any]]) -> str:
    """:meth:`CallSignature.short` of a signature as kept in a cache entry."""
    return ", ".join(f"{d['name']}={argument_from_json(d).short()}" for d in signature)
