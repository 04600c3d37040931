"""The per-op correctness table: one call of one aten overload per case.

Together the cases cover every kind of argument an aten op takes (tensors,
tensor lists, optional tensors, Python numbers, int lists, str, dtype, layout,
device, memory format), the semantics that eager defines (out=, in-place,
several outputs, broadcasting, type promotion) and the inputs that trip up a
compiled kernel (non-contiguous, misaligned, empty, 0-d). Each case makes its
arguments for a device, so the same table runs on CPU and CUDA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

A = torch.ops.aten


@dataclass(frozen=True)
class Case:
    id: str
    op: torch._ops.OpOverload
    make: Callable[[str], tuple[list[Any], dict[str, Any]]]
    # None: compiled and served by the kernel; else a substring of the reason
    # the runtime gives for running it eagerly.
    eager_reason: str | None = None
    # "out" or the index of the argument the op returns after writing into it.
    returns_input: str | int | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)
    # Its result is compared with eager's run in float32, rounded to the result's dtype.
    reference_in_float: bool = False


def _g(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, device: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=_g(seed), dtype=torch.float32).to(device=device, dtype=dtype)


def randint(high: int, *shape: int, device: str, dtype: torch.dtype = torch.int64, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_g(seed), dtype=dtype).to(device)


def misaligned(*shape: int, device: str) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return randn(n + 1, device=device)[1:].view(*shape)


CASES: list[Case] = [
    # Unary, and the input layouts a static kernel must not get wrong.
    Case("abs", A.abs.default, lambda d: ([randn(128, device=d)], {})),
    Case("abs.out", A.abs.out, lambda d: ([randn(8, 8, device=d)], {"out": torch.empty(8, 8, device=d)}), returns_input="out"),
    Case("abs_", A.abs_.default, lambda d: ([randn(8, 8, device=d)], {}), returns_input=0),
    Case("neg-transposed", A.neg.default, lambda d: ([randn(6, 10, device=d).t()], {})),
    Case("neg-sliced", A.neg.default, lambda d: ([randn(10, 12, device=d)[::2, 1:7]], {})),
    Case("neg-expanded", A.neg.default, lambda d: ([randn(1, 5, device=d).expand(4, 5)], {})),
    Case("neg-misaligned", A.neg.default, lambda d: ([misaligned(7, 9, device=d)], {})),
    Case("neg-empty", A.neg.default, lambda d: ([randn(0, 3, device=d)], {})),
    Case("neg-0d", A.neg.default, lambda d: ([randn(device=d)], {})),
    Case("neg-channels_last", A.neg.default, lambda d: ([randn(2, 3, 4, 5, device=d).to(memory_format=torch.channels_last)], {})),
    Case("exp-float64", A.exp.default, lambda d: ([randn(33, device=d, dtype=torch.float64)], {})),
    Case("sigmoid-bfloat16", A.sigmoid.default, lambda d: ([randn(64, device=d, dtype=torch.bfloat16)], {})),
    Case("silu", A.silu.default, lambda d: ([randn(4, 32, device=d)], {})),
    Case("logical_not-bool", A.logical_not.default, lambda d: ([randn(16, device=d) > 0], {})),
    # Binary: broadcasting, Python numbers and type promotion.
    Case("add.Tensor-alpha", A.add.Tensor, lambda d: ([randn(64, 64, device=d), randn(64, 64, device=d, seed=1)], {"alpha": 2})),
    Case("add.Tensor-broadcast", A.add.Tensor, lambda d: ([randn(4, 1, 8, device=d), randn(3, 1, device=d, seed=1)], {})),
    Case("add.Tensor-int+float64", A.add.Tensor, lambda d: ([randint(9, 6, device=d), randn(6, device=d, dtype=torch.float64)], {})),
    Case("add.Tensor-python-float", A.add.Tensor, lambda d: ([randn(16, device=d, dtype=torch.float16), 2.5], {})),
    Case("add_.Tensor", A.add_.Tensor, lambda d: ([randn(8, 8, device=d), randn(8, device=d, seed=1)], {"alpha": -0.5}), returns_input=0),
    Case("add.out", A.add.out, lambda d: ([randn(5, 5, device=d), randn(5, 5, device=d, seed=1)], {"out": torch.empty(5, 5, device=d)}), returns_input="out"),
    Case("sub.Tensor-0d", A.sub.Tensor, lambda d: ([randn(3, 4, device=d), randn(device=d, dtype=torch.float64, seed=1)], {})),
    Case("mul.Tensor-int*python-float", A.mul.Tensor, lambda d: ([randint(9, 6, device=d, dtype=torch.int32), 1.5], {})),
    Case("mul.Scalar", A.mul.Scalar, lambda d: ([randn(10, device=d), 3], {})),
    Case("div.Tensor_mode-floor", A.div.Tensor_mode, lambda d: ([randn(12, device=d), randn(12, device=d, seed=1)], {"rounding_mode": "floor"})),
    Case("div.Tensor-int/int", A.div.Tensor, lambda d: ([randint(9, 8, device=d), randint(9, 8, device=d, seed=1) + 1], {})),
    Case("pow.Tensor_Scalar", A.pow.Tensor_Scalar, lambda d: ([randn(10, device=d), 3], {})),
    Case("eq.Tensor", A.eq.Tensor, lambda d: ([randint(3, 10, device=d), randint(3, 10, device=d, seed=1)], {})),
    Case("bitwise_and.Tensor", A.bitwise_and.Tensor, lambda d: ([randint(255, 10, device=d), randint(255, 10, device=d, seed=1)], {})),
    Case("where.self", A.where.self, lambda d: ([randn(5, 1, device=d) > 0, randn(5, 4, device=d), randn(4, device=d, seed=2)], {})),
    Case("clamp-optional-scalars", A.clamp.default, lambda d: ([randn(20, device=d)], {"min": -0.5, "max": None})),
    Case("clamp.Tensor-optional-tensors", A.clamp.Tensor, lambda d: ([randn(20, device=d)], {"min": None, "max": randn(20, device=d, seed=1)})),
    Case("masked_fill.Scalar", A.masked_fill.Scalar, lambda d: ([randn(6, 6, device=d), randn(6, 6, device=d, seed=1) > 0, -1.0], {})),
    Case("addcmul-value", A.addcmul.default, lambda d: ([randn(8, device=d), randn(8, device=d, seed=1), randn(8, device=d, seed=2)], {"value": 0.5})),
    Case("lerp.Scalar", A.lerp.Scalar, lambda d: ([randn(8, device=d), randn(8, device=d, seed=1), 0.25], {})),
    # Str, int-list, dtype, layout, device and memory-format arguments.
    Case("gelu-tanh", A.gelu.default, lambda d: ([randn(256, device=d)], {"approximate": "tanh"})),
    Case("sum.dim_IntList-dtype", A.sum.dim_IntList, lambda d: ([randn(4, 8, device=d), [1], True], {"dtype": torch.float64})),
    Case("mean.dim", A.mean.dim, lambda d: ([randn(4, 8, 3, device=d), [0, 2]], {})),
    Case("amax", A.amax.default, lambda d: ([randn(4, 8, device=d), [0]], {})),
    Case("cumsum-dtype", A.cumsum.default, lambda d: ([randint(5, 10, device=d), 0], {"dtype": torch.int32})),
    Case("constant_pad_nd", A.constant_pad_nd.default, lambda d: ([randn(3, 4, device=d), [1, 2, 0, 1], 0.5], {})),
    Case("clone-channels_last", A.clone.default, lambda d: ([randn(2, 3, 4, 5, device=d)], {"memory_format": torch.channels_last})),
    Case("_to_copy-dtype", A._to_copy.default, lambda d: ([randn(10, device=d)], {"dtype": torch.float16})),
    Case("zeros_like-layout-device", A.zeros_like.default, lambda d: ([randn(3, 5, device=d)], {"dtype": torch.int64, "layout": torch.strided, "device": torch.device(d)})),
    Case("_softmax", A._softmax.default, lambda d: ([randn(16, 32, device=d), 1, False], {})),
    Case("_log_softmax", A._log_softmax.default, lambda d: ([randn(16, 32, device=d), 0, False], {})),
    # Several outputs, optional tensors, tensor lists.
    Case("native_layer_norm", A.native_layer_norm.default, lambda d: ([randn(4, 16, device=d), [16], randn(16, device=d, seed=1), randn(16, device=d, seed=2), 1e-5], {})),
    Case("native_layer_norm-no-affine", A.native_layer_norm.default, lambda d: ([randn(4, 16, device=d), [16], None, None, 1e-5], {})),
    Case("native_group_norm", A.native_group_norm.default, lambda d: ([randn(2, 6, 5, device=d), randn(6, device=d, seed=1), None, 2, 6, 5, 3, 1e-5], {})),
    Case("max.dim", A.max.dim, lambda d: ([randn(4, 5, device=d), 1], {})),
    Case("topk", A.topk.default, lambda d: ([randn(10, device=d), 3], {"largest": False})),
    Case("cat-tensor-list", A.cat.default, lambda d: ([[randn(2, 3, device=d), randn(4, 3, device=d, seed=1)]], {"dim": 0})),
    Case("stack", A.stack.default, lambda d: ([[randn(3, device=d), randn(3, device=d, seed=1)], 1], {})),
    Case("_foreach_add.List", A._foreach_add.List, lambda d: ([[randn(3, device=d), randn(4, device=d)], [randn(3, device=d, seed=1), randn(4, device=d, seed=1)]], {})),
    Case("_foreach_mul_.Scalar", A._foreach_mul_.Scalar, lambda d: ([[randn(3, device=d), randn(4, 2, device=d)], 0.5], {})),
    Case("index_select", A.index_select.default, lambda d: ([randn(6, 4, device=d), 0, randint(6, 5, device=d)], {})),
    Case("gather", A.gather.default, lambda d: ([randn(4, 5, device=d), 1, randint(5, 4, 3, device=d)], {})),
    Case("binary_cross_entropy_with_logits", A.binary_cross_entropy_with_logits.default, lambda d: ([randn(8, device=d), (randn(8, device=d, seed=1) > 0).float(), None, None, 1], {})),
    Case("threshold_backward", A.threshold_backward.default, lambda d: ([randn(10, device=d), randn(10, device=d, seed=1), 0.0], {})),
    Case("index_put-optional-tensor-list", A.index_put.default, lambda d: ([randn(4, 5, device=d), [None, randint(5, 3, device=d)], randn(4, 3, device=d, seed=1)], {})),
    # Traced one tensor at a time through the .Scalar overload, its floats kernel inputs.
    Case("_foreach_add.ScalarList-float-list", A._foreach_add.ScalarList, lambda d: ([[randn(3, device=d), randn(2, 2, device=d)], [0.5, -2.0]], {})),
    Case("new_zeros-size-dtype", A.new_zeros.default, lambda d: ([randn(3, device=d), [2, 5]], {"dtype": torch.int32})),
    Case("full-no-tensor-inputs", A.full.default, lambda d: ([[3, 4], 1.5], {"dtype": torch.float32, "device": torch.device(d)})),
    # Matrix products (Inductor calls a library kernel for these).
    Case("mm", A.mm.default, lambda d: ([randn(8, 16, device=d), randn(16, 4, device=d, seed=1)], {})),
    Case("addmm-beta-alpha", A.addmm.default, lambda d: ([randn(4, device=d), randn(8, 16, device=d, seed=1), randn(16, 4, device=d, seed=2)], {"beta": 0.5, "alpha": 2.0})),
    Case("bmm", A.bmm.default, lambda d: ([randn(2, 4, 8, device=d), randn(2, 8, 3, device=d, seed=1)], {})),
    # Inputs the kernels are not compiled for: eager's exact result.
    Case("mul.Scalar-complex", A.mul.Scalar, lambda d: ([randn(4, device=d).to(torch.complex64), 1 + 2j], {}), eager_reason="unsupported input"),
    # The Conjugate key resolves the lazy conjugate before the override sees it.
    # Complex neg has no C shim: its kernel would only call the eager op.
    Case("neg-complex-conj", A.neg.default, lambda d: ([randn(4, device=d).to(torch.complex64).conj()], {}), eager_reason="proxy executor"),
    Case("add.Tensor-overlapping-in-place", A.add_.Tensor, lambda d: ((lambda x: [x, x])(randn(6, device=d)), {}), returns_input=0, eager_reason="share memory"),
]

OPS = sorted({c.op for c in CASES}, key=str)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return []


def _converted(value: Any, dtype: torch.dtype, memo: dict[int, torch.Tensor]) -> Any:
    """``value`` with every float32 tensor in ``dtype``, keeping its sizes,
    strides, storage offset (so its misalignment) and aliasing."""
    if isinstance(value, torch.Tensor):
        if value.dtype != torch.float32:
            return value
        if id(value) not in memo:
            storage = torch.empty(0, dtype=value.dtype, device=value.device)
            storage.set_(value.untyped_storage(), 0, (value.untyped_storage().nbytes() // value.element_size(),))
            converted = torch.empty(0, dtype=dtype, device=value.device)
            converted.set_(storage.to(dtype).untyped_storage(), value.storage_offset(), value.size(), value.stride())
            memo[id(value)] = converted
        return memo[id(value)]
    if isinstance(value, (list, tuple)):
        return type(value)(_converted(v, dtype, memo) for v in value)
    if isinstance(value, dict):
        return {k: _converted(v, dtype, memo) for k, v in value.items()}
    return value


# Half-precision cases judged as Inductor's own tests judge low precision
# (reference_in_float). group_norm in bfloat16: Inductor rounds its statistics
# at other points than eager, beyond bfloat16's tolerance of eager's result;
# the runtime keeps its kernel, as near a float64 run as eager's result
# (kernels/validate.py). Matmuls in bfloat16: a Triton template (kernels/matmul.py)
# sums in another order than cuBLAS.
HALF_PRECISION_IN_FLOAT = {"native_group_norm-bfloat16", "mm-bfloat16", "addmm-beta-alpha-bfloat16", "bmm-bfloat16"}


def in_dtype(case: Case, dtype: torch.dtype) -> Case:
    """``case`` with its float32 tensors in ``dtype``."""
    id = f"{case.id}-{str(dtype).removeprefix('torch.')}"
    return dataclasses.replace(
        case,
        id=id,
        make=lambda device: _converted(case.make(device), dtype, {}),
        reference_in_float=id in HALF_PRECISION_IN_FLOAT,
    )


def _float32_only(case: Case) -> bool:
    """Whether every floating tensor of the case is float32 (a case about
    another dtype, or about no floating tensor, keeps its dtypes)."""
    floating = [t.dtype for t in _tensors(case.make("cpu")) if t.is_floating_point() or t.is_complex()]
    return bool(floating) and set(floating) == {torch.float32}


# The float32 cases in half precision, for CUDA, where eager supports both
# dtypes for every op of the table.
HALF_PRECISION_CASES: list[Case] = [
    in_dtype(case, dtype) for dtype in (torch.float16, torch.bfloat16) for case in CASES if _float32_only(case)
]
