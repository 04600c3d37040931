"""Ints that move become kernel inputs: the first value of an int, or of an
item of an int list, compiles in, a second compiles one kernel that reads the
int at run time, and every later positive value runs it. Ints that export
cannot trace as numbers (a dim index) stay compiled in; zero and negative
values always do."""

from __future__ import annotations

import pytest
import torch

import aoti_eager
from aoti_eager import _overrides
from aoti_eager.cache import KernelCache
from aoti_eager.kernels.compile import compile_options
from aoti_eager.kernels.signature import CallSignature
from aoti_eager.kernels.toolchain import environment_name
from aoti_eager.manifest import read_manifest
from conftest import DEVICES, needs_cuda
from helpers import assert_same_as_eager, xfail_if_kernels_cannot_load

A = torch.ops.aten
ENDS = [5, 8, 3, 12, 2, 30]  # a batch size, a sequence length: arange(end) in a BERT forward
# The n of constant_pad_nd(mask, [0, n]), as a BERT forward pads its attention mask to a multiple of 8.
PADS = [3, 5, 1, 7, 2, 6, 0, 4, 3, 5]


def run(op_names: list[str], calls, cache_dir, device="cpu", **options):
    """``calls()`` with the ops enabled: its results, and the ops' stats."""
    with aoti_eager.enabled(op_names, devices=[device], cache_dir=cache_dir, **options):
        results = calls()
        stats = aoti_eager.stats()
        ints = {o.name: o.planner.ints for o in _overrides.installed()}
    for name in op_names:
        xfail_if_kernels_cannot_load(stats[name.removesuffix(".default")])
    return results, stats, ints


@pytest.fixture(scope="module")
def arange_run(tmp_path_factory):
    """arange at each of ENDS in a cache of its own, recorded into a manifest."""
    root = tmp_path_factory.mktemp("arange")
    manifest = root / "misses.jsonl"
    results, stats, _ = run(["aten::arange.default"], lambda: [torch.arange(n) for n in ENDS], root / "cache",
                            record=manifest)
    return root, manifest, results, stats["aten::arange"]


@needs_cuda
def test_cuda_arange_compiles_twice_for_every_end(tmp_path):
    results, stats, _ = run(["aten::arange.default"], lambda: [torch.arange(n, device="cuda") for n in ENDS], tmp_path,
                            device="cuda")
    for n, result in zip(ENDS, results):
        assert_same_as_eager(result, torch.arange(n, device="cuda"), atol=0, rtol=0)
    assert stats["aten::arange"]["compiles"] == 2 and stats["aten::arange"]["fallbacks"] == 0, stats


def test_arange_compiles_twice_for_every_end(arange_run):
    _, _, results, stats = arange_run
    for n, result in zip(ENDS, results):
        assert_same_as_eager(result, torch.arange(n), atol=0, rtol=0)
    # The first end compiled in, then one kernel that reads the end at run time.
    assert stats["compiles"] == 2 and stats["fallbacks"] == 0, stats
    # The first two ends ask Python; the kernel then serves every later end from C++.
    assert stats["misses"] == 2 and stats["hits"] == len(ENDS) - 2, stats


def test_a_recorded_runtime_int_prewarms_into_the_kernel_the_run_compiled(arange_run):
    root, manifest, _, _ = arange_run
    entries = read_manifest(manifest)
    assert [[d.get("runtime", False) for d in e.signature if d["name"] == "end"] for e in entries] == [[False], [True]]
    assert entries[1].signature[0] == {"name": "end", "kind": "int", "value": ENDS[1], "runtime": True}
    prewarmed = root / "prewarmed"
    report = aoti_eager.prewarm(manifest, jobs=1, devices=["cpu"], cache_dir=prewarmed)
    assert report.count("compiled") == 2 and not report.failed, [r.outcome for r in report.results]
    # Same keys as the run's: a process on the prewarmed cache compiles nothing.
    cache = KernelCache(prewarmed, environment_name(torch.device("cpu"), compile_options("cpu")))
    assert all(cache.lookup(e.op, e.key) is not None for e in entries)
    ends = [4, 40, 17]
    results, stats, _ = run(["aten::arange.default"], lambda: [torch.arange(n) for n in ends], prewarmed)
    for n, result in zip(ends, results):
        assert_same_as_eager(result, torch.arange(n), atol=0, rtol=0)
    # The cache's runtime-int kernel serves the first end too, though it is none the run had.
    assert (stats["aten::arange"]["compiles"], stats["aten::arange"]["cache_loads"]) == (0, 1), stats


def test_a_scalar_int_operand_is_read_at_run_time_and_zero_or_below_compiles_in(shared_cache):
    x = torch.randn(6, 5) * 4
    values = [1, 2, 3, 5, -2, 7, 0]

    def calls():
        return [torch.ge(x, v) for v in values]

    results, stats, ints = run(["aten::ge.Scalar"], calls, shared_cache)
    for v, result in zip(values, results):
        assert_same_as_eager(result, x >= v)
    row = stats["aten::ge.Scalar"]
    # 1 compiled in; 2 one kernel for 3, 5 and 7 too; -2 and 0 each compiled in.
    assert row["compiles"] + row["cache_loads"] == 4 and row["fallbacks"] == 0, row
    (known,) = ints["aten::ge.Scalar"].values()
    assert known.runtime == {1} and not known.constant


def test_an_int_used_as_a_dim_stays_compiled_in(shared_cache):
    x = torch.randn(4, 6, 5)
    dims = [1, 2, 1, 2]  # positive: 0 would compile in anyway
    results, stats, ints = run(["aten::_softmax"], lambda: [torch._softmax(x, d, False) for d in dims], shared_cache)
    for d, result in zip(dims, results):
        assert_same_as_eager(result, torch._softmax(x, d, False))
    row = stats["aten::_softmax"]
    # export cannot trace a dim read at run time: each dim compiles in, once.
    assert row["compiles"] + row["cache_loads"] == 2 and row["fallbacks"] == 0 and row["hits"] == 2, row
    (known,) = ints["aten::_softmax"].values()
    assert known.constant == {1} and not known.runtime


def test_a_value_the_kernels_runtime_check_refuses_runs_eagerly(shared_cache):
    x = torch.randn(10)
    ks = [3, 5, 10, 7]

    def calls():
        results = [torch.topk(x, k) for k in ks]
        with pytest.raises(RuntimeError) as error:
            torch.topk(x, 11)  # past the size: the kernel's check refuses it, eager raises its own error
        results.append(torch.topk(x, 4))
        return results, str(error.value)

    (results, said), stats, _ = run(["aten::topk"], calls, shared_cache)
    for k, result in zip([*ks, 4], results):
        assert_same_as_eager(tuple(result), tuple(torch.topk(x, k)))
    with pytest.raises(RuntimeError) as eager_error:
        torch.topk(x, 11)
    assert said == str(eager_error.value)
    row = stats["aten::topk"]
    assert row["compiles"] + row["cache_loads"] == 2, row


def test_a_runtime_int_signature_is_keyed_without_its_value():
    calls = [CallSignature.of(A.arange.default, "cpu", [n, None, None, torch.device("cpu"), False]) for n in (7, 9)]
    runtime = [c.with_runtime_ints([0]) for c in calls]
    assert calls[0].key != calls[1].key and runtime[0].key == runtime[1].key
    assert runtime[0].shape_key == calls[0].shape_key  # one count of compiles for every value


def pad_calls(mask: torch.Tensor, pads: list[int]):
    return lambda: [torch.constant_pad_nd(mask, [0, n]) for n in pads]


def assert_pads_as_eager(mask: torch.Tensor, pads: list[int], results: list[torch.Tensor]) -> None:
    for n, result in zip(pads, results, strict=True):
        assert_same_as_eager(result, torch.constant_pad_nd(mask, [0, n]), atol=0, rtol=0)


@pytest.fixture(scope="module")
def pad_run(tmp_path_factory):
    """constant_pad_nd at each of PADS in a cache of its own, recorded into a manifest."""
    root = tmp_path_factory.mktemp("pad")
    manifest = root / "misses.jsonl"
    mask = torch.randn(2, 1, 1, 9)
    results, stats, ints = run(["aten::constant_pad_nd"], pad_calls(mask, PADS), root / "cache", record=manifest)
    return root, manifest, mask, results, stats["aten::constant_pad_nd"], ints["aten::constant_pad_nd"]


def test_a_moving_item_of_an_int_list_compiles_one_kernel_for_every_positive_value(pad_run):
    _, _, mask, results, stats, ints = pad_run
    assert_pads_as_eager(mask, PADS, results)
    # [0, 3] compiled in, then one kernel that reads n at run time; [0, 0] compiled in (0 is never an input).
    assert stats["compiles"] == 3 and stats["fallbacks"] == 0, stats
    # Python is asked at [0, 3], [0, 5] and [0, 0]: the kernel serves every other positive n from C++.
    assert stats["misses"] == 3 and stats["hits"] == len(PADS) - 3, stats
    (known,) = ints.values()
    assert known.runtime == {(1, 1)} and not known.constant  # the 0 that does not move stays compiled in


# (batch, length) of attention masks that scaled_dot_product_attention pads
# to a multiple of 8 along the keys, as in a BERT forward over variable batches.
MASKS = [(25, 105), (27, 13), (17, 73), (32, 59), (20, 69), (23, 82), (14, 72), (9, 44), (7, 87), (5, 123)]


@pytest.mark.parametrize("device", DEVICES)
def test_an_int_list_item_that_moves_with_the_sizes_is_read_at_run_time(device, tmp_path):
    masks = [torch.randn(b, 1, n, n, device=device) for b, n in MASKS]
    pads = [8 - n % 8 for _, n in MASKS]
    calls = lambda: [torch.constant_pad_nd(mask, [0, pad]) for mask, pad in zip(masks, pads)]
    results, stats, ints = run(["aten::constant_pad_nd"], calls, tmp_path, device=device)
    for mask, pad, result in zip(masks, pads, results, strict=True):
        assert_same_as_eager(result, torch.constant_pad_nd(mask, [0, pad]), atol=0, rtol=0)
    # Every call is a new shape and, mostly, a new pad: the first compiles its
    # pad in, the second one kernel for every size and pad (not one per pad).
    row = stats["aten::constant_pad_nd"]
    assert row["compiles"] <= 3 and row["fallbacks"] == 0, row
    (known,) = ints["aten::constant_pad_nd"].values()
    assert known.runtime == {(1, 1)}, known


@needs_cuda
def test_cuda_a_moving_item_of_an_int_list_compiles_one_kernel_for_every_positive_value(tmp_path):
    mask = torch.randn(2, 1, 1, 9, device="cuda")
    results, stats, _ = run(["aten::constant_pad_nd"], pad_calls(mask, PADS), tmp_path, device="cuda")
    assert_pads_as_eager(mask, PADS, results)
    row = stats["aten::constant_pad_nd"]
    assert row["compiles"] == 3 and row["fallbacks"] == 0, row


def test_a_recorded_runtime_list_int_prewarms_into_the_kernel_the_run_compiled(pad_run):
    root, manifest, mask, _, _, _ = pad_run
    entries = read_manifest(manifest)
    pads = [e.signature[1] for e in entries]
    assert [[item.get("runtime", False) for item in pad["items"]] for pad in pads] == [[False, False], [False, True], [False, False]]
    assert pads[1]["items"] == [{"kind": "int", "value": 0}, {"kind": "int", "value": PADS[1], "runtime": True}]
    prewarmed = root / "prewarmed"
    report = aoti_eager.prewarm(manifest, jobs=1, devices=["cpu"], cache_dir=prewarmed)
    assert report.count("compiled") == len(entries) and not report.failed, [r.outcome for r in report.results]
    # Same keys as the run's: a process on the prewarmed cache compiles nothing.
    cache = KernelCache(prewarmed, environment_name(torch.device("cpu"), compile_options("cpu")))
    assert all(cache.lookup(e.op, e.key) is not None for e in entries)
    pads = [4, 40, 17]
    results, stats, _ = run(["aten::constant_pad_nd"], pad_calls(mask, pads), prewarmed)
    assert_pads_as_eager(mask, pads, results)
    # The cache's runtime-int kernel serves the first n too, though it is none the run had.
    assert (stats["aten::constant_pad_nd"]["compiles"], stats["aten::constant_pad_nd"]["cache_loads"]) == (0, 1), stats


def test_a_list_int_that_export_cannot_take_at_run_time_stays_compiled_in(shared_cache):
    x = torch.randn(4, 6, 5)
    dims = [1, 2, 1, 2]
    results, stats, ints = run(["aten::sum.dim_IntList"], lambda: [torch.sum(x, [d]) for d in dims], shared_cache)
    for d, result in zip(dims, results):
        assert_same_as_eager(result, torch.sum(x, [d]))
    row = stats["aten::sum.dim_IntList"]
    # An int[] (not SymInt[]) refuses the number export reads at run time: each dim compiles in, once.
    assert row["compiles"] + row["cache_loads"] == 2 and row["fallbacks"] == 0 and row["hits"] == 2, row
    (known,) = ints["aten::sum.dim_IntList"].values()
    assert known.constant == {(1, 0)} and not known.runtime


def test_a_runtime_list_item_is_keyed_without_its_value():
    def pad(first: int, n: int) -> CallSignature:
        return CallSignature.of(A.constant_pad_nd.default, "cpu", [torch.zeros(2, 3), [first, n], 0])

    calls = [pad(0, n) for n in (5, 9)]
    runtime = [c.with_runtime_ints([(1, 1)]) for c in calls]
    assert calls[0].key != calls[1].key and runtime[0].key == runtime[1].key
    assert runtime[0].shape_key == calls[0].shape_key  # one count of compiles for every value
    assert pad(1, 5).with_runtime_ints([(1, 1)]).key != runtime[0].key  # the item that does not move is in it
    assert runtime[0].to_json()[1]["items"][1] == {"kind": "int", "value": 5, "runtime": True}
    # Without runtime items, a list is keyed as before there were any: cache entries keep their names.
    assert calls[0].key == "f7b99a5a77f0dd4ae073ae75"
