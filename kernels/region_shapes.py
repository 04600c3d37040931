"""Dynamic shapes of regions: one kernel for every batch size or sequence length.

Calls of one region that differ only in the sizes and strides of the call's
tensors (never its parameters' or buffers') are one *region family*
(:func:`family_key`). As for ops (:mod:`aoti_eager.kernels.dynamic`), the
dims that moved between two calls of a family are exported as
``torch.export.Dim.DYNAMIC``; a :class:`ShapeFamily` over the call's tensors
(in the order the call flattens) holds the guards the exported program gives
(each dynamic dim a symbol within its range, dims export found equal one
symbol, the strides derived from sizes), and its kernel serves exactly the
calls those guards admit (:func:`admits`). The kernel is published under
:func:`entry_key`, which begins with the family key, so that every process
finds it by that prefix. Where export fixes a moved dim, fails with the dims
dynamic, or the kernel disagrees with eager at another size, the family is
recorded as static under :func:`static_key` and its shapes compile alone.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
import torch.utils._pytree as pytree

from aoti_eager.kernels.dynamic import NotDynamic, ShapeFamily, _form
from aoti_eager.kernels.compile import Artifact
from aoti_eager.kernels.region import RegionCall, _digest
from aoti_eager.kernels.signature import NumberArg, TensorArg

log = logging.getLogger("aoti_eager")


def call_tensors(call: RegionCall) -> list[TensorArg]:
    """The call's tensors as described, in the order the call flattens (the family's tensor indices)."""
    return [d for _, d in call.described if isinstance(d, TensorArg)]


def call_sizes(call: RegionCall) -> list[tuple[int, ...]]:
    return [t.sizes for t in call_tensors(call)]


def family_key(call: RegionCall) -> str:
    """What calls of one region family share: :attr:`RegionCall.key` without
    the sizes and strides of the call's tensors (of these, the order of their
    dims in memory)."""
    return _digest([call.structure, str(torch.get_default_dtype()), str(call.spec), [[p, _form(d, None)] for p, d in call.described]])


def values_key(call: RegionCall) -> str:
    """What calls that differ only in the numbers of their arguments share:
    :attr:`RegionCall.key` with each number's type instead of its value."""
    described = [[p, type(d.value).__name__ if isinstance(d, NumberArg) else d.to_json()] for p, d in call.described]
    return _digest([call.structure, str(torch.get_default_dtype()), str(call.spec), described])


def static_key(call: RegionCall) -> str:
    """The cache key of the verdict that the family of ``call`` has no dynamic kernel."""
    return f"{family_key(call)}-static"


def entry_key(call: RegionCall, family: ShapeFamily) -> str:
    """The cache key of ``family``'s kernel for calls like ``call``: the family
    key, then a digest of the sizes and strides the kernel fixes."""
    fixed = iter(family.dims)
    return f"{family_key(call)}-{_digest([_form(d, fixed) for _, d in call.described])[:16]}"


def admits(family: ShapeFamily, key: str, call: RegionCall) -> bool:
    """Whether the kernel published under ``key``, of ``family``, was compiled for ``call``."""
    tensors = call_tensors(call)
    return (
        len(tensors) == len(family.dims) and entry_key(call, family) == key and family.layout_admitted(tensors)
        and family.symbol_values_of_sizes([t.sizes for t in tensors]) is not None
    )


def export_shapes(call: RegionCall, family: ShapeFamily) -> tuple[Any, ...]:
    """``dynamic_shapes`` for exporting :class:`RegionModule` (its state's
    tensors, never dynamic, then the call's). A dim of size 1 stays 1."""
    dims = [{d: torch.export.Dim.DYNAMIC for d in dims if t.sizes[d] > 1} or None for dims, t in zip(family.dims, call_tensors(call))]
    return (tuple([None] * len(call.tensors) + dims),)


def guarded(call: RegionCall, family: ShapeFamily, artifact: Artifact) -> ShapeFamily:
    """``family`` with the guards of ``artifact``'s exported program. Raises
    NotDynamic where export fixed a dim that moved, or its guards do not admit
    the call it was compiled from."""
    n = len(call.tensors)
    result = family.with_tensor_guards(call_tensors(call), artifact.input_shapes[n:], artifact.input_strides[n:],
                                       artifact.range_constraints)
    paths = [p for p, d in call.described if isinstance(d, TensorArg)]
    for tensor, dim, symbol, size in result.guards:
        if symbol < 0:
            raise NotDynamic(f"export fixed dim {dim} of {paths[tensor]} to {size}")
    if result.symbol_values_of_sizes(call_sizes(call)) is None:
        raise NotDynamic("its guards do not admit the call it was compiled for")
    return result


def resized(call: RegionCall, family: ShapeFamily, values: dict[int, int]) -> RegionCall | None:
    """``call`` with each symbol of ``family`` at ``values``' size: new tensors
    where a dim moves (random values; integer tensors repeat their own), the
    others copied; None where the call cannot be rebuilt."""
    sizes = {(tensor, dim): values[symbol] for tensor, dim, symbol, _ in family.guards if symbol >= 0}
    tensors = call_tensors(call)
    shapes = family.shapes_with(tensors, sizes)
    index = iter(range(len(tensors)))
    try:
        leaves = [family.resized_tensor(next(index), v, d, shapes) if isinstance(d, TensorArg) else v
                  for v, (_, d) in zip(call.leaves, call.described)]
        args, kwargs = pytree.tree_unflatten(leaves, call.spec)
        return call.with_arguments(args, kwargs)
    except Exception:  # noqa: BLE001 - a call that cannot be rebuilt is not checked
        return None


def named_inputs(message: str, call: RegionCall) -> str:
    """``message`` with export's names of the exported inputs (``L['flat'][7]``) as the region's own.

        >>> call = RegionCall.of("r", ("weight",), (torch.ones(2),), "s", (torch.ones(3),), {})
        >>> named_inputs("Constraints violated (L['flat'][1].size()[0])!", call)
        'Constraints violated (args[0].size()[0])!'
    """
    names = [*call.names, *(p for p, d in call.described if isinstance(d, TensorArg))]
    return re.sub(r"L\['flat'\]\[(\d+)\]", lambda m: names[int(m[1])] if int(m[1]) < len(names) else m[0], message)
