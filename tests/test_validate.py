"""The check of a new kernel against eager (aoti_eager.kernels.validate), with
stand-in kernels written in Python: each wrong in one way is refused."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from aoti_eager.kernels.compile import call_op
from aoti_eager.kernels.signature import CallSignature, clone_args
from aoti_eager.kernels.validate import Mismatch, check_matches_eager, close_in_norm, compare, upcast_run
from helpers import FakeKernel

A = torch.ops.aten
X = torch.linspace(-3, 3, 12).view(4, 3)  # no zero: abs(X) differs from a zeroed buffer everywhere


def written(write: Callable[[list[torch.Tensor]], Any]) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """A kernel that only writes into its arguments."""

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        write(inputs)
        return []

    return run


def check(op: torch._ops.OpOverload, args: list[Any], kernel: FakeKernel) -> CallSignature:
    """Checks ``kernel`` for ``op`` called on ``args``, as the runtime does
    after a compile: eager runs on copies first. Returns the signature."""
    signature = CallSignature.of(op, "cpu", args)
    reference_args = clone_args(signature.args)
    expected = call_op(op, reference_args)
    check_matches_eager(kernel, signature, op, reference_args, expected)
    return signature


def foreach_add(inputs: list[torch.Tensor], value: int) -> None:
    for t in inputs:
        t.add_(value)


# Calls, each with a kernel that does what eager does.
CALLS = {
    "abs": (A.abs.default, lambda: [X.t()], FakeKernel(lambda i: [i[0].abs()], [-1])),
    "max.dim": (A.max.dim, lambda: [X, 1], FakeKernel(lambda i: list(torch.max(i[0], 1)), [-1, -1])),
    "_foreach_abs": (A._foreach_abs.default, lambda: [[X, X.t()]], FakeKernel(lambda i: [t.abs() for t in i], [2])),
    "abs.out": (A.abs.out, lambda: [X, torch.zeros(4, 3)], FakeKernel(written(lambda i: torch.abs(i[0], out=i[1])), [0])),
    "add_": (A.add_.Tensor, lambda: [X.clone(), X, 2], FakeKernel(written(lambda i: i[0].add_(i[1], alpha=2)), [0])),
    "_foreach_add_": (A._foreach_add_.Scalar, lambda: [[X.clone(), X.clone()], 2], FakeKernel(written(lambda i: foreach_add(i, 2)), [])),
}

# The same calls, with a kernel wrong in one way, and what the refusal says.
WRONG = {
    "value": ("abs", FakeKernel(lambda i: [i[0].abs() + 1], [-1]), "return 0: Tensor-likes are not close"),
    "dtype": ("abs", FakeKernel(lambda i: [i[0].abs().double()], [-1]), r"return 0: torch.float64\[3, 4\] instead of torch.float32"),
    "shape": ("abs", FakeKernel(lambda i: [i[0].abs().flatten()], [-1]), r"return 0: torch.float32\[12\] instead of"),
    "strides": ("abs", FakeKernel(lambda i: [i[0].abs().contiguous()], [-1]), r"return 0: strides \(4, 1\) instead of \(1, 3\)"),
    "an input handed back": ("abs", FakeKernel(lambda i: [i[0]], [-1]), "shares memory"),
    "one buffer twice": ("max.dim", FakeKernel(lambda i: [i[0].amax(1)] * 2, [-1, -1]), "shares memory"),
    "second return": ("max.dim", FakeKernel(lambda i: [torch.max(i[0], 1)[0], torch.max(i[0], 1)[1].int()], [-1, -1]),
                      "return 1: torch.int32"),
    "list item": ("_foreach_abs", FakeKernel(lambda i: [i[0].abs(), i[1].neg()], [2]), r"return 0\[1\]"),
    "out= not written": ("abs.out", FakeKernel(lambda i: [], [0]), "return 0"),
    "argument written wrongly": ("_foreach_add_", FakeKernel(written(lambda i: foreach_add(i, 3)), []), r"argument self\[0\]"),
}


@pytest.mark.parametrize("call", CALLS)
def test_a_kernel_that_does_what_eager_does_passes(call):
    op, args, kernel = CALLS[call]
    check(op, args(), kernel)


@pytest.mark.parametrize("wrong", WRONG)
def test_a_kernel_that_differs_from_eager_is_refused(wrong):
    call, kernel, why = WRONG[wrong]
    op, args, _ = CALLS[call]
    with pytest.raises(Mismatch, match=why):
        check(op, args(), kernel)


def test_the_kernel_runs_on_copies_of_the_call():
    op, args, kernel = CALLS["add_"]
    seen = []
    spy = FakeKernel(lambda inputs: seen.extend(inputs) or kernel.run(inputs), kernel.output_counts)
    signature = check(op, args(), spy)
    torch.testing.assert_close(signature.args[0], X)  # the caller's tensor, not written into
    called = {t.untyped_storage().data_ptr() for t in signature.args if isinstance(t, torch.Tensor)}
    assert seen and not called & {t.untyped_storage().data_ptr() for t in seen}


def _rounded_pair(dtype: torch.dtype, skew: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(actual, expected, float64 reference): eager's result rounded to ``dtype`` from a float64 one with
    rounding noise of its own, and a kernel's rounded at other points, ``skew`` times too large."""
    g = torch.Generator().manual_seed(0)
    exact = torch.randn(64, 64, dtype=torch.float64, generator=g)
    noise = lambda: exact * (1 + 4e-3 * torch.randn(exact.shape, dtype=torch.float64, generator=g))  # noqa: E731
    return (noise() * skew).to(dtype), noise().to(dtype), exact


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_result_out_of_its_dtypes_tolerance_is_judged_against_a_float64_reference(dtype):
    actual, expected, exact = _rounded_pair(dtype, skew=1.0)
    with pytest.raises(Mismatch, match="not close"):
        compare("out", actual, expected)  # one op's tolerance
    compare("out", [actual], [expected], lambda: [exact])  # as near float64 as eager: accepted
    skewed, expected, exact = _rounded_pair(dtype, skew=1.03)
    with pytest.raises(Mismatch, match=r"against a float64 run of the forward: RMSE \(res-fp64\)"):
        compare("out", [skewed], [expected], lambda: [exact])
    with pytest.raises(Mismatch, match="no float64 run of the forward"):
        compare("out", [actual], [expected], lambda: None)  # the forward did not run in float64


def test_a_forward_with_no_float64_kernel_is_judged_against_its_float32_run():
    # CUDA's _grouped_mm (a mixture of experts) has bf16 and float32 kernels only.
    def forward(inputs):
        if inputs[0].dtype == torch.float64:
            raise RuntimeError("no float64 kernel")
        return [inputs[0] * 3]

    actual, expected, exact = _rounded_pair(torch.bfloat16, skew=1.0)
    assert upcast_run(forward, [expected])[0].dtype == torch.float32
    assert upcast_run(forward, [expected.float()]) is None  # a float32 run judges no float32 result
    compare("out", [actual], [expected], lambda: [exact.float()])
    skewed, _, _ = _rounded_pair(torch.bfloat16, skew=1.03)
    with pytest.raises(Mismatch, match="against a float32 run of the forward"):
        compare("out", [skewed], [expected], lambda: [exact.float()])
    with pytest.raises(Mismatch, match="no float64 run"):
        compare("out", [actual.float()], [expected.float()], lambda: [exact.float()])


def test_a_number_where_eager_has_nan_is_refused_though_float64_has_nan_too():
    # var_mean's mean of an empty input: a kernel's 0.0 against eager's NaN.
    expected = torch.tensor(float("nan"))
    with pytest.raises(Mismatch, match="a NaN where eager has a number, or a number where eager has NaN"):
        compare("out", [torch.tensor(0.0)], [expected], lambda: [expected.double()])


def test_the_float64_reference_is_made_once_and_only_for_a_result_out_of_tolerance():
    actual, expected, exact = _rounded_pair(torch.float32, skew=1.0)
    made = []
    reference = lambda: made.append(1) or [exact, exact]  # noqa: E731
    compare("out", [expected.clone(), expected.clone()], [expected, expected], reference)
    assert made == []
    compare("out", [actual, actual], [expected, expected], reference)
    assert made == [1]


def _mm_in_halves(inputs: list[torch.Tensor], skew: float = 1.0) -> list[torch.Tensor]:
    """A bf16 matmul that sums each half of its inner dim apart: rounded at other points than eager's."""
    x, y = inputs
    return [(x[:, :128] @ y[:128] + x[:, 128:] @ y[128:]) * skew]


def test_an_op_in_low_precision_is_judged_against_its_float64_run():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 256, generator=g).bfloat16(), torch.randn(256, 32, generator=g).bfloat16()
    args = lambda: [x.clone(), y.clone()]  # noqa: E731
    with pytest.raises(Mismatch, match="not close"):
        compare("mm", _mm_in_halves(args())[0], call_op(A.mm.default, args()))  # one op's bf16 tolerance: refused
    check(A.mm.default, args(), FakeKernel(_mm_in_halves, [-1]))  # as near float64 as eager: accepted
    with pytest.raises(Mismatch, match="against a float64 run"):
        check(A.mm.default, args(), FakeKernel(lambda i: _mm_in_halves(i, skew=1.03), [-1]))


def test_a_sum_rounded_elsewhere_is_close_in_norm_and_a_wrong_value_is_not():
    torch.manual_seed(0)
    rows = torch.randn(4096, 64)
    expected = rows.sum(0)
    reordered = rows.flip(0).sum(0)  # other rounding points, as a fused kernel's reduction
    assert close_in_norm(reordered, expected)
    wrong = expected.clone()
    wrong[3] += 1.0
    assert not close_in_norm(wrong, expected)
    assert not close_in_norm(expected.double(), expected)  # another dtype
    square = torch.randn(8, 8)
    assert not close_in_norm(square.t().contiguous().t(), square)  # the same values, laid out otherwise
