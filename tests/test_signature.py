"""Call signatures: their keys and their JSON form."""

from __future__ import annotations

import json

import pytest
import torch

from aoti_eager.kernels.signature import CallSignature

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
