"""The static input signature of one op call.

A signature describes every argument the way the compiled kernel depends on
it: a tensor by dtype, device, sizes, strides and alignment; any other
argument by its value (compiled into the kernel). It is stored as JSON beside
the kernel and its digest names the cache entry.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

ALIGNMENT = 16  # bytes; must match is_aligned() in csrc/call_key.h


class Unsupported(Exception):
    """An argument that no kernel is compiled for; the call runs eagerly."""


def _is_wrapped_number(t: torch.Tensor) -> bool:
    from aoti_eager import _extension

    return _extension.load().is_wrapped_number(t)


def describe_tensor(t: torch.Tensor, device: torch.device) -> dict[str, Any]:
    if t.layout != torch.strided:
        raise Unsupported(f"{t.layout} tensors")
    if t.is_conj() or t.is_neg():
        raise Unsupported("tensors with a lazy conjugate or negative bit")
    if t.device != device:
        raise Unsupported(f"a {t.device} tensor in a call on {device}")
    return {
        "kind": "tensor",
        "dtype": str(t.dtype).removeprefix("torch."),
        "device": t.device.type,
        "sizes": list(t.shape),
        "strides": list(t.stride()),
        "aligned": t.data_ptr() % ALIGNMENT == 0,
    }


def _describe(value: Any, device: torch.device) -> dict[str, Any]:
    if isinstance(value, torch.Tensor):
        if _is_wrapped_number(value):
            if value.is_complex():
                raise Unsupported("complex Python numbers")
            # A Python number the op received as a 0-d tensor: it promotes like
            # a scalar, and its value is compiled into the kernel.
            return {"kind": "number", "dtype": str(value.dtype).removeprefix("torch."), "value": repr(value.item())}
        return describe_tensor(value, device)
    if value is None:
        return {"kind": "none"}
    if isinstance(value, bool):
        return {"kind": "bool", "value": value}
    if isinstance(value, int):
        return {"kind": "int", "value": value}
    if isinstance(value, float):
        return {"kind": "float", "value": repr(value)}
    if isinstance(value, str):
        return {"kind": "str", "value": value}
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, torch.device)):
        return {"kind": type(value).__name__, "value": str(value)}
    if isinstance(value, (list, tuple)):
        return {"kind": "list", "items": [_describe(v, device) for v in value]}
    raise Unsupported(f"arguments of type {type(value).__name__}")


# CUDA kernels compile their values in. With torch 2.11 on an H100, a kernel
# given the number as a CPU tensor (0-d or of one element alike) read it when
# the launch ran, not when it was queued: add.Tensor's kernel disagreed with
# eager at once, and mul.Tensor's passed the check against eager (which
# synchronizes) and then computed with earlier calls' values.
_RUNTIME_NUMBER_DEVICES = ("cpu",)


def _takes_runtime_number(argument: torch._C.Argument) -> bool:
    """Whether a float given for ``argument`` can be a kernel input instead of a
    constant: a number that scales values (``alpha``, ``min``, ``negative_slope``)
    and never shapes the output. Tensor arguments receive Python numbers as
    wrapped numbers."""
    declared = argument.type
    if isinstance(declared, torch._C.OptionalType):
        declared = declared.getElementType()
    return isinstance(declared, (torch._C.FloatType, torch._C.NumberType, torch._C.TensorType))


def _runtime_number(value: Any) -> float | None:
    """``value`` as a kernel's runtime number, or None if it stays a constant."""
    if isinstance(value, torch.Tensor):
        if not (_is_wrapped_number(value) and value.is_floating_point()):
            return None
        value = value.item()
    if type(value) is not float or not math.isfinite(value):
        return None  # ints and bools pick kernels (integer math, masks); inf and nan stay constants
    return value


def _call_device(device_type: str, args: list[Any]) -> torch.device:
    """The device the call runs on: its first tensor's, or its device argument's."""

    def find(value: Any) -> torch.device | None:
        if isinstance(value, torch.Tensor) and value.device.type == device_type and not _is_wrapped_number(value):
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


def _share_memory(args: list[Any], described: tuple[dict[str, Any], ...]) -> bool:
    storages = []

    def collect(value: Any, d: dict[str, Any]) -> None:
        if d["kind"] == "tensor":
            storages.append(value.untyped_storage()._cdata)
        elif d["kind"] == "list":
            for v, item in zip(value, d["items"]):
                collect(v, item)

    for value, d in zip(args, described):
        collect(value, d)
    return len(storages) != len(set(storages))


@dataclass(frozen=True)
class CallSignature:
    """One call's arguments as the compiled kernel sees them.

    ``args`` are the op's arguments in schema order, as the dispatcher passed them.
    """

    op: torch._ops.OpOverload
    device: torch.device  # where the call runs; only its type is part of the key
    args: tuple[Any, ...]
    described: tuple[dict[str, Any], ...]

    @classmethod
    def of(
        cls, op: torch._ops.OpOverload, device_type: str, args: list[Any], runtime_numbers: bool = True
    ) -> "CallSignature":
        """The signature of a call that the dispatcher sent to ``device_type``'s kernel.

        With ``runtime_numbers``, finite floats given for numeric arguments are
        kernel inputs (marked ``"runtime"``; their values are left out of the
        key), so that one kernel serves every value; otherwise, and for other
        numbers, values are compiled in.
        """
        device = _call_device(device_type, args)
        described = tuple(_describe(a, device) for a in args)
        if runtime_numbers and device.type in _RUNTIME_NUMBER_DEVICES:
            described = tuple(
                {**d, "runtime": True} if _takes_runtime_number(arg) and _runtime_number(value) is not None else d
                for arg, value, d in zip(op._schema.arguments, args, described)
            )
        if op._schema.is_mutable and _share_memory(args, described):
            raise Unsupported("an op that writes into an argument, given arguments that share memory")
        return cls(op, device, tuple(args), described)

    @property
    def runtime_arguments(self) -> list[int]:
        """Indices of the arguments that the kernel takes as runtime numbers."""
        return [i for i, d in enumerate(self.described) if d.get("runtime")]

    def with_constant_numbers(self) -> "CallSignature":
        """The same call with every number compiled into the kernel."""
        return replace(self, described=tuple({k: v for k, v in d.items() if k != "runtime"} for d in self.described))

    def with_other_numbers(self) -> "CallSignature":
        """The same call with other values for its runtime numbers: a kernel that
        takes them as inputs must match eager on these too."""
        args = list(self.args)
        for i in self.runtime_arguments:
            value = _runtime_number(args[i])
            # A Python float: where the op takes a Tensor, it wraps it as a number again.
            args[i] = value * 0.75 if value else 0.5
        return replace(self, args=tuple(args))

    def to_json(self) -> list[dict[str, Any]]:
        return [{"name": a.name, **d} for a, d in zip(self.op._schema.arguments, self.described)]

    @property
    def key(self) -> str:
        """The digest that names this signature's cache entry: runtime numbers
        count by kind, not value."""

        def strip(d: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in d.items() if k != "value"} if d.get("runtime") else d

        text = json.dumps([str(self.op._schema), [strip(d) for d in self.to_json()]], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    @property
    def shape_key(self) -> str:
        """The key without the values of numbers: signatures that share it
        differ only in values compiled into the kernel (``alpha``, ``lr``, ...)."""

        def strip(d: dict[str, Any]) -> dict[str, Any]:
            if d["kind"] == "list":
                return {**d, "items": [strip(i) for i in d["items"]]}
            return {k: v for k, v in d.items() if not (k == "value" and d["kind"] in ("number", "int", "float"))}

        text = json.dumps([str(self.op._schema), [strip(d) for d in self.described]], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    @property
    def decision_key(self) -> tuple[str, str]:
        """What a process remembers a decision by: a kernel is loaded per device."""
        return (self.key, str(self.device))

    def short(self) -> str:
        """A one-line form for logs, e.g. ``self=float32[64, 64], other=float32[64, 64], alpha=2``."""
        return short_form(self.to_json())


def short_form(signature: list[dict[str, Any]]) -> str:
    """:meth:`CallSignature.short` of a signature as kept in a cache entry."""
    return ", ".join(f"{d['name']}={_short(d)}" for d in signature)


def _short(d: dict[str, Any]) -> str:
    kind = d["kind"]
    if kind == "tensor":
        return f"{d['dtype']}{d['sizes']}"
    if kind == "list":
        return "[" + ", ".join(_short(i) for i in d["items"]) + "]"
    if kind == "none":
        return "None"
    return str(d["value"])
