"""Dynamic-shape kernels: one kernel for every size of the dims that move.

Calls of one op that differ only in tensor sizes and strides are one *shape
family* (:func:`family_key`: the same op, dtypes, devices, ranks, order of
dims in memory (:func:`layout_order`), alignment and other arguments). The
first shape of a family compiles a static kernel. When a second shape
arrives, the dims that changed are compiled as symbols (``torch.export`` with
``Dim.AUTO``: a dim the op fixes, as ``layer_norm``'s normalized dims, stays
fixed) into one kernel that serves every later shape its guards admit. A
shape that kernel does not admit widens it, once: a *general* kernel, every
dim a symbol and every stride but the innermost read at run time, serves the
family's every shape its guards admit (a model's linear layers of every
width, a slice of a batch and the batch itself).

A dynamic kernel's guards are what the exported program says of its inputs
(:class:`ShapeFamily`): each dynamic dim is a symbol within its range, dims of
one symbol are equal (``mm``'s inner dims, ``add``'s broadcast dims), a dim
export specialized stays that size, and each stride of a tensor with a
dynamic dim is the product of sizes export derived it from, or is read at run
time in the order the kernel was compiled for; every tensor has fewer than
2**31 elements. Sizes 0 and 1 are traced size-obliviously (the kernel's code
does not branch on them) and admitted from 1 up where a check at 1 agreed with
eager. The C++ hit path (``ShapeGuards::admit`` in csrc/call_key.cpp) and
:meth:`ShapeFamily.admits` check the same: a call is never run by a kernel
that was not compiled for it.

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
from torch.utils import _pytree as pytree

from aoti_eager.kernels.compile import call_op
from aoti_eager.kernels.examples import example_tensor
from aoti_eager.kernels.matmul import fixed_dims
from aoti_eager.kernels.signature import (
    CallSignature, ListArg, TensorArg, argument_from_json, clone_exact, kernel_inputs, tensor_args, _digest, _key_form,
    _without_number_value,
)

# Kernels index their tensors with 32-bit math up to this many elements
# (ShapeGuards::kMaxNumel in csrc/call_key.h).
MAX_NUMEL = 2**31 - 1
# An unbounded symbol's max, as C++ reads it.
UNBOUNDED = 2**63 - 1


class NotDynamic(Exception):
    """The exported program does not give the dims as plain symbols."""


def layout_order(sizes: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...]:
    """The dims outermost first: those that step through memory (size above 1,
    stride above 0) by stride, largest first; each other dim (its index is
    always 0, or it repeats) just before the first stepping dim of a greater
    index. A contiguous tensor's order is its dims', and so is a batch
    expanded from one row's, or a slice of a batch.

        >>> layout_order((4, 8), (8, 1)), layout_order((4, 8), (0, 1)), layout_order((8, 4), (1, 8))
        ((0, 1), (0, 1), (1, 0))
    """
    stepping = sorted((d for d, (n, s) in enumerate(zip(sizes, strides)) if n != 1 and s != 0), key=lambda d: (-strides[d], d))
    order: list[int] = []
    for other in sorted(set(range(len(sizes))) - set(stepping)):
        while stepping and stepping[0] < other:
            order.append(stepping.pop(0))
        order.append(other)
    return tuple(order + stepping)


def _form(described: Any, dims: Iterator[tuple[int, ...]] | None, numbers: bool = True) -> Any:
    """One argument as a family key hashes it: a tensor by its dtype, device,
    rank, layout order and alignment, and its sizes and strides where ``dims``
    does not make them dynamic; None for all sizes. Without ``numbers``, a
    number without its value."""
    if isinstance(described, TensorArg):
        dynamic = set(next(dims, ())) if dims is not None else None
        form = {"kind": "tensor", "dtype": described.dtype, "device": described.device, "rank": len(described.sizes),
                "order": list(layout_order(described.sizes, described.strides)), "aligned": described.aligned}
        if dynamic is not None:
            form["sizes"] = [None if d in dynamic else n for d, n in enumerate(described.sizes)]
            if not dynamic:
                form["strides"] = list(described.strides)
        return form
    if isinstance(described, ListArg):
        return {"kind": "list", "items": [_form(item, dims, numbers) for item in described.items]}
    return _key_form(described) if numbers else _without_number_value(described)


def family_key(signature: CallSignature) -> str:
    """What calls of one shape family share: everything but tensor sizes and
    strides (of these, only the order of dims in memory), and the sizes its
    kernels compile in (kernels/matmul.py)."""
    return _digest([str(signature.op._schema), [_form(d, None) for d in signature.described], *_fixed_sizes(signature)])


def _fixed_sizes(signature: CallSignature) -> list[list[list[int]]]:
    """The sizes ``signature``'s kernels compile in (kernels/matmul.py), as
    ``[tensor, dim, size]`` in a list of its own; no list where there are none."""
    fixed = fixed_dims(signature)
    tensors = tensor_args(signature)
    return [sorted([i, d, tensors[i].sizes[d]] for i, d in fixed)] if fixed else []


def family_limit_key(signature: CallSignature) -> str:
    """The cache key of the verdict that the family of ``signature`` compiles
    no more: every further shape of it runs eagerly."""
    return f"{family_key(signature)}-limit"


def ints_key(signature: CallSignature) -> str:
    """:func:`family_key` without the values of numbers: calls whose ints
    move together with their sizes share it (the ``n`` of the pad ``[0, n]``
    that aligns an attention mask of any length), so that a process sees
    them move.

        >>> pad = lambda length, n: CallSignature.of(torch.ops.aten.constant_pad_nd.default, "cpu", [torch.ones(2, length), [0, n], 0])
        >>> ints_key(pad(13, 3)) == ints_key(pad(9, 7)), family_key(pad(13, 3)) == family_key(pad(9, 7))
        (True, False)
    """
    return _digest([str(signature.op._schema), [_form(d, None, numbers=False) for d in signature.described]])


def kinds_key(signature: CallSignature) -> str:
    """The op and each tensor argument's dtype and rank, and the sizes its
    kernels compile in: what calls of several shape families share, whose
    kernels may be alike (a model's embeddings with and without
    ``padding_idx``, a tensor and its slice)."""
    return _digest([str(signature.op._schema), [[t.dtype, len(t.sizes)] for t in tensor_args(signature)], *_fixed_sizes(signature)])


def tensor_sizes(signature: list[dict[str, Any]]) -> list[tuple[int, ...]]:
    """The sizes of the tensor arguments of ``signature`` as an entry keeps it
    (``CallSignature.to_json``), in :func:`tensor_args` order."""
    sizes: list[tuple[int, ...]] = []
    for described in signature:
        if described.get("kind") == "list":
            sizes += tensor_sizes(described["items"])
        elif described.get("kind") == "tensor":
            sizes.append(tuple(described["sizes"]))
    return sizes


def changed_dims(signature: CallSignature, seen: list[list[tuple[int, ...]]]) -> tuple[tuple[int, ...], ...]:
    """For each tensor argument, the dims whose size differs from one of the
    ``seen`` calls of its family (each a list of its tensors' sizes) and is at
    least 2 here: export specializes 0 and 1."""
    return _movable(signature, changed_sizes([t.sizes for t in tensor_args(signature)], seen))


def _movable(signature: CallSignature, dims: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """``dims`` without those ``signature``'s kernels compile in (kernels/matmul.py)."""
    fixed = fixed_dims(signature)
    return tuple(tuple(d for d in ds if (i, d) not in fixed) for i, ds in enumerate(dims))


def changed_sizes(mine: list[tuple[int, ...]], seen: list[list[tuple[int, ...]]]) -> tuple[tuple[int, ...], ...]:
    """:func:`changed_dims` of a call whose tensors have the sizes ``mine``.

        >>> changed_sizes([(9, 8), (1,)], [[(5, 8), (8,)]])
        ((0,), ())
    """
    changed: list[set[int]] = [set() for _ in mine]
    for sizes in seen:
        for i, (a, other) in enumerate(zip(mine, sizes)):
            changed[i].update(d for d, (n, m) in enumerate(zip(a, other)) if n != m and n >= 2)
    return tuple(tuple(sorted(c)) for c in changed)


def grew_from_one(signature: CallSignature, seen: list[list[tuple[int, ...]]]) -> bool:
    """Whether a dim of size 1 in one of the ``seen`` calls has a size of 2 or
    more here: a broadcast dim that now meets its partner, which may not move.

        >>> grew_from_one(CallSignature.of(torch.ops.aten.add.Tensor, "cpu", [torch.randn(4, 8), torch.randn(4, 8)]), [[(4, 8), (1, 8)]])
        True
    """
    mine = [t.sizes for t in tensor_args(signature)]
    return any(m == 1 and n >= 2 for sizes in seen for a, b in zip(mine, sizes) for n, m in zip(a, b))


# An entry's "dynamic" JSON of another format is not read: its guards meant something else.
FORMAT = 2

# ``(tensor, dim, scale, factors)``: the stride of a dim is ``scale`` times the
# sizes of ``factors``, each a ``(tensor, dim)``.
StrideRule = tuple[int, int, int, tuple[tuple[int, int], ...]]


@dataclass(frozen=True)
class ShapeFamily:
    """The dims a kernel takes at any size, and its guards.

    ``dims``: for each tensor argument (:func:`tensor_args` order), its
    dynamic dims. ``guards``: ``(tensor, dim, symbol, size)`` for each dynamic
    dim, with ``symbol`` an index into ``ranges``, or -1 where export
    specialized the dim to ``size``. ``ranges``: ``(min, max)`` of each symbol.
    ``strides``: a :data:`StrideRule` for each stride of a tensor with a
    dynamic dim that export derived from sizes (or fixed); a dim of size 1
    passes any. ``orders``: ``(tensor, dims)`` for each tensor with strides
    the kernel reads at run time: its stepping dims must come in the order of
    ``dims``, outermost first, as in the tensor it was compiled for.
    ``general``: compiled with every dim a symbol and every stride but the
    innermost read at run time (see :meth:`example`).
    """

    dims: tuple[tuple[int, ...], ...]
    guards: tuple[tuple[int, int, int, int], ...] = ()
    ranges: tuple[tuple[int, int], ...] = ()
    strides: tuple[StrideRule, ...] = ()
    orders: tuple[tuple[int, tuple[int, ...]], ...] = ()
    general: bool = False

    @classmethod
    def any_shape(cls, signature: CallSignature) -> "ShapeFamily":
        """Every dim of every tensor dynamic but those its family fixes,
        unguarded: the whole family of ``signature``, for a decision that
        holds for all of it."""
        return cls(_movable(signature, tuple(tuple(range(len(t.sizes))) for t in tensor_args(signature))))

    @classmethod
    def general_for(cls, signature: CallSignature) -> "ShapeFamily":
        """The general kernel for calls like ``signature`` (not yet compiled):
        every dim dynamic but those its kernels compile in and a dim of size 1
        that broadcasts (tried on meta tensors): the op refuses it at 2, or
        gives the same shapes at 2. A kernel traced with it at 2 would add
        elementwise where the call broadcasts, and its guards refuse the call
        (BERT's embeddings: each such add cost a second compile, on the
        critical path of its first forward's background compiles)."""
        tensors = tensor_args(signature)
        ones = [(i, d) for i, t in enumerate(tensors) for d, n in enumerate(t.sizes) if n == 1]
        kept = set(ones)
        if ones and (shapes := _shapes_on_meta(signature, {})) is not None:
            kept = {one for one in ones if _shapes_on_meta(signature, {one: 2}) in (None, shapes)}
        dims = tuple(tuple(d for d in range(len(t.sizes)) if (i, d) not in kept) for i, t in enumerate(tensors))
        movable = _movable(signature, dims)
        # With sizes compiled in, strides are the call's too: no padded example.
        return cls(movable, general=movable == dims)

    @property
    def dim_bits(self) -> list[int]:
        """``dims`` as csrc/call_key.h's DynamicDims: a bit per dynamic dim."""
        return [sum(1 << d for d in dims) for dims in self.dims]

    def entry_key(self, signature: CallSignature) -> str | None:
        """The cache key of this family's kernel for calls like ``signature``:
        its family key, then the digest of what the kernel fixes; None where
        the call has another number of tensors."""
        if len(tensor_args(signature)) != len(self.dims):
            return None
        fixed = iter(self.dims)
        form = [str(signature.op._schema), [_form(d, fixed) for d in signature.described], self.general]
        return f"{family_key(signature)}-{_digest(form)[:16]}"

    def symbol_values(self, signature: CallSignature) -> dict[int, int] | None:
        """Each symbol's size in ``signature``, or None where the guards do not admit it."""
        tensors = tensor_args(signature)
        if not self.layout_admitted(tensors):
            return None
        return self.symbol_values_of_sizes([t.sizes for t in tensors])

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

    def size_range(self, sizes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """The range of sizes that a call whose tensors have ``sizes`` (which
        the guards admit) falls in: each symbol's power of two (its size's bit
        length), as ``ShapeGuards::admit`` in csrc/call_key.cpp ranges them. A
        kernel is judged against eager once per range.

            >>> ShapeFamily(((0,), ()), guards=((0, 0, 0, 0),), ranges=((1, UNBOUNDED),)).size_range([(300, 8), (8,)])
            (9,)
        """
        values = self.symbol_values_of_sizes(sizes) or {}
        return tuple(values.get(symbol, 0).bit_length() for symbol in range(len(self.ranges)))

    def layout_admitted(self, tensors: list[TensorArg]) -> bool:
        """Whether ``tensors`` (:func:`tensor_args`) have the strides the kernel takes."""
        for tensor, dim, scale, factors in self.strides:
            t = tensors[tensor]
            if t.sizes[dim] != 1 and t.strides[dim] != scale * math.prod(tensors[f].sizes[d] for f, d in factors):
                return False
        for tensor, order in self.orders:
            t = tensors[tensor]
            stepping = [t.strides[d] for d in order if t.sizes[d] != 1 and t.strides[d] != 0]
            if any(outer <= inner for outer, inner in zip(stepping, stepping[1:])):
                return False
        return True

    def admits(self, signature: CallSignature, entry_key: str) -> bool:
        """Whether the kernel published under ``entry_key`` was compiled for ``signature``."""
        return self.entry_key(signature) == entry_key and self.symbol_values(signature) is not None

    def export_shapes(self, signature: CallSignature) -> tuple[Any, ...]:
        """``dynamic_shapes`` for exporting the call's kernel inputs
        (flat_tensor_inputs order). A dim of size 1 there stays 1: traced
        size-obliviously, a symbol would not broadcast."""
        dims, tensors = iter(self.dims), iter(tensor_args(signature))

        def shape() -> dict[int, Any] | None:
            sizes = next(tensors).sizes
            return {d: torch.export.Dim.AUTO for d in next(dims) if sizes[d] > 1} or None

        return (tuple(shape() if is_tensor else None for is_tensor in _flat_kinds(signature)),)

    def example(self, signature: CallSignature) -> CallSignature | None:
        """The call a kernel of this family is exported from: ``signature``'s;
        for a general kernel, its tensors with each dynamic dim of size 1 at
        2 (export would fix a 1) and their values broadcast in, and every
        tensor the op does not write padded after each step of every dim but
        the innermost, so that export reads those strides at run time. None
        where a tensor is empty."""
        if not self.general:
            return signature
        written = {i for i, a in enumerate(signature.op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
        grown = [tuple(2 if n == 1 and d in dims else n for d, n in enumerate(t.sizes)) for t, dims in zip(tensor_args(signature), self.dims)]
        taken = {n for sizes in grown for n in sizes}
        counter = itertools.count()

        def rebuild(value: Any, described: Any, write: bool) -> Any:
            if isinstance(described, TensorArg):
                sizes = grown[next(counter)]
                order = layout_order(described.sizes, described.strides)
                strides = _strides_for(sizes, order, {}, pad=not write, taken=taken)
                tensor = example_tensor(replace(described, sizes=sizes, strides=strides), value.device)
                with torch.no_grad():
                    tensor.copy_(value.expand(sizes))
                return tensor
            if isinstance(described, ListArg):
                return [rebuild(v, d, write) for v, d in zip(value, described.items)]
            return value

        if any(0 in t.sizes for t in tensor_args(signature)):
            return None
        args = [rebuild(v, d, i in written) for i, (v, d) in enumerate(zip(signature.args, signature.described))]
        return _rebuilt(signature, args)

    def with_guards(
        self, signature: CallSignature, exported_shapes: list[tuple[Any, ...]], exported_strides: list[tuple[Any, ...]],
        ranges: dict[Any, Any],
    ) -> "ShapeFamily":
        """This family with the guards of the program exported from
        ``signature`` (:meth:`example`) whose input shapes and strides
        (flat_tensor_inputs order) are ``exported_shapes`` and
        ``exported_strides`` and whose range constraints are ``ranges``.
        Raises NotDynamic."""
        kinds = _flat_kinds(signature)
        shapes = [shape for shape, d in zip(exported_shapes, kinds) if d]
        all_strides = [strides for strides, d in zip(exported_strides, kinds) if d]
        return self.with_tensor_guards(tensor_args(signature), shapes, all_strides, ranges)

    def with_tensor_guards(
        self, tensors: list[TensorArg], shapes: list[tuple[Any, ...]], all_strides: list[tuple[Any, ...]], ranges: dict[Any, Any],
    ) -> "ShapeFamily":
        """:meth:`with_guards` of a program whose tensor inputs, described by
        ``tensors`` (as called), were exported with ``shapes`` and
        ``all_strides``: a caller with inputs other than an op's (a region)
        gives its own. Raises NotDynamic."""
        symbols: dict[Any, int] = {}
        where: dict[Any, tuple[int, int]] = {}  # a symbol -> a dim of its size
        guards = []
        for tensor, (dims, shape) in enumerate(zip(self.dims, shapes)):
            for dim in dims:
                size = shape[dim]
                if isinstance(size, torch.SymInt) and size.node.expr.is_number:
                    size = int(size.node.expr)  # export fixed it (Dim.AUTO): a list of ints compiled in
                if isinstance(size, int):
                    guards.append((tensor, dim, -1, size))
                elif isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    symbol = symbols.setdefault(size.node.expr, len(symbols))
                    where.setdefault(size.node.expr, (tensor, dim))
                    guards.append((tensor, dim, symbol, 0))
                else:
                    raise NotDynamic(f"export gave dim {dim} of tensor {tensor} as {size}")
            if any(not isinstance(n, int) for d, n in enumerate(shape) if d not in dims):
                raise NotDynamic(f"export made a fixed dim of tensor {tensor} symbolic")
        rules, orders, read = [], [], set()
        for tensor, (dims, strides, described) in enumerate(zip(self.dims, all_strides, tensors)):
            if not dims:
                continue  # its strides are in the key
            free = False
            for dim, stride in enumerate(strides):
                rule = _stride_rule(stride, where)
                if rule is not None:
                    rules.append((tensor, dim, *rule))
                elif stride.node.expr in read:
                    raise NotDynamic(f"export gave two inputs one stride ({stride})")
                else:
                    read.add(stride.node.expr)
                    free = True
            if free:
                orders.append((tensor, layout_order(described.sizes, described.strides)))
        bounds = []
        for symbol in symbols:
            vr = ranges.get(symbol)
            if vr is None:
                raise NotDynamic(f"no range for {symbol}")
            bounds.append((max(_bound(vr.lower), 0), _bound(vr.upper)))
        return replace(self, guards=tuple(guards), ranges=tuple(bounds), strides=tuple(rules), orders=tuple(orders))

    def from_size(self, lows: list[int]) -> "ShapeFamily":
        """This family with each symbol admitted from ``lows``' size up."""
        return replace(self, ranges=tuple((max(low, old), high) for low, (old, high) in zip(lows, self.ranges)))

    def resized(self, signature: CallSignature, values: dict[int, int]) -> CallSignature | None:
        """``signature``'s call with each symbol at ``values``' size (see :meth:`_with_sizes`)."""
        sizes = {(tensor, dim): values[symbol] for tensor, dim, symbol, _ in self.guards if symbol >= 0}
        return self._with_sizes(signature, sizes)

    def _with_sizes(self, signature: CallSignature, sizes: dict[tuple[int, int], int]) -> CallSignature | None:
        """``signature``'s call with dim ``dim`` of its tensor ``tensor`` at
        ``sizes[tensor, dim]``: new tensors where a dim is dynamic, with the
        strides the kernel takes (before export: the call's order, broadcast
        dims and padding), and its alignment (random values, as
        :func:`~aoti_eager.kernels.examples.example_tensor` makes them); None
        for a call that cannot be rebuilt."""
        shapes = self.shapes_with(tensor_args(signature), sizes)
        counter = iter(range(len(self.dims)))

        def rebuild(value: Any, described: Any) -> Any:
            if isinstance(described, TensorArg):
                return self.resized_tensor(next(counter), value, described, shapes)
            if isinstance(described, ListArg):
                return [rebuild(v, d) for v, d in zip(value, described.items)]
            return value

        try:
            return _rebuilt(signature, [rebuild(v, d) for v, d in zip(signature.args, signature.described)])
        except Exception:  # noqa: BLE001 - a call that cannot be rebuilt is not checked
            return None

    @staticmethod
    def shapes_with(tensors: list[TensorArg], sizes: dict[tuple[int, int], int]) -> list[tuple[int, ...]]:
        """The sizes of ``tensors`` with dim ``dim`` of tensor ``tensor`` at ``sizes[tensor, dim]``."""
        return [tuple(sizes.get((i, d), n) for d, n in enumerate(t.sizes)) for i, t in enumerate(tensors)]

    def resized_tensor(self, index: int, value: torch.Tensor, described: TensorArg, shapes: list[tuple[int, ...]]) -> torch.Tensor:
        """The tensor argument ``index`` (``value``, described as ``described``)
        at ``shapes[index]`` (see :meth:`_with_sizes`); a copy where its dims do not move."""
        if not self.dims[index]:
            return clone_exact(value)
        order = layout_order(described.sizes, described.strides)
        if self.strides or self.orders:
            rules = {dim: scale * math.prod(shapes[t][d] for t, d in factors)
                     for tensor, dim, scale, factors in self.strides if tensor == index}
            strides = _strides_for(shapes[index], order, rules, pad=True)
        else:  # before export: as the call has them
            rules = {d: 0 for d, (n, s) in enumerate(zip(described.sizes, described.strides)) if n != 1 and s == 0}
            dense = _strides_for(described.sizes, order, rules, pad=False)
            padded = any(n != 1 and s != d for n, s, d in zip(described.sizes, described.strides, dense))
            strides = _strides_for(shapes[index], order, rules, pad=padded)
        tensor = example_tensor(replace(described, sizes=shapes[index], strides=strides), value.device)
        if not (tensor.is_floating_point() or tensor.is_complex()) and value.numel() and tensor.numel():
            # Its own values, over and over: indices stay in their tables' range.
            with torch.no_grad():
                flat = value.reshape(-1)
                tensor.copy_(flat[torch.arange(tensor.numel(), device=flat.device) % flat.numel()].view(tensor.shape))
        return tensor

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
        return {"format": FORMAT, "dims": [list(d) for d in self.dims], "guards": [list(g) for g in self.guards],
                "ranges": [list(r) for r in self.ranges],
                "strides": [[t, d, scale, [list(f) for f in factors]] for t, d, scale, factors in self.strides],
                "orders": [[t, list(order)] for t, order in self.orders], "general": self.general}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ShapeFamily":
        """The family ``to_json`` gave. Raises NotDynamic for another format."""
        if data.get("format") != FORMAT:
            raise NotDynamic(f"a dynamic entry of format {data.get('format')}, not {FORMAT}")
        return cls(
            tuple(tuple(d) for d in data["dims"]), tuple(tuple(g) for g in data["guards"]), tuple(tuple(r) for r in data["ranges"]),
            tuple((t, d, scale, tuple(tuple(f) for f in factors)) for t, d, scale, factors in data["strides"]),
            tuple((t, tuple(order)) for t, order in data["orders"]), data["general"],
        )

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


def _strides_for(
    sizes: tuple[int, ...], order: tuple[int, ...], rules: dict[int, int], pad: bool, taken: set[int] | None = None
) -> tuple[int, ...]:
    """Strides that lay ``sizes`` out in ``order`` (outermost first), each
    dim's from ``rules`` where it has one, the others dense after the dims
    inside them; with ``pad``, some padding after each step of every dim but
    the innermost (export then reads the stride at run time), at least one
    element and enough that the stride is none of ``taken`` (export would
    take two inputs' equal strides, or a stride equal to a size, for one
    symbol), which receives it.

        >>> _strides_for((4, 8), (0, 1), {}, pad=False), _strides_for((4, 8), (0, 1), {0: 0}, pad=False), _strides_for((4, 8), (0, 1), {}, pad=True)
        ((8, 1), (0, 1), (9, 1))
    """
    strides = [0] * len(sizes)
    step = 1
    for i, d in enumerate(reversed(order)):
        stride = rules.get(d, step)
        if pad and i and d not in rules:
            stride += 1
            while taken is not None and stride in taken:
                stride += 1
            if taken is not None:
                taken.add(stride)
        strides[d] = stride
        step = max(step, stride * max(sizes[d], 1))
    return tuple(strides)


def _stride_rule(stride: Any, where: dict[Any, tuple[int, int]]) -> tuple[int, tuple[tuple[int, int], ...]] | None:
    """An exported input's stride as ``(scale, factors)`` (see
    :data:`StrideRule`); None for a stride the kernel reads at run time (a
    symbol of its own). Raises NotDynamic for any other expression."""
    if isinstance(stride, int):
        return stride, ()
    expr = stride.node.expr
    if isinstance(expr, sympy.Symbol) and expr not in where:
        return None
    scale, rest = expr.as_coeff_Mul()
    factors: list[tuple[int, int]] = []
    for factor in sympy.Mul.make_args(rest):
        if factor == 1:
            continue
        base, exponent = factor.as_base_exp()
        if base not in where or not exponent.is_Integer or exponent < 1:
            raise NotDynamic(f"export gave a stride as {expr}")
        factors += [where[base]] * int(exponent)
    if not scale.is_Integer:
        raise NotDynamic(f"export gave a stride as {expr}")
    return int(scale), tuple(factors)


def _shapes_on_meta(signature: CallSignature, sizes: dict[tuple[int, int], int]) -> list[tuple[int, ...]] | None:
    """The shapes of the tensors the op returns for ``signature``'s call on
    meta tensors, with dim ``dim`` of its tensor ``tensor`` at
    ``sizes[tensor, dim]``; None where the op refuses the call."""
    tensors = itertools.count()

    def meta(value: Any, described: Any) -> Any:
        if isinstance(described, TensorArg):
            i = next(tensors)
            shape = [sizes.get((i, d), n) for d, n in enumerate(described.sizes)]
            return torch.empty(shape, dtype=getattr(torch, described.dtype), device="meta")
        if isinstance(described, ListArg):
            return [meta(v, d) for v, d in zip(value, described.items)]
        return value

    try:
        result = call_op(signature.op, [meta(v, d) for v, d in zip(signature.args, signature.described)])
    except Exception:  # noqa: BLE001 - the op refuses these sizes, or meta tensors
        return None
    return [tuple(t.shape) for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]


def _rebuilt(signature: CallSignature, args: list[Any]) -> CallSignature:
    """``signature`` with ``args``: its tensors described as they are now, every
    other argument as the kernel takes it (a runtime number stays one)."""
    fresh = CallSignature.of(signature.op, signature.device.type, args)

    def merged(now: Any, kept: Any) -> Any:
        if isinstance(now, ListArg):
            return ListArg(tuple(map(merged, now.items, kept.items)))
        return now if isinstance(now, TensorArg) else kept

    return replace(signature, args=tuple(args), described=tuple(map(merged, fresh.described, signature.described)))


def _bound(value: Any) -> int:
    """A range bound as an int; torch's infinities (``int_oo``) are unbounded."""
    try:
        return max(min(int(value), UNBOUNDED), -UNBOUNDED)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return UNBOUNDED if value > 0 else -UNBOUNDED


def _flat_kinds(signature: CallSignature) -> list[bool]:
    """For each kernel input (flat_tensor_inputs order): a tensor argument (True) or a runtime number."""
    return [isinstance(d, TensorArg) for _, d in kernel_inputs(signature.args, signature.described)]
