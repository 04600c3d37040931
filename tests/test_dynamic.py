"""kernels/dynamic.py and the dynamic-shape path: one kernel for the sizes
that move, and never a call run by a kernel that was not compiled for it
(sizes 0 and 1, broadcasting, equal dims, contiguity)."""

from __future__ import annotations

import pytest
import torch

import aoti_eager
from aoti_eager import _overrides
from aoti_eager.cli import main
from aoti_eager.cache import KernelCache
from aoti_eager.kernels.compile import compile_options
from aoti_eager.kernels.dynamic import MAX_NUMEL, UNBOUNDED, ShapeFamily, changed_dims, family_key, layout_order, tensor_args
from aoti_eager.kernels.signature import CallSignature
from aoti_eager.kernels.toolchain import environment_name
from conftest import DEVICES
from helpers import assert_same_as_eager, run_shapes

A = torch.ops.aten


def signature(op, *args) -> CallSignature:
    return CallSignature.of(op, "cpu", list(args))


# -- shape families, without compiling ---------------------------------------------------------

def test_a_family_is_everything_but_sizes():
    def add(x, y, alpha=1):
        return family_key(signature(A.add.Tensor, x, y, alpha))

    base = add(torch.randn(5, 8), torch.randn(8))
    assert base == add(torch.randn(9, 8), torch.randn(3))
    assert base != add(torch.randn(5, 8, dtype=torch.float64), torch.randn(8))
    assert base != add(torch.randn(5, 8, 1), torch.randn(8))  # rank
    assert base != add(torch.randn(8, 5).t(), torch.randn(8))  # the order of dims in memory
    assert base == add(torch.randn(5, 16)[:, :8], torch.randn(8))  # a slice keeps it
    assert base == add(torch.randn(8).expand(5, 8), torch.randn(8))  # so does a broadcast
    assert base != add(torch.randn(5, 8), torch.randn(8), alpha=2)


def test_only_dims_that_changed_to_two_or_more_become_dynamic():
    call = signature(A.add.Tensor, torch.randn(9, 8), torch.randn(1))
    assert changed_dims(call, [[(5, 8), (8,)]]) == ((0,), ())  # the other tensor's 8 -> 1: export would specialize 1
    assert changed_dims(call, [[(9, 8), (1,)]]) == ((), ())


ADD = ShapeFamily(dims=((0,), (0,)), guards=((0, 0, 0, 0), (1, 0, 0, 0)), ranges=((2, UNBOUNDED),))


@pytest.mark.parametrize("x, y, admitted", [
    ((9, 8), (9, 8), True),
    ((300, 8), (300, 8), True),
    ((9, 8), (7, 8), False),  # one symbol: the dims are equal
    ((9, 8), (1, 8), False),  # broadcasting: export specialized 1
    ((1, 8), (1, 8), False),  # below the range
    ((0, 8), (0, 8), False),
    ((9, 4), (9, 4), False),  # a fixed dim: another family key
])
def test_guards_admit_only_calls_the_kernel_was_compiled_for(x, y, admitted):
    compiled_for = signature(A.add.Tensor, torch.randn(5, 8), torch.randn(5, 8))
    key = ADD.entry_key(compiled_for)
    assert ADD.admits(signature(A.add.Tensor, torch.randn(x), torch.randn(y)), key) == admitted


def test_a_specialized_dim_and_the_element_limit_are_guarded():
    family = ShapeFamily(dims=((0, 1),), guards=((0, 0, 0, 0), (0, 1, -1, 8)), ranges=((2, 100),))
    assert family.symbol_values_of_sizes([(9, 8)]) == {0: 9}
    assert family.symbol_values_of_sizes([(9, 9)]) is None
    assert family.symbol_values_of_sizes([(101, 8)]) is None
    wide = ShapeFamily(dims=((0,),), guards=((0, 0, 0, 0),), ranges=((2, UNBOUNDED),))
    assert wide.symbol_values_of_sizes([(MAX_NUMEL // 4 + 1, 4)]) is None


def test_strides_are_guarded_as_export_derived_them():
    # x[s0, 8] dense: its row stride is 8 (fixed); y[s0, s1]: its row stride is s1, read off dim 1.
    family = ShapeFamily(dims=((0,), (0, 1)), strides=((0, 0, 8, ()), (0, 1, 1, ()), (1, 0, 1, ((1, 1),)), (1, 1, 1, ())))
    admitted = lambda x, y: family.layout_admitted(tensor_args(signature(A.add.Tensor, x, y)))  # noqa: E731
    assert admitted(torch.randn(5, 8), torch.randn(5, 8))
    assert admitted(torch.randn(1, 8), torch.randn(5, 8)[:1])  # a size-1 dim's stride is never used
    assert not admitted(torch.randn(5, 16)[:, :8], torch.randn(5, 8))  # a slice: row stride 16
    assert not admitted(torch.randn(5, 8), torch.randn(8).expand(5, 8))  # a broadcast: row stride 0
    assert not admitted(torch.randn(8, 5).t(), torch.randn(5, 8))


def test_strides_read_at_run_time_keep_their_order():
    family = ShapeFamily(dims=((0, 1),), strides=((0, 1, 1, ()),), orders=((0, (0, 1)),))
    admitted = lambda x: family.layout_admitted(tensor_args(signature(A.abs.default, x)))  # noqa: E731
    assert admitted(torch.randn(5, 8)) and admitted(torch.randn(5, 16)[:, :8]) and admitted(torch.randn(8).expand(5, 8))
    assert not admitted(torch.randn(8, 5).t())  # another order
    assert not admitted(torch.randn(5, 16)[:, ::2])  # an innermost stride of 2


@pytest.mark.parametrize("sizes, strides, order", [
    ((4, 8), (8, 1), (0, 1)),
    ((4, 8), (0, 1), (0, 1)),  # a broadcast dim where its index puts it
    ((1, 8), (512, 1), (0, 1)),
    ((8, 4), (1, 8), (1, 0)),
    ((2, 3, 4), (12, 1, 3), (0, 2, 1)),
    ((2, 1, 4), (4, 4, 1), (0, 1, 2)),
])
def test_layout_order(sizes, strides, order):
    assert layout_order(sizes, strides) == order


def test_a_general_kernel_keeps_only_the_size_one_dims_that_broadcast():
    general = ShapeFamily.general_for(signature(A.add.Tensor, torch.randn(6, 5, 8), torch.randn(1, 5, 8)))
    assert general.general and general.dims == ((0, 1, 2), (1, 2))  # y's 1 broadcasts against 6
    general = ShapeFamily.general_for(signature(A.add.Tensor, torch.randn(2, 5, 8), torch.randn(1, 5, 8)))
    assert general.dims == ((0, 1, 2), (1, 2))  # at 2, y's 1 would add elementwise, not broadcast
    general = ShapeFamily.general_for(signature(A.add.Tensor, torch.randn(1, 8), torch.randn(1, 8)))
    assert general.dims == ((0, 1), (0, 1))  # at 2 rows both, or either, it still runs
    general = ShapeFamily.general_for(signature(A.embedding.default, torch.randn(64, 8), torch.arange(9)[None]))
    assert general.dims == ((0, 1), (0, 1))  # a batch of one row of positions
    assert ShapeFamily.general_for(CallSignature.of(A.arange.default, "cpu", [7])).dims == ()


def test_a_family_round_trips_through_json():
    assert ShapeFamily.from_json(ADD.to_json()) == ADD
    assert ADD.dim_bits == [1, 1]


def test_a_span_of_sizes_seen_gives_back_calls_at_its_ends():
    # What a manifest records of a dynamic kernel's dims, and the calls a worker replays from it.
    family = ShapeFamily(dims=((0, 1), (0,)))
    call = signature(A.add.Tensor, torch.randn(9, 24), torch.randn(24), 2)
    span = family.size_span(call, [[(5, 16), (16,)], [(17, 16), (16,)]])
    assert span == [[5, 17], [16, 24], [16, 24]]
    ends = family.span_ends(call, span)
    shapes = [[t.sizes for t in tensor_args(end)] for end in ends]
    assert shapes == [[(5, 16), (16,)], [(17, 24), (24,)]]
    assert changed_dims(call, shapes) == family.dims
    assert [end.args[2] for end in ends] == [2, 2] and all(end.args[0].is_contiguous() for end in ends)
    # A call at an end of the span is not one of the shapes it saw.
    (end,) = family.span_ends(call, [[9, 12], [24, 24], [24, 24]])
    assert [t.sizes for t in tensor_args(end)] == [(12, 24), (24,)]


def test_export_gives_equal_dims_one_symbol():
    call = signature(A.mm.default, torch.randn(6, 7), torch.randn(7, 3))
    family = ShapeFamily(dims=((0, 1), (0,)))
    exported = torch.export.export(
        _Mm(), tuple(t for t in call.args), dynamic_shapes=family.export_shapes(call), strict=False
    )
    inputs = [n.meta["val"] for n in exported.graph.nodes if n.op == "placeholder"]
    guarded = family.with_guards(call, [t.shape for t in inputs], [t.stride() for t in inputs], dict(exported.range_constraints))
    assert guarded.guards == ((0, 0, 0, 0), (0, 1, 1, 0), (1, 0, 1, 0))
    assert guarded.ranges == ((2, UNBOUNDED), (2, UNBOUNDED))
    # x's row stride is its dim 1 (s1); y's rows are 3 wide.
    assert guarded.strides == ((0, 0, 1, ((0, 1),)), (0, 1, 1, ()), (1, 0, 3, ()), (1, 1, 1, ()))
    assert [t.sizes for t in tensor_args(guarded.resized(call, {0: 4, 1: 11}))] == [(4, 11), (11, 3)]


class _Mm(torch.nn.Module):
    def forward(self, *tensors):
        return (A.mm.default(*tensors),)


# -- through the runtime ------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_a_second_shape_compiles_one_kernel_that_serves_later_shapes(tmp_path, device, capsys):
    def make(n):
        return torch.randn(n, 16, device=device), torch.randn(16, device=device)

    compiles, stats = run_shapes("aten::add.Tensor", tmp_path, torch.add, [5, 9, 17, 33, 2, 1, 0, 64], make, device)
    # 5: static; 9: dynamic; 17, 33, 2, 1, 64: the dynamic kernel (checked at 1 before
    # it was published); 0 rows: a kernel of its own.
    assert compiles == [1, 1, 0, 0, 0, 0, 1, 0]
    assert stats["hits"] == 5 and stats["fallbacks"] == 0

    # A new process finds the dynamic kernel in the cache: no compile for a new size.
    _overrides.forget()
    compiles, stats = run_shapes("aten::add.Tensor", tmp_path, torch.add, [21, 3], make, device)
    assert compiles == [0, 0] and stats["cache_loads"] == 1 and stats["hits"] == 1

    listed = KernelCache(tmp_path, environment_name(torch.device(device), compile_options(device)))
    dynamic = [listed.lookup(op, key).dynamic for op, key in listed.entries("aten::add.Tensor")]
    assert [d for d in dynamic if d] == [{
        "format": 2, "dims": [[0], []], "guards": [[0, 0, 0, 0]], "ranges": [[1, UNBOUNDED]],
        "strides": [[0, 0, 16, []], [0, 1, 1, []]], "orders": [], "general": False,
    }]
    main(["--cache-dir", str(tmp_path), "cache", "list", "--op", "aten::add.Tensor"])
    assert "(self=float32[s0, 16], other=float32[16], alpha=1; s0 in [1, inf])" in capsys.readouterr().out


@pytest.mark.parametrize("device", DEVICES)
def test_a_dynamic_kernel_gives_eagers_strides_at_every_size(tmp_path, device):
    # A KV cache's first keys at several prompt lengths: the input is transposed,
    # eager's output contiguous (symbolic strides in the kernel).
    def prompt(n):
        return [torch.tensor([], device=device), torch.randn(1, n, 3, 4, device=device).transpose(1, 2)], -2

    compiles, stats = run_shapes("aten::cat", tmp_path, torch.cat, [5, 9, 17, 2], prompt, device)
    assert compiles == [1, 1, 0, 0] and stats["hits"] == 2 and stats["fallbacks"] == 0


def test_equal_dims_and_broadcasting_never_reach_a_kernel_not_compiled_for_them(tmp_path):
    same = lambda n: (torch.randn(n, 8), torch.randn(n, 8))  # noqa: E731
    compiles, _ = run_shapes("aten::mul.Tensor", tmp_path, torch.mul, [5, 9, 12], same)
    assert compiles == [1, 1, 0]
    # x's dim 0 and y's were one symbol: y of 1 row (broadcast) or of another count is not that kernel's.
    compiles, _ = run_shapes("aten::mul.Tensor", tmp_path, torch.mul, [(7, 1), (6, 1)], lambda s: (torch.randn(s[0], 8), torch.randn(s[1], 8)))
    assert compiles[0] == 1


def test_a_dim_that_moves_later_widens_the_kernel(tmp_path):
    compiles, _ = run_shapes(
        "aten::sub.Tensor", tmp_path, torch.sub, [(5, 16), (9, 16), (9, 24), (13, 40), (3, 7)],
        lambda s: (torch.randn(*s), torch.randn(s[1])),
    )
    assert compiles == [1, 1, 1, 0, 0]


def test_compiles_per_shape_family_are_bounded(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AOTI_EAGER_MAX_SHAPE_COMPILES", "1")
    monkeypatch.setenv("AOTI_EAGER_DYNAMIC_SHAPES", "0")
    compiles, stats = run_shapes("aten::abs", tmp_path, torch.abs, [4, 6, 8], lambda n: (torch.randn(n),))
    assert compiles == [1, 0, 0] and stats["fallbacks"] == 2
    assert stats["misses"] == 2  # the family is eager as a whole: 8 does not ask Python again
    assert "AOTI_EAGER_MAX_SHAPE_COMPILES=1" in stats["fallback_reason"]


def test_a_size_one_dims_stride_does_not_make_a_new_signature(tmp_path):
    # x[:, -1:] of a growing x: one row, one column, a new stride each length;
    # and a column whose size-1 dim has a new stride each time.
    last = lambda n: (torch.randn(1, n)[:, -1:], torch.randn(3).as_strided((3, 1), (1, n)))  # noqa: E731
    assert last(5)[0].stride() != last(9)[0].stride()
    assert signature(A.add.Tensor, *last(5)).key == signature(A.add.Tensor, *last(9)).key
    compiles, stats = run_shapes("aten::add.Tensor", tmp_path, torch.add, [5, 9, 17], last)
    assert compiles == [1, 0, 0] and stats["misses"] == 1


def test_a_shape_the_dynamic_kernel_refuses_widens_it_to_a_general_one(tmp_path):
    # A model's linear layers: weights of several widths at the prompt's 16 rows, then at one row.
    shapes = [(16, 12), (16, 20), (1, 12), (1, 28), (1, 36)]
    compiles, _ = run_shapes("aten::mm", tmp_path, torch.mm, shapes, lambda s: (torch.randn(s[0], 8), torch.randn(8, s[1])))
    assert compiles == [1, 1, 1, 0, 0]


def test_one_general_kernel_serves_every_width_slice_broadcast_and_batch_of_one(tmp_path):
    # BERT's linear layers (weights of three shapes, transposed), its pooler (the
    # first token of each row: a slice) and batches of one: three kernels.
    weights = {(32, 32): torch.randn(32, 32), (32, 64): torch.randn(64, 32), (64, 32): torch.randn(32, 64)}

    def linear(shape):
        (inputs, outputs), rows, pooled = shape
        x = torch.randn(rows, 3, inputs)[:, 0] if pooled else torch.randn(rows, inputs)
        return torch.randn(outputs), x, weights[inputs, outputs].t()

    shapes = [((32, 32), 30, False), ((32, 64), 30, False), ((64, 32), 30, False), ((32, 32), 3, True),
              ((32, 32), 50, False), ((64, 32), 1, False), ((32, 32), 7, True), ((32, 32), 1, True)]
    compiles, stats = run_shapes("aten::addmm", tmp_path, torch.addmm, shapes, linear)
    assert compiles == [1, 1, 1, 0, 0, 0, 0, 0] and stats["fallbacks"] == 0
    # Word ids, then indices expanded from one row (token types) at the same sizes:
    # only strides changed, so the second kernel is general and serves the rest.
    table = torch.randn(100, 16)
    indices = [torch.randint(0, 100, (4, 9)), torch.zeros(1, 9, dtype=torch.long).expand(4, 9),
               torch.randint(0, 100, (6, 5)), torch.zeros(1, 12, dtype=torch.long).expand(3, 12), torch.arange(7)[None]]
    compiles, _ = run_shapes("aten::embedding", tmp_path, torch.nn.functional.embedding, indices, lambda i: (i, table))
    assert compiles == [1, 1, 0, 0, 0]


def test_a_general_kernel_keeps_a_broadcast_dim_of_one(tmp_path):
    # BERT's position embeddings, one row for the whole batch: export is tried with that
    # dim at 2, which cannot broadcast, then with it at 1, where it stays.
    compiles, _ = run_shapes("aten::add.Tensor", tmp_path, torch.add, [(4, 5), (6, 5), (6, 7), (3, 9), (1, 4)],
                             lambda s: (torch.randn(s[0], s[1], 8), torch.randn(1, s[1], 8)))
    assert compiles == [1, 1, 1, 0, 0]


def test_a_dim_of_one_that_broadcasts_against_two_stays_one_in_the_general_kernel(tmp_path):
    # BERT's embeddings: word and token-type rows added, then the position row, one for the batch.
    shapes = [(2, 2), (2, 1), (3, 1), (5, 1)]
    compiles, stats = run_shapes("aten::add.Tensor", tmp_path, torch.add, shapes,
                                 lambda s: (torch.randn(s[0], 5, 8), torch.randn(s[1], 5, 8)))
    assert compiles == [1, 1, 0, 0] and stats["fallbacks"] == 0


def test_a_dim_of_one_that_grows_to_its_partners_size_makes_the_kernel_general(tmp_path):
    # GPT-2's embeddings, then BERT's residual adds: a dynamic kernel of y's dim 0 alone
    # would not export (x's dim 0 did not move, so broadcasting fixes y's).
    shapes = [(4, 1), (4, 4), (6, 6), (9, 9)]
    compiles, stats = run_shapes("aten::add.Tensor", tmp_path, torch.add, shapes,
                                 lambda s: (torch.randn(s[0], 5, 8), torch.randn(s[1], 5, 8)))
    assert compiles == [1, 1, 0, 0] and stats["fallbacks"] == 0


def test_a_dim_a_list_of_ints_fixes_stays_that_size_in_the_general_kernel(tmp_path):
    # GPT-2's layer norms, then BERT's (another eps: a family of its own, so general):
    # normalized_shape is compiled in and fixes the last dim; the others move.
    weight, bias = torch.randn(16), torch.randn(16)
    calls = [((4, 8, 16), 1e-5), ((4, 8, 16), 1e-12), ((4, 11, 16), 1e-12), ((2, 5, 16), 1e-12), ((3, 5, 32), 1e-12)]
    compiles, results = [], []
    with aoti_eager.enabled(["aten::native_layer_norm"], devices=["cpu"], cache_dir=tmp_path):
        for shape, eps in calls:
            x = torch.randn(shape)
            w, b = (torch.randn(shape[-1]), torch.randn(shape[-1])) if shape[-1] != 16 else (weight, bias)
            before = aoti_eager.stats()["aten::native_layer_norm"]["compiles"]
            results.append((A.native_layer_norm(x, [shape[-1]], w, b, eps), (x, [shape[-1]], w, b, eps)))
            compiles.append(aoti_eager.stats()["aten::native_layer_norm"]["compiles"] - before)
    assert compiles == [1, 1, 0, 0, 1]  # 32 wide: a size the general kernel was not compiled for
    for outputs, args in results:
        for output, expected in zip(outputs, A.native_layer_norm(*args)):
            assert_same_as_eager(output, expected)


def test_strides_the_general_kernel_was_not_compiled_for_take_the_miss_path(tmp_path):
    # Compiled for rows in order (a slice included); a transposed input has eager's
    # other output layout, and an innermost stride of 2 another kernel.
    shapes = [(5, 8, "rows"), (9, 8, "rows"), (9, 16, "rows"), (7, 12, "slice"), (6, 10, "columns"), (4, 6, "every other")]

    def make(shape):
        rows, columns, layout = shape
        if layout == "columns":
            return torch.randn(columns, rows).t(), torch.randn(columns, rows).t()
        if layout == "every other":
            return torch.randn(rows, 2 * columns)[:, ::2], torch.randn(rows, columns)
        return torch.randn(rows, columns + 3)[:, :columns] if layout == "slice" else torch.randn(rows, columns), torch.randn(rows, columns)

    compiles, stats = run_shapes("aten::mul.Tensor", tmp_path, torch.mul, shapes, make)
    assert compiles[:4] == [1, 1, 1, 0] and compiles[4] == 1 and compiles[5] == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_further_shape_with_indices_out_of_its_range_is_not_run(tmp_path, device):
    # Two embedding tables (a model's tokens and positions): the kernel is checked at
    # the first table's size with the second call's indices, which are out of its
    # range. On a GPU, eager on those would be a device-side assert, not an error.
    def make(rows):
        return torch.randn(rows, 8, device=device), torch.randint(rows - 4, rows, (1, 4), device=device)

    compiles, stats = run_shapes("aten::embedding", tmp_path, torch.nn.functional.embedding, [64, 1000, 700],
                                 lambda rows: make(rows)[::-1], device)
    assert (compiles, stats["fallbacks"]) == ([1, 1, 0], 0), stats
