"""Example arguments for a recorded signature.

A signature (:meth:`CallSignature.to_json`) says everything a kernel depends
on, so a call with the same signature can be rebuilt from it alone: tensors of
the recorded dtype, sizes and strides filled with random values, and every
other argument by its recorded value. Calling the op with these arguments
misses exactly the cache entry the recorded call missed.
"""

from __future__ import annotations

from typing import Any

import torch

from aoti_eager.kernels.signature import (
    ALIGNMENT,
    Arg,
    ListArg,
    NoneArg,
    RuntimeNumberArg,
    TensorArg,
    Unsupported,
    argument_from_json,
)


def example_tensor(described: TensorArg, device: torch.device) -> torch.Tensor:
    """A tensor with ``described``'s dtype, sizes, strides and alignment.

    Example::

        >>> t = example_tensor(TensorArg("float32", "cpu", (2, 3), (1, 2), aligned=True), torch.device("cpu"))
        >>> t.shape, t.stride()
        (torch.Size([2, 3]), (1, 2))
    """
    dtype = getattr(torch, described.dtype)
    sizes, strides = described.sizes, described.strides
    # A storage offset of one element is the simplest way to be misaligned;
    # the signature records alignment, not the offset.
    offset = 0 if described.aligned else 1
    if offset and dtype.itemsize % ALIGNMENT == 0:
        raise Unsupported(f"a misaligned {dtype} tensor cannot be rebuilt")
    extent = 1 + sum((n - 1) * s for n, s in zip(sizes, strides)) if all(sizes) else 0
    storage = torch.empty(offset + extent, dtype=dtype, device=device)
    if dtype.is_floating_point or dtype.is_complex:
        storage.normal_()
    elif dtype == torch.bool:
        storage.random_(0, 2)
    else:
        storage.random_(0, 8)  # small values: valid indices, shifts and divisors for most ops
    return storage.as_strided(sizes, strides, offset)


def example_value(described: Arg, device: torch.device) -> Any:
    """One argument as the user passes it: a Python number where the dispatcher
    received a wrapped number, so that the call is keyed like the recorded one."""
    if isinstance(described, TensorArg):
        return example_tensor(described, device)
    if isinstance(described, ListArg):
        return [example_value(item, device) for item in described.items]
    if isinstance(described, NoneArg):
        return None
    if isinstance(described, RuntimeNumberArg):
        return described.number.value
    return described.value  # a number or another constant


def example_arguments(signature: list[dict[str, Any]], device: torch.device) -> list[Any]:
    """The arguments, in schema order, of a call with the recorded ``signature``.

    Raises Unsupported for an argument that cannot be rebuilt.
    """
    return [example_value(argument_from_json(described), device) for described in signature]


def eager_accepted(op: torch._ops.OpOverload, args: list[Any]) -> list[Any]:
    """``args`` (example tensors, which own their storage), with every integer
    tensor zeroed in place where eager ``op`` refuses their values: zeros
    index any non-empty dimension, where the small random integers of
    :func:`example_tensor` can be an index past a short table (BERT's
    token-type embedding has 2 rows). Eager is asked only where there are
    integer tensors, and on CPU copies: on CUDA an index out of range is a
    device-side assert, which no later call of the process survives.

        >>> table, indices = torch.randn(2, 4), torch.tensor([0, 7, 1])
        >>> eager_accepted(torch.ops.aten.embedding.default, [table, indices])[1]
        tensor([0, 0, 0])
    """
    if any(_integer_tensors(a) for a in args) and not _eager_accepts(op, args):
        for a in args:
            _zero_integers(a)  # where eager refuses zeros too, its own error comes from the call
    return args


def _integer_tensors(value: Any) -> bool:
    if isinstance(value, list):
        return any(_integer_tensors(v) for v in value)
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)


def _zero_integers(value: Any) -> None:
    if isinstance(value, list):
        for v in value:
            _zero_integers(v)
    elif _integer_tensors(value):
        storage = torch.empty(0, dtype=value.dtype, device=value.device).set_(value.untyped_storage())
        storage.zero_()  # all of it, so that the layout (even an expanded one) stays as it is


def _eager_accepts(op: torch._ops.OpOverload, args: list[Any]) -> bool:
    from aoti_eager.kernels.compile import call_op

    def on_cpu(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to("cpu", copy=True)
        return [on_cpu(v) for v in value] if isinstance(value, list) else value

    try:
        with torch.no_grad():
            call_op(op, [on_cpu(a) for a in args])
    except Exception:  # noqa: BLE001 - a refusal of the values, or of CPU: either way, not these values'
        return False
    return True
