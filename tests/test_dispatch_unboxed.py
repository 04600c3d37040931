"""The unboxed overrides of addmm-like, gelu, native_layer_norm and softmax
ops (csrc/op_override.cpp: register_override): a call's unboxed key is the
one its boxed miss stored the decision under, word for word, and a call of a
signature decided eager runs the original kernel."""

from __future__ import annotations

import pytest
import torch

import aoti_eager
from aoti_eager import _overrides
from aoti_eager.kernels import CompileError
from helpers import assert_same_as_eager

A = torch.ops.aten
F = torch.nn.functional

x, m, b = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
v4, v8 = torch.randn(4), torch.randn(8)
batch1, batch2, batch_in = torch.randn(2, 4, 3), torch.randn(2, 3, 8), torch.randn(2, 4, 8)
w = torch.randn(8)

# name: (overload, call(self, out)), `self` a fresh copy of x for in-place
# forms. Floats given for Scalar arguments are runtime numbers.
CASES = {
    "addmm": ("aten::addmm.default", lambda s, out: torch.addmm(b, x, m)),
    "addmm beta=0.5 alpha=2": ("aten::addmm.default", lambda s, out: torch.addmm(b, x, m, beta=0.5, alpha=2)),
    "addmm_": ("aten::addmm_", lambda s, out: s.addmm_(x, m, alpha=3)),
    "addmm out": ("aten::addmm.out", lambda s, out: torch.addmm(b, x, m, out=out)),
    "baddbmm": ("aten::baddbmm.default", lambda s, out: torch.baddbmm(batch_in, batch1, batch2, beta=2)),
    "addmv": ("aten::addmv.default", lambda s, out: torch.addmv(v4, x, v8, alpha=0.5)),
    "addr": ("aten::addr.default", lambda s, out: torch.addr(s, v4, v8, beta=0.25)),
    "addbmm": ("aten::addbmm.default", lambda s, out: torch.addbmm(s, batch1, batch2)),
    "gelu": ("aten::gelu.default", lambda s, out: F.gelu(x)),
    "gelu tanh": ("aten::gelu.default", lambda s, out: F.gelu(x, approximate="tanh")),
    "gelu_": ("aten::gelu_", lambda s, out: A.gelu_(s, approximate="tanh")),
    "gelu out": ("aten::gelu.out", lambda s, out: A.gelu.out(x, out=out)),
    "native_layer_norm": ("aten::native_layer_norm.default", lambda s, out: torch.native_layer_norm(x, [8], w, b, 1e-5)),
    "layer_norm, no weight": ("aten::native_layer_norm.default", lambda s, out: F.layer_norm(batch_in, [4, 8], eps=1e-3)),
    "_softmax": ("aten::_softmax.default", lambda s, out: torch.softmax(x, 1)),
    "_log_softmax": ("aten::_log_softmax.default", lambda s, out: torch.log_softmax(batch_in, -1)),
}


def calls(case: str, count: int) -> list[tuple[object, list[bool]]]:
    """``count`` calls of the case: each result, and which of the call's
    own arguments (self, out) it is."""
    fn = CASES[case][1]
    results = []
    for _ in range(count):
        arguments = (x.clone(), torch.empty(4, 8))
        result = fn(*arguments)
        results.append((result, [result is a for a in arguments]))
    return results


def counters(op: str) -> dict[str, int]:
    (override,) = [o for o in _overrides.installed() if o.name == op.removesuffix(".default")]
    assert override.handle.unboxed, f"{op} is overridden boxed"
    return override.handle.counters()


@pytest.mark.parametrize("case", list(CASES))
def test_a_miss_is_boxed_and_the_next_calls_hit_unboxed(case, shared_cache):
    op = CASES[case][0]
    (expected, expected_identity), = calls(case, 1)
    with aoti_eager.enabled([op], devices=["cpu"], cache_dir=shared_cache):
        results = calls(case, 3)  # compile (or load), then hits
        counted = counters(op)
    for result, identity in results:
        assert_same_as_eager(result, expected)
        assert identity == expected_identity
    # Only the miss took the boxed path: the unboxed calls found its decision.
    assert (counted["misses"], counted["boxed_calls"], counted["hits"], counted["eager_calls"]) == (1, 1, 2, 0), counted


@pytest.mark.parametrize("case", ["addmm beta=0.5 alpha=2", "addmm out", "gelu_", "native_layer_norm", "_softmax"])
def test_a_signature_decided_eager_runs_the_original_kernel_unboxed(case, tmp_path, swap_compiler):
    swap_compiler(compile=lambda *a, **k: (_ for _ in ()).throw(CompileError("no kernel")))
    op = CASES[case][0]
    (expected, expected_identity), = calls(case, 1)
    with aoti_eager.enabled([op], devices=["cpu"], cache_dir=tmp_path):
        results = calls(case, 3)
        counted = counters(op)
    for result, identity in results:
        assert_same_as_eager(result, expected, atol=0, rtol=0)  # eager ran: its exact result
        assert identity == expected_identity
    assert (counted["calls"], counted["boxed_calls"], counted["hits"], counted["eager_calls"]) == (3, 1, 0, 3), counted


def test_native_layer_norm_returns_the_kernels_three_outputs(shared_cache):
    expected = torch.native_layer_norm(batch_in, [8], w, None, 1e-5)
    with aoti_eager.enabled(["aten::native_layer_norm.default"], devices=["cpu"], cache_dir=shared_cache):
        results = [torch.native_layer_norm(batch_in, [8], w, None, 1e-5) for _ in range(3)]
        counted = counters("aten::native_layer_norm.default")
    for result in results:
        assert isinstance(result, tuple) and len(result) == 3
        assert_same_as_eager(result, expected)  # output, mean, rstd
    assert (counted["hits"], counted["boxed_calls"]) == (2, 1), counted


@pytest.mark.parametrize(
    "op, first, second",
    [
        ("aten::gelu.default", lambda: F.gelu(x, approximate="none"), lambda: F.gelu(x, approximate="tanh")),
        # The same tensor, normalized over its last dim or its last two.
        (
            "aten::native_layer_norm.default",
            lambda: torch.native_layer_norm(batch_in, [8], None, None, 1e-5),
            lambda: torch.native_layer_norm(batch_in, [4, 8], None, None, 1e-5),
        ),
    ],
    ids=["gelu approximate", "layer_norm normalized_shape"],
)
def test_calls_that_differ_in_a_string_or_int_list_have_different_keys(op, first, second, shared_cache):
    expected = [first(), second()]
    with aoti_eager.enabled([op], devices=["cpu"], cache_dir=shared_cache):
        results = [(first(), second()) for _ in range(3)]
        counted = counters(op)
    for got in results:
        assert_same_as_eager(list(got), expected)
    assert (counted["misses"], counted["boxed_calls"], counted["hits"]) == (2, 2, 4), counted
