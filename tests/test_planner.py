"""The planner's decisions (aoti_eager/_planner.py), asked directly: it is
told what the runtime learned of an op's calls, and answers with the kernel
to compile, an eager verdict or the keys to look up. No cache, no compile,
no monkeypatching."""

from __future__ import annotations

import json

import pytest
import torch

import aoti_eager  # noqa: F401 - gives kernels/ its wrapped-number test
from aoti_eager import settings
from aoti_eager._decisions import RunEagerly, UseKernel
from aoti_eager._planner import Eager, Planner
from aoti_eager.kernels import CallSignature, CompileRequest
from aoti_eager.kernels.dynamic import ShapeFamily, family_key, family_limit_key
from helpers import compiled

A = torch.ops.aten


def abs_of(*sizes: int, strides: tuple[int, ...] | None = None) -> CallSignature:
    x = torch.randn(*sizes) if strides is None else torch.empty_strided(sizes, strides)
    return CallSignature.of(A.abs.default, "cpu", [x])


def add_of(rows: int, alpha: int = 1) -> CallSignature:
    return CallSignature.of(A.add.Tensor, "cpu", [torch.randn(rows, 8), torch.randn(rows, 8), alpha])


def arange_to(end: int) -> CallSignature:
    return CallSignature.of(A.arange.default, "cpu", [end, None, None, torch.device("cpu"), None])


def test_a_familys_first_shape_compiles_a_static_kernel():
    call = abs_of(8, 4)
    request = compiled(Planner(), call)
    assert (request.op, request.device, request.key, request.family) == ("aten::abs", "cpu", call.key, None)
    assert request.signature == call.to_json()


def test_the_second_shape_compiles_a_kernel_of_the_dims_that_moved_with_the_sizes_seen():
    planner = Planner()
    compiled(planner, abs_of(8, 4))
    second = abs_of(12, 4)
    request = compiled(planner, second)
    assert request.family == ShapeFamily(((0,),))
    assert request.key == request.family.entry_key(second) != second.key
    assert request.seen == [[8, 12]]


def test_a_shape_seen_again_compiles_alone():
    planner = Planner()
    compiled(planner, abs_of(8, 4))
    assert compiled(planner, abs_of(8, 4)).family is None


def test_where_only_strides_moved_the_kernel_is_general():
    planner = Planner()
    compiled(planner, abs_of(4, 8))
    sliced = abs_of(4, 8, strides=(16, 1))
    request = compiled(planner, sliced)
    assert request.family is not None and request.family.general and request.family.dims == ((0, 1),)


def test_a_broadcast_dim_that_grew_from_one_makes_the_kernel_general():
    planner = Planner()
    compiled(planner, CallSignature.of(A.add.Tensor, "cpu", [torch.randn(4, 8), torch.randn(1, 8)]))
    request = compiled(planner, CallSignature.of(A.add.Tensor, "cpu", [torch.randn(4, 8), torch.randn(4, 8)]))
    assert request.family.general and request.family.dims == ((0, 1), (0, 1))


def test_after_a_dynamic_kernel_a_further_widening_is_general():
    planner = Planner()
    compiled(planner, abs_of(8, 4))
    second = abs_of(12, 4)
    dynamic = compiled(planner, second).family
    planner.family(second).published[dynamic.entry_key(second)] = dynamic  # published: its guards refuse (12, 9)
    request = compiled(planner, abs_of(12, 9))
    assert request.family.general and request.family.dims == ((0, 1),)


def test_a_new_family_of_dtypes_and_ranks_that_compiled_elsewhere_starts_general():
    planner = Planner()
    compiled(planner, add_of(4, alpha=1))
    other = add_of(4, alpha=2)
    assert family_key(other) != family_key(add_of(4, alpha=1))
    assert compiled(planner, other).family.general


def test_a_family_whose_dynamic_kernel_failed_compiles_each_shape_alone():
    planner = Planner()
    first = abs_of(8, 4)
    compiled(planner, first)
    planner.compiled(abs_of(12, 4), "export fixed a size", kernel=True)
    assert compiled(planner, abs_of(16, 4)).family is None


def test_without_dynamic_shapes_every_shape_compiles_alone():
    planner = Planner()
    with settings.dynamic_shapes.set_to("0"):
        compiled(planner, abs_of(8, 4))
        assert compiled(planner, abs_of(12, 4)).family is None


def test_past_the_shape_compile_limit_the_whole_family_runs_eagerly():
    planner = Planner()
    with settings.max_shape_compiles.set_to("2"):
        compiled(planner, abs_of(8, 4))
        compiled(planner, abs_of(12, 4))
        third = abs_of(16, 4)
        verdict = planner.to_compile(third)
    assert verdict == Eager(verdict.reason, "family", record=family_limit_key(third))
    assert "AOTI_EAGER_MAX_SHAPE_COMPILES=2" in verdict.reason
    assert planner.eager(third, verdict).dynamic == ShapeFamily.any_shape(third)


def test_past_the_value_variant_limit_further_values_run_eagerly():
    planner = Planner()
    with settings.max_value_variants.set_to("2"):
        assert planner.count_variant(add_of(4, alpha=1)) is None
        assert planner.count_variant(add_of(4, alpha=2)) is None
        third = add_of(4, alpha=3)
        verdict = planner.count_variant(third)
    assert verdict == Eager(verdict.reason, "values", record=third.values_key)
    assert planner.eager(third, verdict).numbers == tuple(third.number_positions)


def test_an_int_compiled_in_until_it_moves_then_taken_at_run_time():
    planner = Planner()
    first = arange_to(5)
    taken, lookups = planner.runtime_ints(first)
    # The first call looks for a kernel another process compiled with its end at run time.
    assert taken == frozenset() and [t for t, _, _ in lookups] == [frozenset({0})]
    _, key, prefix = lookups[0]
    assert key == first.with_runtime_ints([0]).key and prefix == family_key(first.with_runtime_ints([0])) + "-"
    second = arange_to(8)
    assert planner.runtime_ints(second) == (frozenset({0}), [])
    planner.ints_served(second, frozenset({0}), served=True)
    assert planner.runtime_ints(arange_to(5)) == (frozenset({0}), [])


def test_an_int_whose_runtime_kernel_failed_is_compiled_in():
    planner = Planner()
    planner.runtime_ints(arange_to(5))
    planner.ints_served(arange_to(8), frozenset({0}), served=False)
    assert planner.runtime_ints(arange_to(9)) == (frozenset(), [])


def test_an_int_another_process_took_at_run_time_is_taken_at_once():
    planner = Planner()
    first = arange_to(5)
    planner.runtime_ints(first)
    assert planner.ints_published(first, frozenset({0})) == frozenset({0})


def test_numbers_are_compiled_in_where_no_kernel_takes_them_unless_eager_is_faster():
    planner = Planner()
    call = arange_to(8).with_runtime_ints([0])
    eager = RunEagerly("export failed")
    assert planner.falls_back(eager, call, compiles=True)
    assert not planner.falls_back(eager, call, compiles=False)
    assert not planner.falls_back(RunEagerly("x", numbers=(0,)), call, compiles=True)
    assert not planner.falls_back(eager, arange_to(8), compiles=True)  # no runtime numbers
    assert planner.eager_is_faster(call, "eager is faster").numbers == (0,)
    assert not planner.falls_back(eager, call, compiles=True)


def test_a_dynamic_kernel_is_judged_once_per_range_of_sizes():
    planner = Planner()
    kernel = object()
    dynamic = ShapeFamily(((0,),), guards=((0, 0, 0, 0),), ranges=((2, 1 << 20),))
    small, same_range, large = abs_of(5, 4), abs_of(6, 4), abs_of(300, 4)
    judged: list = []

    def judge(k) -> str | None:
        judged.append(k)
        return "eager is faster at these sizes" if len(judged) == 2 else None

    use = UseKernel(kernel, dynamic)
    key = dynamic.entry_key(small)
    with settings.keep_faster.set_to("1"):
        assert planner.use_dynamic(small, key, dynamic, use, judge) == UseKernel(kernel, dynamic, per_range=True)
        assert planner.use_dynamic(same_range, key, dynamic, use, judge).kernel is kernel
        eager = planner.use_dynamic(large, key, dynamic, use, judge)
        assert eager == RunEagerly("eager is faster at these sizes", dynamic, judged=kernel)
        assert planner.use_dynamic(abs_of(301, 4), key, dynamic, use, judge) == eager
    assert judged == [kernel, kernel]
    assert planner.family(small).decisions[key] is use


def test_a_dynamic_kernel_timed_when_it_was_published_is_not_judged_again_there():
    planner = Planner()
    dynamic = ShapeFamily(((0,),), guards=((0, 0, 0, 0),), ranges=((2, 1 << 20),))
    call = abs_of(5, 4)
    planner.judged_at_compile(call, "k", dynamic, [(5, 4)])
    with settings.keep_faster.set_to("1"):
        assert planner.use_dynamic(call, "k", dynamic, UseKernel(object(), dynamic), judge=pytest.fail).per_range


def test_without_timing_a_dynamic_kernel_serves_every_range():
    planner = Planner()
    dynamic = ShapeFamily(((0,),), guards=((0, 0, 0, 0),), ranges=((2, 1 << 20),))
    use = UseKernel(object(), dynamic)
    with settings.keep_faster.set_to("0"):
        assert planner.use_dynamic(abs_of(5, 4), "k", dynamic, use, judge=pytest.fail) is use


def test_recorded_verdicts_are_looked_up_for_every_value_then_for_the_family():
    call = add_of(4)
    assert Planner.verdict_keys(call) == [(call.values_key, "values"), (family_limit_key(call), "family")]
    assert Planner.verdict_keys(call, of_family=False) == [(call.values_key, "values")]


def test_a_request_goes_through_json_as_a_manifest_line():
    planner = Planner()
    compiled(planner, abs_of(8, 4))
    request = planner.request(abs_of(12, 4))
    line = json.loads(json.dumps(request.to_json()))
    assert line["dynamic"] == {"dims": [[0]], "seen": [[8, 12]], "general": False}
    assert CompileRequest.from_json(line) == request


def test_a_manifest_line_of_earlier_versions_is_read():
    call = arange_to(8).with_runtime_ints([0])
    for line in ({"op": "aten::arange", "device": "cpu", "key": call.key, "signature": call.to_json()},
                 {"op": "aten::arange", "device": "cpu", "key": call.key, "signature": call.to_json(), "dynamic": None}):
        request = CompileRequest.from_json(line)
        assert (request.family, request.runtime_ints) == (None, [0])
        assert request.to_json() == {k: v for k, v in line.items() if k != "dynamic"}
    with pytest.raises(ValueError, match="unknown fields"):
        CompileRequest.from_json({**line, "shape": []})
