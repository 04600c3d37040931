"""The static input signature of one op call.

A signature describes every argument the way the compiled kernel depends on
it: a tensor by dtype, device, sizes, strides and alignment; any other
argument by its value (compiled into the kernel). It is stored as JSON beside
the kernel and its digest names the cache entry.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
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
    def of(cls, op: torch._ops.OpOverload, device_type: str, args: list[Any]) -> "CallSignature":
        """The signature of a call that the dispatcher sent to ``device_type``'s kernel."""
        device = _call_device(device_type, args)
        described = tuple(_describe(a, device) for a in args)
        if op._schema.is_mutable and _share_memory(args, described):
            raise Unsupported("an op that writes into an argument, given arguments that share memory")
        return cls(op, device, tuple(args), described)

    def to_json(self) -> list[dict[str, Any]]:
        return [{"name": a.name, **d} for a, d in zip(self.op._schema.arguments, self.described)]

    @property
    def key(self) -> str:
        """The digest that names this signature's cache entry."""
        text = json.dumps([str(self.op._schema), self.to_json()], sort_keys=True)
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
