"""CUDA matmuls as Triton templates (kernels/matmul.py): which calls, the
options they compile with, and the shapes their kernels serve, asked of the
planner directly. The calls are described as CUDA calls; nothing runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aoti_eager import settings
from aoti_eager._planner import Eager, Planner
from aoti_eager.kernels import CallSignature
from aoti_eager.kernels.dynamic import ShapeFamily, family_key, family_limit_key
from aoti_eager.kernels.matmul import fixed_dims, inductor_options, is_template_matmul
from aoti_eager.kernels.signature import TensorArg
from helpers import compiled

A = torch.ops.aten


def on_cuda(op: torch._ops.OpOverload, *args) -> CallSignature:
    """``op``'s signature for ``args`` as a call on CUDA would describe it."""
    call = CallSignature.of(op, "cpu", list(args))

    def moved(d):
        return dataclasses.replace(d, device="cuda") if isinstance(d, TensorArg) else d

    return dataclasses.replace(call, device=torch.device("cuda"), described=tuple(moved(d) for d in call.described))


def linear(rows: int, inner: int = 64, columns: int = 32, dtype: torch.dtype = torch.bfloat16) -> CallSignature:
    bias, x, weight = torch.randn(columns, dtype=dtype), torch.randn(rows, inner, dtype=dtype), torch.randn(inner, columns, dtype=dtype)
    return on_cuda(A.addmm.default, bias, x, weight)


def test_16_bit_cuda_matmuls_compile_as_autotuned_triton_templates():
    x, w = torch.randn(8, 16, dtype=torch.float16), torch.randn(16, 4, dtype=torch.float16)
    for call in (linear(8), on_cuda(A.mm.default, x, w), on_cuda(A.bmm.default, x.view(2, 4, 16), w.expand(2, 16, 4))):
        assert is_template_matmul(call), call.op
        assert inductor_options(call) == {"max_autotune_gemm": True}


@pytest.mark.parametrize("call", [
    pytest.param(lambda: linear(8, dtype=torch.float32), id="float32"),
    pytest.param(lambda: CallSignature.of(A.mm.default, "cpu", [torch.randn(4, 4, dtype=torch.bfloat16)] * 2), id="cpu"),
    pytest.param(lambda: on_cuda(A.addmm.default, *[torch.randn(4, 4, dtype=torch.bfloat16)] * 3), id="bias of rows"),
    pytest.param(lambda: on_cuda(A.mm.out, *[torch.randn(4, 4, dtype=torch.bfloat16) for _ in range(3)]), id="out="),
    pytest.param(lambda: on_cuda(A.abs.default, torch.randn(4, dtype=torch.bfloat16)), id="not a matmul"),
])
def test_other_calls_compile_as_before(call):
    signature = call()
    assert not is_template_matmul(signature)
    assert (fixed_dims(signature), inductor_options(signature)) == (frozenset(), {})


def test_each_reduction_and_column_size_is_a_family_of_its_own():
    assert family_key(linear(8)) == family_key(linear(16))
    assert family_key(linear(8)) != family_key(linear(8, inner=128)) != family_key(linear(8, columns=48))
    # Elsewhere sizes are no part of the family.
    assert family_key(linear(8, dtype=torch.float32)) == family_key(linear(8, inner=128, dtype=torch.float32))


def test_a_dynamic_kernel_takes_only_rows_at_any_size():
    planner = Planner()
    compiled(planner, linear(8))
    moved = linear(16)
    request = compiled(planner, moved)
    assert request.family == ShapeFamily(((), (0,), ()))


def test_another_weights_first_kernel_is_static():
    # Tuned at its own sizes, where the first of another family would be general.
    planner = Planner()
    compiled(planner, linear(8))
    assert compiled(planner, linear(8, inner=128)).family is None


def test_a_verdict_for_a_whole_family_leaves_other_weights_alone():
    assert ShapeFamily.any_shape(linear(8)) == ShapeFamily(((), (0,), ()))
    assert ShapeFamily.any_shape(linear(8, dtype=torch.float32)) == ShapeFamily(((0,), (0, 1), (0, 1)))


def test_past_the_matmul_size_limit_further_sizes_run_eagerly():
    # A weight gradient's reduction is the tokens: each length would be a family.
    planner = Planner()
    with settings.max_matmul_sizes.set_to("2"):
        compiled(planner, linear(8, inner=64))
        compiled(planner, linear(8, inner=128))
        compiled(planner, linear(16, inner=128))  # a size seen: not counted again
        third = linear(8, inner=256)
        verdict = planner.to_compile(third)
    assert verdict == Eager(verdict.reason, "family", record=family_limit_key(third))
    assert "AOTI_EAGER_MAX_MATMUL_SIZES=2" in verdict.reason
    assert planner.eager(third, verdict).dynamic == ShapeFamily.any_shape(third)


def test_a_bmm_takes_its_batch_and_rows_at_any_size():
    x, w = torch.randn(2, 4, 16, dtype=torch.bfloat16), torch.randn(2, 16, 8, dtype=torch.bfloat16)
    call = on_cuda(A.bmm.default, x, w)
    assert fixed_dims(call) == {(0, 2), (1, 1), (1, 2)}
    assert ShapeFamily.general_for(call) == ShapeFamily(((0, 1), (0,)))
