"""A freshly compiled kernel is run once against the original kernel, on copies
of the call that compiled it, before anyone else may use it: a kernel that
disagrees with eager (values, dtype, shape, strides, or what it writes into
its arguments) is never published."""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable

import torch

import torch.utils._pytree as pytree

from aoti_eager.kernels.compile import call_op, flat_tensor_inputs, mutated_arguments, return_alias_indices
from aoti_eager.kernels.signature import CallSignature, clone_args

log = logging.getLogger("aoti_eager")


class Mismatch(Exception):
    """The compiled kernel's result differs from eager's."""


# same()'s tolerance (its allclose's, and a tenth of it added to its float64 check): torch's benchmarks'
# for runs in bf16 and fp16; torchbench's default, tighter, for float32 and float64 (the get's default).
_SAME_TOLERANCE = {torch.bfloat16: 1e-3, torch.float16: 1e-3}
# close_in_norm's: a few of the dtype's roundings, relative to the tensor's norm.
_NORM_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3}


def compare(what: str, actual: Any, expected: Any, reference: Callable[[], Any] | None = None) -> None:
    """Raises Mismatch where ``actual`` differs from eager's ``expected`` (a
    tensor, or a list or tuple of them): dtype, shape, strides, values within
    the tolerance of their dtype.

    ``reference``, where given, returns eager's computation in float64 on
    upcast copies (of the structure of ``expected``; called once, where
    needed): a floating tensor out of its dtype's tolerance is accepted
    where its error against that reference is within a small multiple of
    eager's own. A block compiled whole rounds at other points than eager,
    by more than one op's tolerance, and eager's own result may be far from
    float64's (a float32 sum of large values); torch's accuracy checks
    (``torch._dynamo.utils.same`` with ``fp64_ref``) judge it so."""
    if reference is not None:
        reference = functools.cache(reference)
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise Mismatch(f"{what}: expected a tensor, got {type(actual).__name__}")
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            raise Mismatch(f"{what}: {actual.dtype}{list(actual.shape)} instead of {expected.dtype}{list(expected.shape)}")
        strides = [s for s, n in zip(actual.stride(), actual.shape) if n > 1]
        expected_strides = [s for s, n in zip(expected.stride(), expected.shape) if n > 1]
        if actual.numel() > 0 and strides != expected_strides:
            raise Mismatch(f"{what}: strides {actual.stride()} instead of {expected.stride()}")
        try:
            torch.testing.assert_close(actual, expected, equal_nan=True)
        except AssertionError as e:
            said = str(e).splitlines()[0]
            if reference is None or not expected.is_floating_point():
                raise Mismatch(f"{what}: {said}") from None
            near = _near_as_eager(actual, expected, reference())
            if near is not None:
                raise Mismatch(f"{what}: {said} ({near})") from None
    elif isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise Mismatch(f"{what}: expected {len(expected)} values")
        for i, (a, e) in enumerate(zip(actual, expected)):
            compare(f"{what}[{i}]", a, e, None if reference is None else functools.partial(_part, reference, i))


def _part(reference: Callable[[], Any], i: int) -> Any:
    whole = reference()
    return whole[i] if isinstance(whole, (list, tuple)) and i < len(whole) else None


def _near_as_eager(actual: torch.Tensor, expected: torch.Tensor, reference: Any) -> str | None:
    """None where ``actual`` is as near the float64 ``reference`` as eager's
    ``expected`` is, within ``same``'s multiple; else why not."""
    if not _judges(reference, expected):
        return "no float64 run of the forward to judge it by"
    # same() accepts any result where the reference holds a NaN (a mean of nothing): a NaN is no rounding.
    if not torch.equal(actual.isnan(), expected.isnan()):
        return "a NaN where eager has a number, or a number where eager has NaN"
    from torch._dynamo.utils import same

    said: list[str] = []
    # tol: same's allclose first, then the error against the reference within tol / 10 of its multiple of eager's.
    # same() takes a float64 reference only (a float32 run, widened, judges a 16-bit result).
    tol = _SAME_TOLERANCE.get(expected.dtype, 1e-4)
    if same(expected, actual, reference.double(), tol=tol, equal_nan=True, log_error=lambda message, *args: said.append(message % args)):
        return None
    return f"against a {str(reference.dtype).removeprefix('torch.')} run of the forward: " + (said[0].split(" and shape")[0] if said else "not as near as eager")


def close_in_norm(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether ``actual`` has ``expected``'s dtype, shape and strides and is
    within its dtype's tolerance of it in norm: where no float64 run can
    judge a result (an attention's dropout has no float64 kernel), a sum of
    many terms (a weight's gradient) rounds at other points than eager by
    more than an element's tolerance, but not in norm."""
    if (actual.dtype, actual.shape, actual.stride()) != (expected.dtype, expected.shape, expected.stride()):
        return False
    if not expected.is_floating_point():
        return torch.equal(actual, expected)
    tol = _NORM_TOLERANCE.get(expected.dtype, 1e-4)
    error, size = (actual.double() - expected.double()).norm(), expected.double().norm()
    return bool(error <= tol * size + 1e-12)


def _judges(reference: Any, expected: torch.Tensor) -> bool:
    """Whether ``reference`` is a run of ``expected``'s computation in float64,
    or in float32 for a 16-bit result (a forward with no float64 kernel)."""
    return (
        isinstance(reference, torch.Tensor) and reference.is_floating_point() and reference.shape == expected.shape
        and reference.dtype.itemsize >= 2 * expected.dtype.itemsize
    )


def check_fresh_memory(inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    """Raises Mismatch where an output shares memory with an input or another
    output: eager returns new memory (other than through an aliasing return),
    a kernel that hands back an input, or one buffer twice, does not."""
    seen = {t.untyped_storage()._cdata for t in inputs}
    for t in outputs:
        if t.numel() > 0 and t.untyped_storage()._cdata in seen:
            raise Mismatch("an output shares memory with an input or another output")
        seen.add(t.untyped_storage()._cdata)


def check_matches_eager(
    kernel: Any, signature: CallSignature, op: torch._ops.OpOverload, reference_args: list[Any], expected: Any
) -> None:
    """Runs ``kernel`` on fresh copies of the call and compares with eager.

    ``reference_args`` are the copies eager ran on (holding what eager wrote
    into them), ``expected`` what eager returned. Raises Mismatch.
    """
    args = clone_args(signature.args)
    inputs = flat_tensor_inputs(signature, args)
    fresh = kernel.run(inputs)
    check_fresh_memory(inputs, fresh)
    outputs = iter(fresh)
    results = expected if isinstance(expected, tuple) else (expected,)
    if not op._schema.returns:
        results = ()
    # One float64 run for every return, made only where one is judged by it.
    in_float64 = functools.cache(lambda: _float64_returns(op, signature))
    for i, (alias, count, want) in enumerate(zip(return_alias_indices(op), kernel.output_counts, results)):
        if alias is not None:
            got = args[alias]
        elif count < 0:
            got = next(outputs)
        else:
            got = [next(outputs) for _ in range(count)]
        compare(f"return {i}", got, want, functools.partial(_part, in_float64, i))
    for i in mutated_arguments(op):
        compare(f"argument {op._schema.arguments[i].name}", args[i], reference_args[i])


def _float64_returns(op: torch._ops.OpOverload, signature: CallSignature) -> tuple[Any, ...] | None:
    """The op's returns on upcast copies of the call (a matmul in bf16 sums in
    another order when compiled: it is judged against this, see
    :func:`compare`); None where the op does not run so."""
    result = upcast_run(lambda args: call_op(op, args), signature.args)  # upcast_run copies every tensor
    return result if result is None or isinstance(result, tuple) else (result,)


def upcast_run(run: Callable[[Any], Any], args: Any) -> Any:
    """``run`` on copies of ``args`` whose floating tensors are float64, else
    (an op with no float64 kernel, as CUDA's ``_grouped_mm``) whose 16-bit ones
    are float32; None where neither runs (a forward that casts on its own)."""
    tensors = [t for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    dtypes = [torch.float64] + ([torch.float32] if any(t.dtype.itemsize < 4 for t in tensors) else [])
    for dtype in dtypes:
        wider = lambda t: dtype if t.is_floating_point() and t.dtype.itemsize < dtype.itemsize else t.dtype  # noqa: E731
        upcast = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().to(wider(t), copy=True), args)
        try:
            return run(upcast)
        except Exception as e:  # noqa: BLE001 - the kernel is then judged by its dtype's tolerance alone
            log.debug("aoti_eager: no run in %s to judge a kernel by: %s", dtype, e)
    return None
