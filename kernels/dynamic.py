"""Dynamic-shape kernels: one kernel for every size of the dims that move.

Calls of one op that differ only in tensor sizes are one *shape family*
(:func:`family_key`: the same op, dtypes, devices, ranks, contiguity,
alignment and other arguments). The first shape of a family compiles a static
kernel. When a second shape arrives, the dims that changed are compiled as
symbols (``torch.export`` with ``Dim.DYNAMIC``) into one kernel that serves
every later shape its guards admit; a shape that differs in a further dim
widens the kernel.

A dynamic kernel's guards are what the exported program says of its inputs
(:class:`ShapeFamily`): each dynamic dim is a symbol within its range
(export specializes sizes 0 and 1, so ranges start at 2), dims of one symbol
are equal (``mm``'s inner dims, ``add``'s broadcast dims), and a dim export
specialized stays that size. Tensors with a dynamic dim must be contiguous;
every tensor has fewer than 2**31 elements. The C++ hit path
(``ShapeGuards::admit`` in csrc/call_key.cpp) and :meth:`ShapeFamily.admits`
check the same: a call is never run by a kernel that was not compiled for it.

Example::

    >>> import torch
    >>> from aoti_eager.kernels.signature import CallSignature
    >>> a = CallSignature.of(torch.ops.aten.add.Tensor, "cpu", [torch.randn(5, 8), torch.randn(8)])
    >>> b = CallSignature.of(torch.ops.aten.add.Tensor, "cpu", [torch.randn(9, 8), torch.randn(8)])
    >>> family_key(a) == family_key(b), changed_dims(b, [[(5, 8), (8,)]])
    (True, ((0,), ()))
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any, Iterator

import sympy
import torch

from aoti_eager.kernels.examples import example_tensor
from aoti_eager.kernels.signature import (
    CallSignature, ListArg, RuntimeNumberArg, TensorArg, argument_from_json, clone_exact, _digest, _key_form,
)

# Kernels index their tensors with 32-bit math up to this many elements
# (ShapeGuards::kMaxNumel in csrc/call_key.h).
MAX_NUMEL = 2**31 - 1
# An unbounded symbol's max, as C++ reads it.
UNBOUNDED = 2**63 - 1


class NotDynamic(Exception):
    """The exported program does not give the dims as plain symbols."""


def _tensors_in(described: Any) -> Iterator[TensorArg]:
    if isinstance(described, TensorArg):
        yield described
    elif isinstance(described, ListArg):
        for item in described.items:
            yield from _tensors_in(item)


def tensor_args(signature: CallSignature) -> list[TensorArg]:
    """The call's tensor arguments in the order the C++ key meets them (lists included)."""
    return [t for d in signature.described for t in _tensors_in(d)]


def is_contiguous(t: TensorArg) -> bool:
    """Whether ``t``'s strides are those of a contiguous tensor of its sizes, as torch counts them."""
    if 0 in t.sizes:
        return True
    expected = 1
    for size, stride in reversed(list(zip(t.sizes, t.strides))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _form(described: Any, dims: Iterator[tuple[int, ...]] | None) -> Any:
    """One argument as a family key hashes it: a tensor by its dtype, device,
    rank, contiguity and alignment, and its sizes and strides where ``dims``
    does not make them dynamic; None for all sizes."""
    if isinstance(described, TensorArg):
        dynamic = set(next(dims, ())) if dims is not None else None
        form = {"kind": "tensor", "dtype": described.dtype, "device": described.device, "rank": len(described.sizes),
                "contiguous": is_contiguous(described), "aligned": described.aligned}
        if dynamic is not None:
            form["sizes"] = [None if d in dynamic else n for d, n in enumerate(described.sizes)]
            if not dynamic:
                form["strides"] = list(described.strides)
        return form
    if isinstance(described, ListArg):
        return {"kind": "list", "items": [_form(item, dims) for item in described.items]}
    return _key_form(described)


def family_key(signature: CallSignature) -> str:
    """What calls of one shape family share: everything but tensor sizes and strides."""
    return _digest([str(signature.op._schema), [_form(d, None) for d in signature.described]])


def changed_dims(signature: CallSignature, seen: list[list[tuple[int, ...]]]) -> tuple[tuple[int, ...], ...]:
    """For each tensor argument, the dims whose size differs from one of the
    ``seen`` calls of its family (each a list of its tensors' sizes) and is at
    least 2 here: export specializes 0 and 1."""
    mine = tensor_args(signature)
    changed: list[set[int]] = [set() for _ in mine]
    for sizes in seen:
        for i, (a, other) in enumerate(zip(mine, sizes)):
            changed[i].update(d for d, (n, m) in enumerate(zip(a.sizes, other)) if n != m and n >= 2)
    return tuple(tuple(sorted(c)) for c in changed)


@dataclass(frozen=True)
class ShapeFamily:
    """The dims a kernel takes at any size, and its guards.

    ``dims``: for each tensor argument (:func:`tensor_args` order), its
    dynamic dims. ``guards``: ``(tensor, dim, symbol, size)`` for each dynamic
    dim, with ``symbol`` an index into ``ranges``, or -1 where export
    specialized the dim to ``size``. ``ranges``: ``(min, max)`` of each symbol.
    """

    dims: tuple[tuple[int, ...], ...]
    guards: tuple[tuple[int, int, int, int], ...] = ()
    ranges: tuple[tuple[int, int], ...] = ()

    @classmethod
    def any_shape(cls, signature: CallSignature) -> "ShapeFamily":
        """Every dim of every tensor dynamic, unguarded: the whole family of
        ``signature`` (its contiguous tensors), for a decision that holds for all of it."""
        return cls(tuple(tuple(range(len(t.sizes))) for t in tensor_args(signature)))

    @property
    def dim_bits(self) -> list[int]:
        """``dims`` as csrc/call_key.h's DynamicDims: a bit per dynamic dim."""
        return [sum(1 << d for d in dims) for dims in self.dims]

    def entry_key(self, signature: CallSignature) -> str | None:
        """The cache key of this family's kernel for calls like ``signature``:
        its family key, then the digest of what the kernel fixes; None where a
        tensor with a dynamic dim is not contiguous."""
        tensors = tensor_args(signature)
        if len(tensors) != len(self.dims):
            return None
        if any(dims and not is_contiguous(t) for t, dims in zip(tensors, self.dims)):
            return None
        fixed = iter(self.dims)
        form = [str(signature.op._schema), [_form(d, fixed) for d in signature.described]]
        return f"{family_key(signature)}-{_digest(form)[:16]}"

    def symbol_values(self, signature: CallSignature) -> dict[int, int] | None:
        """Each symbol's size in ``signature``, or None where the guards do not admit it."""
        return self.symbol_values_of_sizes([t.sizes for t in tensor_args(signature)])

    def symbol_values_of_sizes(self, sizes: list[tuple[int, ...]]) -> dict[int, int] | None:
        """Each symbol's size for a call whose tensors have ``sizes``, or None where the guards do not admit it."""
        values: dict[int, int] = {}
        for tensor, dim, symbol, size in self.guards:
            if tensor >= len(sizes) or dim >= len(sizes[tensor]):
                return None
            actual = sizes[tensor][dim]
            if symbol < 0:
                if actual != size:
                    return None
            elif values.setdefault(symbol, actual) != actual or not self.ranges[symbol][0] <= actual <= self.ranges[symbol][1]:
                return None
        if any(math.prod(s) > MAX_NUMEL for s in sizes):
            return None
        return values

    def admits(self, signature: CallSignature, entry_key: str) -> bool:
        """Whether the kernel published under ``entry_key`` was compiled for ``signature``."""
        return self.entry_key(signature) == entry_key and self.symbol_values(signature) is not None

    def export_shapes(self, signature: CallSignature) -> tuple[Any, ...]:
        """``dynamic_shapes`` for exporting the call's kernel inputs (flat_tensor_inputs order)."""
        dims = iter(self.dims)
        return (tuple(
            {d: torch.export.Dim.DYNAMIC for d in next(dims)} or None if is_tensor else None
            for is_tensor in _flat_kinds(signature)
        ),)

    def with_guards(self, signature: CallSignature, exported_shapes: list[tuple[Any, ...]], ranges: dict[Any, Any]) -> "ShapeFamily":
        """This family with the guards of the exported program whose input
        shapes (flat_tensor_inputs order) are ``exported_shapes`` and whose
        range constraints are ``ranges``. Raises NotDynamic."""
        shapes = [shape for shape, d in zip(exported_shapes, _flat_kinds(signature)) if d]
        symbols: dict[Any, int] = {}
        guards = []
        for tensor, (dims, shape) in enumerate(zip(self.dims, shapes)):
            for dim in dims:
                size = shape[dim]
                if isinstance(size, int):
                    guards.append((tensor, dim, -1, size))
                elif isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    symbol = symbols.setdefault(size.node.expr, len(symbols))
                    guards.append((tensor, dim, symbol, 0))
                else:
                    raise NotDynamic(f"export gave dim {dim} of tensor {tensor} as {size}")
            if any(not isinstance(n, int) for d, n in enumerate(shape) if d not in dims):
                raise NotDynamic(f"export made a fixed dim of tensor {tensor} symbolic")
        bounds = []
        for symbol in symbols:
            vr = ranges.get(symbol)
            if vr is None:
                raise NotDynamic(f"no range for {symbol}")
            bounds.append((max(_bound(vr.lower), 0), _bound(vr.upper)))
        return replace(self, guards=tuple(guards), ranges=tuple(bounds))

    def resized(self, signature: CallSignature, values: dict[int, int]) -> CallSignature | None:
        """``signature``'s call with each symbol at ``values``' size (see :meth:`_with_sizes`)."""
        sizes = {(tensor, dim): values[symbol] for tensor, dim, symbol, _ in self.guards if symbol >= 0}
        return self._with_sizes(signature, sizes)

    def _with_sizes(self, signature: CallSignature, sizes: dict[tuple[int, int], int]) -> CallSignature | None:
        """``signature``'s call with dim ``dim`` of its tensor ``tensor`` at
        ``sizes[tensor, dim]``: new contiguous tensors where a dim is dynamic,
        with its alignment (random values, as
        :func:`~aoti_eager.kernels.examples.example_tensor` makes them); None
        for a call that cannot be rebuilt."""
        counter = iter(range(len(self.dims)))

        def rebuild(value: Any, described: Any) -> Any:
            if isinstance(described, TensorArg):
                index = next(counter)
                if not self.dims[index]:
                    return clone_exact(value)
                shape = [sizes.get((index, d), n) for d, n in enumerate(described.sizes)]
                strides = torch.empty(shape, device="meta").stride()
                return example_tensor(replace(described, sizes=tuple(shape), strides=strides), value.device)
            if isinstance(described, ListArg):
                return [rebuild(v, d) for v, d in zip(value, described.items)]
            return value

        try:
            args = [rebuild(v, d) for v, d in zip(signature.args, signature.described)]
            fresh = CallSignature.of(signature.op, signature.device.type, args)
        except Exception:  # noqa: BLE001 - a call that cannot be rebuilt is not checked
            return None
        # The tensors as they are now; every other argument as the kernel takes it.
        described = tuple(f if isinstance(f, (TensorArg, ListArg)) else d for f, d in zip(fresh.described, signature.described))
        return replace(signature, args=tuple(args), described=described)

    def size_span(self, signature: CallSignature, seen: list[list[tuple[int, ...]]]) -> list[list[int]]:
        """``[smallest, largest]`` size of each dynamic dim (``dims`` order,
        tensor by tensor) among ``signature`` and the ``seen`` calls of its
        family (each its tensors' sizes): what a manifest records of them.

        Example::

            >>> call = CallSignature.of(torch.ops.aten.add.Tensor, "cpu", [torch.randn(9, 8), torch.randn(8)])
            >>> ShapeFamily(dims=((0,), ())).size_span(call, [[(5, 8), (8,)], [(12, 8), (8,)]])
            [[5, 12]]
        """
        shapes = [*seen, [t.sizes for t in tensor_args(signature)]]
        return [
            [min(sizes[tensor][dim] for sizes in shapes), max(sizes[tensor][dim] for sizes in shapes)]
            for tensor, dims in enumerate(self.dims) for dim in dims
        ]

    def span_ends(self, signature: CallSignature, span: list[list[int]]) -> list[CallSignature]:
        """``signature``'s call with every dynamic dim at the smallest size of
        its ``span`` (as :meth:`size_span` gives it), then at the largest: calls
        of its family that moved those dims (an end at ``signature``'s own
        sizes is left out).

        Example::

            >>> call = CallSignature.of(torch.ops.aten.add.Tensor, "cpu", [torch.randn(9, 8), torch.randn(8)])
            >>> [[t.sizes for t in tensor_args(end)] for end in ShapeFamily(dims=((0,), ())).span_ends(call, [[5, 12]])]
            [[(5, 8), (8,)], [(12, 8), (8,)]]
        """
        own = tensor_args(signature)
        dims = [(tensor, dim) for tensor, tensor_dims in enumerate(self.dims) for dim in tensor_dims]
        ends = []
        for end in (0, 1):
            sizes = {(tensor, dim): bounds[end] for (tensor, dim), bounds in zip(dims, span)}
            if any(own[tensor].sizes[dim] != size for (tensor, dim), size in sizes.items()):
                rebuilt = self._with_sizes(signature, sizes)
                if rebuilt is not None:
                    ends.append(rebuilt)
        return ends

    def further_values(self, seen: list[dict[int, int]]) -> dict[int, int]:
        """Symbol sizes that none of the ``seen`` calls had, within the ranges."""
        values = {}
        for symbol, (low, high) in enumerate(self.ranges):
            taken = {v[symbol] for v in seen if symbol in v}
            candidate = max(taken | {low}) + 3
            values[symbol] = candidate if candidate <= high else low
        return values

    def to_json(self) -> dict[str, Any]:
        return {"dims": [list(d) for d in self.dims], "guards": [list(g) for g in self.guards],
                "ranges": [list(r) for r in self.ranges]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ShapeFamily":
        return cls(tuple(tuple(d) for d in data["dims"]), tuple(tuple(g) for g in data["guards"]),
                   tuple(tuple(r) for r in data["ranges"]))

    def short(self, signature: list[dict[str, Any]]) -> str:
        """``signature`` (as an entry keeps it) with this kernel's symbols for
        its dynamic sizes, e.g. ``self=float32[s0, 16], other=float32[16]; s0 in [2, inf]``."""
        names = {(tensor, dim): f"s{symbol}" for tensor, dim, symbol, _ in self.guards if symbol >= 0}
        tensors = itertools.count()

        def form(described: dict[str, Any]) -> str:
            if described["kind"] == "tensor":
                index = next(tensors)
                sizes = [names.get((index, dim), str(n)) for dim, n in enumerate(described["sizes"])]
                return f"{described['dtype']}[{', '.join(sizes)}]"
            if described["kind"] == "list":
                return "[" + ", ".join(form(item) for item in described["items"]) + "]"
            return argument_from_json(described).short()

        ranges = [f"s{i} in [{low}, {'inf' if high >= UNBOUNDED else high}]" for i, (low, high) in enumerate(self.ranges)]
        return "; ".join([", ".join(f"{d['name']}={form(d)}" for d in signature), *ranges])


def _bound(value: Any) -> int:
    """A range bound as an int; torch's infinities (``int_oo``) are unbounded."""
    try:
        return max(min(int(value), UNBOUNDED), -UNBOUNDED)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return UNBOUNDED if value > 0 else -UNBOUNDED


def _flat_kinds(signature: CallSignature) -> list[bool]:
    """For each kernel input (flat_tensor_inputs order): a tensor argument (True) or a runtime number."""
    kinds: list[bool] = []
    for described in signature.described:
        if isinstance(described, RuntimeNumberArg):
            kinds.append(False)
        else:
            kinds.extend(True for _ in _tensors_in(described))
    return kinds
