"""Op names to OpOverloads, and which overloads can be overridden safely."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Union

import torch
from torch._ops import OpOverload, OpOverloadPacket

from aoti_eager.kernels.compile import per_item_overload
from aoti_eager.kernels.inductor import shims
from aoti_eager.kernels.signature import qualified_name

OpSpec = Union[str, OpOverload, OpOverloadPacket]


@dataclass(frozen=True)
class Resolved:
    """The overloads one op spec names; ``packet`` if it named all of them."""

    spec: str
    overloads: tuple[OpOverload, ...]
    packet: bool


def resolve(spec: OpSpec) -> Resolved:
    """Resolves every op-name form users write.

    >>> resolve("aten::add.Tensor").overloads
    (<OpOverload(op='aten.add', overload='Tensor')>,)
    >>> resolve("add").packet
    True
    """
    if isinstance(spec, OpOverload):
        return Resolved(qualified_name(spec), (spec,), packet=False)
    if isinstance(spec, OpOverloadPacket):
        return Resolved(str(spec), dispatcher_overloads(spec), packet=True)
    if not isinstance(spec, str):
        raise TypeError(f"aoti_eager: an op is a name like 'aten::add.Tensor', an OpOverload or an OpOverloadPacket, not {spec!r}")
    namespace, _, name = spec.rpartition("::")
    namespace = namespace or "aten"
    base, _, overload = name.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), base)
    except (AttributeError, RuntimeError):
        raise ValueError(f"aoti_eager: no op named {spec!r} (looked for {namespace}::{base})") from None
    if not isinstance(packet, OpOverloadPacket):
        raise ValueError(f"aoti_eager: {spec!r} is not an op")
    if overload:
        if overload not in packet.overloads() or not _in_dispatcher(getattr(packet, overload)):
            raise ValueError(
                f"aoti_eager: {namespace}::{base} has no overload {overload!r}; it has {', '.join(packet.overloads())}"
            )
        return Resolved(spec, (getattr(packet, overload),), packet=False)
    return Resolved(spec, dispatcher_overloads(packet), packet=True)


def overload_named(name: str) -> OpOverload:
    """The overload :func:`qualified_name` named: ``aten::abs`` is ``abs.default``."""
    if "." not in name.rpartition("::")[2]:
        name += ".default"
    return resolve(name).overloads[0]


def _in_dispatcher(op: OpOverload) -> bool:
    try:
        torch._C._dispatch_find_schema_or_throw(op._schema.name, op._schema.overload_name)
    except RuntimeError:
        return False
    return True


def dispatcher_overloads(packet: OpOverloadPacket) -> tuple[OpOverload, ...]:
    """The packet's overloads that the dispatcher serves (not TorchScript's
    builtins such as ``add.int`` or ``copy_.Tensor``, which tensors never reach)."""
    overloads = (getattr(packet, o) for o in packet.overloads())
    return tuple(op for op in overloads if _in_dispatcher(op))


# The dispatch key each device type's kernels are overridden at.
DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

# Ops that return views of their input although their schemas carry no alias
# annotation (autograd and functionalization know them by name too).
_UNANNOTATED_VIEWS = {"aten::_unsafe_view", "aten::unsafe_split", "aten::unsafe_split_with_sizes", "aten::unsafe_chunk"}


# Their outputs are uninitialized memory: a kernel would only allocate, as eager
# does, and no check against eager's values could pass or mean anything.
_UNINITIALIZED = {
    "aten::empty", "aten::empty_like", "aten::empty_permuted", "aten::empty_strided",
    "aten::new_empty", "aten::new_empty_strided",
}


def refusal(op: OpOverload) -> str | None:
    """Why ``op`` cannot be overridden safely, or None if it can."""
    schema = op._schema
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) or schema.name in _UNANNOTATED_VIEWS:
        return "it is a view or aliasing op (its output shares storage with an input)"
    if schema.name in _UNINITIALIZED:
        return "it returns uninitialized memory (nothing to compute; eager allocates it as fast)"
    if torch.Tag.inplace_view in op.tags:
        return "it changes its input's shape or strides in place (AOTInductor cannot compile that)"
    if torch.Tag.nondeterministic_seeded in op.tags:
        return "it is a random op (tagged nondeterministic_seeded)"
    if torch.Tag.dynamic_output_shape in op.tags or torch.Tag.data_dependent_output in op.tags:
        return "its output shape or value depends on the input data"
    for r in schema.returns:
        if not isinstance(r.type, (torch.TensorType, torch.ListType)) or (
            isinstance(r.type, torch.ListType) and not isinstance(r.type.getElementType(), torch.TensorType)
        ):
            return f"it returns a non-tensor value ({r.type})"
    if decomposes(op):
        return "it is a composite op that decomposes into other aten ops before reaching a device kernel; enable those ops instead"
    if shims.proxy_only(per_item_overload(op) or op):  # what a kernel of the op traces
        return f"AOTInductor has no C shim for {qualified_name(op)}: a kernel would only call the eager op through its proxy executor"
    return None


def selected(ops: Iterable[OpSpec] | OpSpec) -> list[OpOverload]:
    """The overloads ``ops`` names that can be overridden. Raises ValueError
    for one named on its own that cannot, and for a packet none of whose
    overloads can; warns of the rest of a packet's, left to eager."""
    if isinstance(ops, (str, OpOverload, OpOverloadPacket)):
        ops = [ops]
    chosen: list[OpOverload] = []
    skipped: list[str] = []
    for spec in ops:
        resolved = resolve(spec)
        for op in resolved.overloads:
            reason = refusal(op)
            if reason is None:
                chosen.append(op)
            elif resolved.packet:
                skipped.append(f"{qualified_name(op)} ({reason})")
            else:
                raise ValueError(f"aoti_eager: cannot override {qualified_name(op)}: {reason}")
        if resolved.packet and not any(op in chosen for op in resolved.overloads):
            raise ValueError(f"aoti_eager: no overload of {resolved.spec} can be overridden: {'; '.join(skipped)}")
    if skipped:
        # At the caller of enable() or fuse(), whose arguments named them.
        warnings.warn("aoti_eager: left these overloads to eager: " + "; ".join(skipped), stacklevel=3)
    return chosen


def decomposes(op: OpOverload, dispatch_keys: tuple[str, ...] = ("CPU", "CUDA")) -> bool:
    """Whether ``op`` runs its CompositeImplicitAutograd decomposition at
    ``dispatch_keys``: it has no kernel of its own there, and its calls reach
    the device kernels as other aten ops."""
    name = op.name()
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd") and not any(
        torch._C._dispatch_has_kernel_for_dispatch_key(name, k)
        for k in (*dispatch_keys, "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")
    )
