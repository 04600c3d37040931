"""Example arguments rebuilt from a recorded signature
(aoti_eager.kernels.examples): a call with them has the recorded signature."""

from __future__ import annotations

import pytest
import torch

from aoti_eager.kernels.examples import eager_accepted, example_arguments, example_tensor, example_value
from aoti_eager.kernels.signature import ALIGNMENT, CallSignature, TensorArg, Unsupported, argument_from_json

A = torch.ops.aten
CPU = torch.device("cpu")


def zeros(*sizes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*sizes, dtype=dtype)


CALLS = {
    "contiguous": (A.abs.default, lambda: [zeros(4, 3)]),
    "transposed": (A.abs.default, lambda: [zeros(4, 3).t()]),
    "misaligned": (A.abs.default, lambda: [zeros(5)[1:]]),
    "empty": (A.abs.default, lambda: [zeros(0, 3)]),
    "expanded": (A.add.Tensor, lambda: [zeros(4, 1).expand(4, 3), zeros(3), 2]),
    "int": (A.add.Tensor, lambda: [zeros(4, dtype=torch.int32), zeros(4, dtype=torch.int32), 3]),
    "bool": (A.logical_not.default, lambda: [zeros(4, dtype=torch.bool)]),
    "runtime alpha": (A.add.Tensor, lambda: [zeros(4), zeros(4), 0.5]),
    "number for a Tensor": (A.mul.Tensor, lambda: [zeros(4), 2.5]),
    "list of tensors": (A.cat.default, lambda: [[zeros(2, 3), zeros(4, 3).t().contiguous().t()], 0]),
    "None and bool": (A.sum.dim_IntList, lambda: [zeros(4, 8), [1], True, None]),
    "dtype": (A._to_copy.default, lambda: [zeros(4), torch.float16, None, None, None, False, None]),
}


@pytest.mark.parametrize("call", CALLS)
def test_example_arguments_have_the_recorded_signature(call):
    op, args = CALLS[call]
    recorded = CallSignature.of(op, "cpu", args())
    rebuilt = CallSignature.of(op, "cpu", example_arguments(recorded.to_json(), CPU))
    assert rebuilt.to_json() == recorded.to_json()
    assert rebuilt.key == recorded.key


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("aligned", [True, False])
def test_an_example_tensor_has_the_described_layout(dtype, aligned):
    described = TensorArg(str(dtype).removeprefix("torch."), "cpu", (3, 4), (1, 3), aligned)
    t = example_tensor(described, CPU)
    assert TensorArg.of(t, CPU) == described
    assert (t.data_ptr() % ALIGNMENT == 0) == aligned


def test_example_integers_are_small_and_floats_random():
    ints = example_tensor(TensorArg("int64", "cpu", (1000,), (1,), True), CPU)
    assert 0 <= ints.min() and ints.max() < 8  # valid indices, shifts and divisors for most ops
    floats = [example_tensor(TensorArg("float32", "cpu", (1000,), (1,), True), CPU) for _ in range(2)]
    assert floats[0].isfinite().all() and not torch.equal(*floats)


@pytest.mark.parametrize("rows", [2, 1])
def test_indices_into_a_short_table_are_rebuilt_in_range(rows):
    # BERT's token-type embedding has 2 rows: random indices up to 8 made every
    # prewarm and background compile of it fail with eager's IndexError.
    table, indices = zeros(rows, 4), torch.zeros(2, 32, dtype=torch.int64)
    recorded = CallSignature.of(A.embedding.default, "cpu", [table, indices, -1, False, False])
    args = eager_accepted(A.embedding.default, example_arguments(recorded.to_json(), CPU))
    assert CallSignature.of(A.embedding.default, "cpu", args).key == recorded.key
    torch.testing.assert_close(A.embedding.default(*args), args[0][args[1]])


def test_zeroed_indices_keep_their_layout():
    table, indices = zeros(2, 4), torch.tensor([[7], [1], [5]]).expand(3, 5)
    args = eager_accepted(A.embedding.default, [table, indices])
    assert args[1].stride() == (1, 0) and args[1].shape == (3, 5) and not args[1].any()
    assert args[0] is table


def test_arguments_eager_refuses_whatever_the_values_are_kept_for_eager_to_refuse():
    recorded = CallSignature.of(A.embedding.default, "cpu", [zeros(0, 4), torch.zeros(3, dtype=torch.int64), -1, False, False])
    args = eager_accepted(A.embedding.default, example_arguments(recorded.to_json(), CPU))
    assert CallSignature.of(A.embedding.default, "cpu", args).key == recorded.key
    with pytest.raises(RuntimeError, match="index_select"):
        A.embedding.default(*args)


def test_a_misaligned_tensor_of_sixteen_byte_elements_cannot_be_rebuilt():
    with pytest.raises(Unsupported, match="misaligned"):
        example_tensor(TensorArg("complex128", "cpu", (4,), (1,), False), CPU)


@pytest.mark.parametrize("described, value", [
    ({"kind": "number", "dtype": "float64", "value": "2.5"}, 2.5),
    ({"kind": "number", "dtype": "int64", "value": "3"}, 3),
    ({"kind": "number", "dtype": "bool", "value": "True"}, True),
    ({"kind": "float", "value": "0.5", "runtime": True}, 0.5),
])
def test_a_number_is_given_as_python_number(described, value):
    # Given as the user gave it, the dispatcher wraps it again, and the call is keyed as the recorded one.
    rebuilt = example_value(argument_from_json(described), CPU)
    assert type(rebuilt) is type(value) and rebuilt == value
