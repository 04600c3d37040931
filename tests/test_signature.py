"""Call signatures: their keys, their JSON form, and reading it back."""

from __future__ import annotations

import json

import pytest
import torch

from aoti_eager.kernels.signature import (
    CallSignature,
    NumberArg,
    RuntimeNumberArg,
    Unsupported,
    argument_from_json,
    clone_args,
    is_wrapped_number,
    short_form,
)

A = torch.ops.aten


def zeros(*sizes: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(*sizes, dtype=dtype)


def misaligned(*sizes: int) -> torch.Tensor:
    """A contiguous float32 tensor whose data starts 4 bytes past an aligned address."""
    t = torch.zeros(1 + sizes[0] * sizes[1])[1:].view(*sizes)
    assert t.data_ptr() % 16 != 0
    return t


def signature(op: torch._ops.OpOverload, *args) -> CallSignature:
    return CallSignature.of(op, "cpu", list(args))


# Cache keys name entries on disk: what a key hashes changes only with a new
# cache layout (LAYOUT_VERSION in cache/layout.py), or every cache is stranded.
PINNED_KEYS = {
    "tensor": (lambda: signature(A.abs.default, zeros(4, 3)), "b3601a48795efa9ee3877f4e"),
    "transposed": (lambda: signature(A.abs.default, zeros(4, 3).t()), "2e22bb5d9cd15d1ea5390997"),
    "misaligned": (lambda: signature(A.abs.default, zeros(5)[1:]), "3d3dbe2daa6764d66b5e4186"),
    "int alpha": (lambda: signature(A.add.Tensor, zeros(4), zeros(4), 2), "080bcbb6698f8a04428be66c"),
    "runtime alpha": (lambda: signature(A.add.Tensor, zeros(4), zeros(4), 0.5), "3030932a12c5088626dda023"),
    "constant alpha": (
        lambda: signature(A.add.Tensor, zeros(4), zeros(4), 0.5).with_constant_numbers(),
        "28d6b020b1a5a7613368da9e",
    ),
    "runtime number for a Tensor": (lambda: signature(A.mul.Tensor, zeros(4), 2.5), "181a29a6a01ece5da37c9402"),
    "int for a Tensor": (lambda: signature(A.mul.Tensor, zeros(4), 3), "8def43ba322b7b9c7c885c42"),
    "list of tensors": (lambda: signature(A.cat.default, [zeros(2, 3), zeros(4, 3)], 0), "bd04cd901ac89c3567fff99f"),
    "optional None": (lambda: signature(A.sum.dim_IntList, zeros(4, 8), [1], True, None), "fab313d34de76737274f5b5d"),
    "out=": (lambda: signature(A.abs.out, zeros(4), zeros(4)), "ceba739011d2e1ce639f3d7d"),
    "dtype": (
        lambda: signature(A._to_copy.default, zeros(4), torch.float16, None, None, None, False, None),
        "a86f60937d50f6cddb5781be",
    ),
}


@pytest.mark.parametrize("call", PINNED_KEYS)
def test_keys_of_representative_calls_are_pinned(call):
    make, key = PINNED_KEYS[call]
    assert make().key == key


def test_the_json_form_is_pinned_byte_for_byte():
    """What entry.json and manifests hold, key order included."""
    runtime_alpha = signature(A.add.Tensor, zeros(4), misaligned(2, 2).t(), 0.5)
    assert json.dumps(runtime_alpha.to_json()) == (
        '[{"name": "self", "kind": "tensor", "dtype": "float32", "device": "cpu", "sizes": [4], "strides": [1], '
        '"aligned": true}, {"name": "other", "kind": "tensor", "dtype": "float32", "device": "cpu", "sizes": [2, 2], '
        '"strides": [1, 2], "aligned": false}, {"name": "alpha", "kind": "float", "value": "0.5", "runtime": true}]'
    )
    listed = signature(A.sum.dim_IntList, zeros(4, 8), [1], True, torch.float64)
    assert json.dumps(listed.to_json()) == (
        '[{"name": "self", "kind": "tensor", "dtype": "float32", "device": "cpu", "sizes": [4, 8], "strides": [8, 1], '
        '"aligned": true}, {"name": "dim", "kind": "list", "items": [{"kind": "int", "value": 1}]}, '
        '{"name": "keepdim", "kind": "bool", "value": true}, {"name": "dtype", "kind": "dtype", "value": "torch.float64"}]'
    )


@pytest.mark.parametrize("call", PINNED_KEYS)
def test_the_json_form_reads_back_as_the_same_descriptions(call):
    s = PINNED_KEYS[call][0]()
    assert tuple(argument_from_json(d) for d in s.to_json()) == s.described
    assert short_form(s.to_json()) == s.short()


def test_a_wrapped_number_reads_back_with_its_dtype():
    for text, dtype, value in (("2.5", "float64", 2.5), ("3", "int64", 3), ("True", "bool", True)):
        described = {"kind": "number", "dtype": dtype, "value": text}
        assert argument_from_json(described) == NumberArg(value, wrapped_dtype=dtype)
        assert argument_from_json(described).to_json() == described
    runtime = {"kind": "number", "dtype": "float64", "value": "2.5", "runtime": True}
    assert argument_from_json(runtime) == RuntimeNumberArg(NumberArg(2.5, wrapped_dtype="float64"))
    assert argument_from_json(runtime).to_json() == runtime


def test_an_unknown_kind_is_unsupported():
    with pytest.raises(Unsupported, match="'generator'"):
        argument_from_json({"kind": "generator"})


def test_a_zero_dim_tensor_is_not_a_wrapped_number():
    assert not is_wrapped_number(torch.tensor(2.5))


# add.Tensor(self=float32[4, 4], other=float32[4, 4], alpha=2), with one thing changed.
BASE = (A.add.Tensor, lambda: zeros(4, 4), 2)
CHANGES = {
    "dtype": (A.add.Tensor, lambda: zeros(4, 4, dtype=torch.float64), 2),
    "size": (A.add.Tensor, lambda: zeros(4, 5), 2),
    "stride": (A.add.Tensor, lambda: zeros(4, 4).t(), 2),
    "alignment": (A.add.Tensor, lambda: misaligned(4, 4), 2),
    "op": (A.sub.Tensor, lambda: zeros(4, 4), 2),
}


def add_signature(op, make_self, alpha) -> CallSignature:
    return signature(op, make_self(), zeros(4, 4), alpha)


def test_equal_calls_have_equal_keys():
    first, second = add_signature(*BASE), add_signature(*BASE)
    assert first.args[0] is not second.args[0]
    assert (first.key, first.shape_key, first.decision_key) == (second.key, second.shape_key, second.decision_key)
    assert first.decision_key == (first.key, "cpu")


@pytest.mark.parametrize("change", CHANGES)
def test_a_change_of_a_field_changes_every_key(change):
    base, changed = add_signature(*BASE), add_signature(*CHANGES[change])
    assert changed.key != base.key
    assert changed.shape_key != base.shape_key
    assert changed.decision_key != base.decision_key


def test_a_constant_number_changes_the_key_not_the_shape_key():
    op, make_self, _ = BASE
    base, changed = add_signature(*BASE), add_signature(op, make_self, 3)
    assert changed.key != base.key and changed.shape_key == base.shape_key
    floats = [CallSignature.of(op, "cpu", [zeros(4, 4), zeros(4, 4), alpha], runtime_numbers=False) for alpha in (0.5, 0.25)]
    assert floats[0].key != floats[1].key and floats[0].shape_key == floats[1].shape_key
    # Numbers only: a bool constant is part of the shape.
    keepdims = [signature(A.sum.dim_IntList, zeros(4, 8), [1], keepdim, None) for keepdim in (True, False)]
    assert keepdims[0].shape_key != keepdims[1].shape_key


def test_a_dtype_is_part_of_the_shape_key_and_never_a_runtime_int():
    """The dispatcher passes a dtype as an int: a verdict for every value of a
    call's numbers (a conversion to complex left to the proxy executor) must
    not reach a conversion to another dtype."""
    to = [signature(A._to_copy.default, zeros(4), dtype, None, None, None, False, None) for dtype in (torch.bfloat16, torch.complex64)]
    assert to[0].shape_key != to[1].shape_key and to[0].values_key != to[1].values_key
    assert to[0].int_arguments == {}
    sums = [signature(A.sum.dim_IntList, zeros(4, 8), [1], False, dtype) for dtype in (torch.float32, torch.float64)]
    assert sums[0].shape_key != sums[1].shape_key and sums[0].int_arguments == {(1, 0): 1}


def test_a_runtime_number_is_left_out_of_the_key():
    calls = [signature(A.add.Tensor, zeros(4), zeros(4), alpha) for alpha in (0.5, -0.25)]
    assert [c.runtime_arguments for c in calls] == [[2], [2]]
    assert calls[0].to_json() != calls[1].to_json()  # the value of this call is recorded...
    assert calls[0].key == calls[1].key  # ...but names no other entry
    assert calls[0].shape_key == calls[1].shape_key
    constants = [c.with_constant_numbers() for c in calls]
    assert constants[0].runtime_arguments == [] and constants[0].key != constants[1].key
    assert constants[0].key != calls[0].key


def test_a_float_argument_is_compiled_in_a_scalar_one_is_not():
    """export gives a runtime number as a SymFloat, which a ``float`` refuses."""
    x, w = zeros(2, 8), zeros(8)
    layer_norm = signature(A.native_layer_norm.default, x, [8], w, w, 1e-5)
    leaky_relu = signature(A.leaky_relu.default, x, 0.2)
    assert layer_norm.runtime_arguments == [] and leaky_relu.runtime_arguments == [1]


def test_a_number_that_picks_the_computation_is_compiled_in():
    """x ** 3.0 is two multiplies only with its exponent compiled in."""
    x = zeros(2, 8)
    assert signature(A.pow.Tensor_Scalar, x, 3.0).runtime_arguments == []
    assert signature(A.linalg_vector_norm.default, x, 2.0).runtime_arguments == []
    assert signature(A._foreach_pow.ScalarList, [x, x], [2.0, 3.0]).runtime_arguments == []
    assert signature(A.clamp.default, x, 0.5).runtime_arguments == [1]


def test_other_numbers_change_the_values_not_the_key():
    call = signature(A.add.Tensor, zeros(4), zeros(4), 0.5)
    other = call.with_other_numbers()
    assert other.args[2] == other.described[2].number.value == 0.375
    assert other.key == call.key


def test_an_int_is_a_runtime_number_only_when_asked_and_positive():
    call = signature(A.ge.Scalar, zeros(4), 3)
    assert call.runtime_arguments == [] and call.int_arguments == {1: 3}
    runtime = call.with_runtime_ints([1])
    assert runtime.runtime_arguments == [1] and runtime.described[1] == RuntimeNumberArg(NumberArg(3))
    assert runtime.to_json()[1] == {"name": "other", "kind": "int", "value": 3, "runtime": True}
    assert tuple(argument_from_json(d) for d in runtime.to_json()) == runtime.described
    assert runtime.key != call.key and runtime.shape_key == call.shape_key
    assert [runtime.with_other_numbers().args[1], runtime.with_other_numbers(lower=True).args[1]] == [4, 2]
    assert runtime.with_other_numbers().key == runtime.key
    for value in (0, -2):  # errors or cases of their own in eager: compiled in
        assert not signature(A.ge.Scalar, zeros(4), value).can_take_runtime_ints([1])
    assert signature(A.ge.Scalar, zeros(4), 3.0).int_arguments == {}  # a float is one already
    assert signature(A.mul.Tensor, zeros(4), 3).int_arguments == {}  # a wrapped number, not an int argument
    assert signature(A._softmax.default, zeros(4), 0, False).int_arguments == {1: 0}  # whether it traces is export's to say
    with pytest.raises(ValueError, match="aten::ge.Scalar: arguments \\[0\\]"):
        call.with_runtime_ints([0])


def test_copies_of_the_arguments_keep_their_layout_and_share_no_memory():
    storage = torch.arange(20.0)
    args = [storage[1:13].view(4, 3).t(), [storage[:4], storage[4:8]], 2.5, None]
    copies = clone_args(args)
    assert copies[2:] == [2.5, None] and isinstance(copies[1], list)
    for original, copy in zip([args[0], *args[1]], [copies[0], *copies[1]]):
        assert (copy.shape, copy.stride(), copy.storage_offset()) == (original.shape, original.stride(), original.storage_offset())
        assert copy.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
        torch.testing.assert_close(copy, original)
