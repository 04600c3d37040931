"""Fused regions (aoti_eager.fuse): one library per block signature, shared by
every instance, checked against eager; calls no kernel serves run eagerly."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import logging
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import aoti_eager
from aoti_eager import _background, _mechanism, _regions, settings
from aoti_eager.kernels import speed
from aoti_eager.kernels.compile import compile_module
from aoti_eager.kernels.inductor import shims
from helpers import ROOT, Block, Model, Wrapped, cache_entries, calls_to, compile_block, cpu_cache, delta_since, row, row_in_a_child

class Gate(torch.nn.Module):
    """Data-dependent control flow, which torch.export does not trace."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        if x.sum() > 0:
            return x * self.scale
        return x - self.scale


class Counting(Block):
    """Writes into its own buffer, which a compiled region cannot write back."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls.add_(1)
        return super().forward(x)


class Scoring(Block):
    """Returns a Python number read from the data, which a kernel does not return."""

    def forward(self, x):
        y = super().forward(x)
        return y, y.sum().item()


class Lookup(torch.nn.Module):
    """Eager raises for an index out of range: the call's values, not its signature."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(10, 4)

    def forward(self, ids):
        return self.table(ids) * 2


@dataclasses.dataclass
class Pair:
    out: torch.Tensor
    total: torch.Tensor


pytree.register_dataclass(Pair)


class PairBlock(Block):
    def forward(self, x):
        y = super().forward(x)
        return Pair(y, y.sum(dim=-1))


class TupleBlock(Block):
    def forward(self, x, scale: float = 1.0, mask=None):
        y = super().forward(x) * scale
        return y, {"doubled": 2 * y, "steps": 3}


class PassingBlock(Block):
    def forward(self, x):
        return super().forward(x), x  # the call's tensor itself, as T5's blocks hand on their position bias


@dataclasses.dataclass
class Named:
    out: torch.Tensor
    total: torch.Tensor


# Named by pytree, so that the structure of a result holding one is kept in the cache.
pytree.register_dataclass(Named, serialized_type_name=f"{__name__}.Named")


class NamedBlock(Block):
    def forward(self, x):
        y = super().forward(x)
        return Named(y, y.sum(dim=-1))


@dataclasses.dataclass
class Lazy:
    out: torch.Tensor


def _register_lazy() -> None:
    if Lazy not in pytree.SUPPORTED_NODES:
        pytree.register_dataclass(Lazy, serialized_type_name=f"{__name__}.Lazy")


class LazyBlock(Block):
    """Returns a type registered with pytree by its first call, as a model may import it late."""

    def forward(self, x):
        _register_lazy()
        return Lazy(super().forward(x))


@pytest.fixture(autouse=True)
def _models_let_go():
    """A test's models are freed when it ends (transformers' hold cycles):
    the stats() of later tests have no rows of their regions."""
    yield
    gc.collect()


def _model(block=Block, seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model(block).eval()


def test_repeated_blocks_share_one_compile(tmp_path):
    model, x = _model(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    assert aoti_eager.fuse(model, cache_dir=tmp_path) is model
    before = row(Block)  # a region's row is there while fused modules are
    # The blocks, not the Linears inside them nor the head (one of its kind).
    assert [m for m in model.modules() if "forward" in m.__dict__] == list(model.blocks)
    with torch.no_grad():
        expected, actual = reference(x), model(x)
    torch.testing.assert_close(actual, expected)
    # The first call runs the original forward, which records what it reads of its modules (region_values.py),
    # unless an earlier test of this process did.
    delta = delta_since(before, Block)
    assert delta["hits"] in (2, 3) and delta == {"calls": 3, "hits": delta["hits"], "fallbacks": 0, "compiles": 1, "cache_loads": 0}
    assert [key for op, key in cache_entries(tmp_path)] and {op for op, _ in cache_entries(tmp_path)} == {
        f"region::{Block.__module__}.Block"}


def test_changed_weights_need_no_compile(shared_cache):
    model, x = _model(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    with torch.no_grad():
        model(x)
        before = row(Block)
        for m in (model, reference):
            m.blocks[1].fc1.weight.mul_(1.5)  # in place
            m.blocks[2].fc2.bias = torch.nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(1)))
            m.blocks[0].norm.weight.data = torch.full((16,), 0.5)  # as .to() does
        expected, actual = reference(x), model(x)
    torch.testing.assert_close(actual, expected)
    assert delta_since(before, Block) == {"calls": 3, "hits": 3, "fallbacks": 0, "compiles": 0, "cache_loads": 0}


class _Counted(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops it sees, as a FLOP counter would."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class _Tagged(torch.Tensor):
    pass


def test_torch_func_transforms_dispatch_modes_and_subclasses_see_the_original_forward(shared_cache):
    """Under grad or vmap a call's tensors are wrappers with no storage, under a
    dispatch mode the mode is to see each op, and a subclass is to come back:
    what eager gives, the kernel (compiled by the first call) not run."""
    model, x = _model(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    with torch.no_grad():
        model(x)
    params = {m: dict(m.named_parameters()) for m in (model, reference)}
    for transform in (
        lambda m: torch.func.grad(lambda p: torch.func.functional_call(m, p, (x,)).sum())(params[m]),
        lambda m: torch.func.vmap(m)(x.unsqueeze(1)),
        lambda m: torch.func.jacrev(lambda y: m(y).sum(0))(x),
    ):
        torch.testing.assert_close(transform(model), transform(reference))
    counted = []
    for m in (model, reference):
        with torch.no_grad(), _Counted() as mode:
            counted.append((m(x), mode.ops))
    torch.testing.assert_close(counted[0][0], counted[1][0])
    assert counted[0][1] == counted[1][1] > 0
    with torch.no_grad():
        tagged = [m(x.as_subclass(_Tagged)) for m in (model, reference)]
    assert type(tagged[0]) is type(tagged[1]) is _Tagged
    torch.testing.assert_close(tagged[0], tagged[1])
    assert "a _Tagged, a subclass of torch.Tensor" in row(Block)["fallback_reason"]
    before = row(Block)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    assert delta_since(before, Block) == {"calls": 3, "hits": 3, "fallbacks": 0, "compiles": 0, "cache_loads": 0}


def test_a_kept_structure_is_used_only_where_it_fits_the_kernel():
    from aoti_eager.kernels.region import NotARegion, Outputs

    t = torch.randn(2, 3).t()
    outputs = Outputs.of(Named(t, {"a": t, "n": 2.5, "s": "x", "none": None}))
    kept = json.loads(json.dumps(outputs.to_json()))  # as the entry holds it
    assert Outputs.from_json(kept, 2) == outputs
    with pytest.raises(NotARegion, match="does not fit a kernel of 3 outputs"):
        Outputs.from_json(kept, 3)
    assert Outputs.of(Pair(t, t)).to_json() is None  # a type registered without a name pytree can write


def test_the_kept_structure_is_under_the_entrys_integrity_check(tmp_path):
    compile_block(tmp_path, TupleBlock)
    cache = cpu_cache(tmp_path)
    [(op, key)] = cache.entries()
    path = cache.entry_dir(op, key) / "entry.json"
    data = json.loads(path.read_text())
    assert {"value": 3} in data["result_structure"]["leaves"]  # the dict's "steps": 3
    leaves = data["result_structure"]["leaves"]
    leaves[leaves.index({"value": 3})] = {"value": 4}
    path.write_text(json.dumps(data))
    assert cache.lookup(op, key) is None  # set aside as damaged: never a wrong value in a result


@pytest.mark.parametrize("block", [Block, TupleBlock, NamedBlock, PassingBlock])
def test_a_new_process_loads_the_region_from_the_cache(tmp_path, block):
    compile_block(tmp_path, block)
    row = row_in_a_child(tmp_path, block)
    # Loaded once, the result's structure read from the entry: the original forward runs once, to record what it
    # reads (its values are in the key), then every call is a hit.
    assert (row["compiles"], row["cache_loads"], row["calls"], row["hits"], row["eager_calls"]) == (0, 1, 2, 1, 1)


def test_a_result_type_that_the_forward_registers_is_usable_after_its_first_call(tmp_path):
    compile_block(tmp_path, LazyBlock)
    row = row_in_a_child(tmp_path, LazyBlock)  # Lazy is registered by the first forward that returns one
    # The first call, which records what the forward reads, registers Lazy: the kept structure is then usable.
    assert (row["compiles"], row["cache_loads"], row["calls"], row["hits"], row["eager_calls"]) == (0, 1, 2, 1, 1)


def test_a_region_that_does_not_export_runs_eagerly_with_its_reason(tmp_path, caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Gate(), Gate())
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    before = row(Gate)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="aoti_eager"):
        for x in (torch.randn(4, 16), torch.randn(4, 16).abs(), -torch.randn(4, 16).abs()):
            torch.testing.assert_close(model(x), reference(x))
    delta = delta_since(before, Gate)
    assert (delta["compiles"], delta["hits"], delta["fallbacks"]) == (0, 0, 5)  # and the call that recorded its reads
    assert row(Gate)["fallback_reason"].startswith("torch.export failed")
    lines = [r.getMessage() for r in caplog.records if "Gate" in r.getMessage()]
    assert len(lines) == 1 and "runs eagerly: torch.export failed" in lines[0]


def _fused_pair(block: type, cache: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Two instances of ``block`` fused in ``cache``, and an unfused copy."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(block(), block()).eval()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=cache)
    return blocks, reference


def test_a_region_that_mutates_its_state_runs_eagerly(tmp_path):
    blocks, reference = _fused_pair(Counting, tmp_path)
    before = row(Counting)
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(blocks(x), reference(x))
    assert [int(b.calls) for b in blocks] == [2, 2]
    assert delta_since(before, Counting)["fallbacks"] == 3 and "writes into its input 6" in row(Counting)["fallback_reason"]


class AddsInPlace(torch.nn.Module):
    """Writes into its input and returns it (`x += f(x)`, an in-place activation)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        x += self.fc(x)
        return torch.relu_(x)


class ScalesInPlace(AddsInPlace):
    """Writes into its first input, reads its second after."""

    def forward(self, x, y):
        x.mul_(2)
        return self.fc(x) + y


def test_a_region_that_writes_into_its_input_is_compiled_and_writes_it_as_eager_does(tmp_path):
    blocks, reference = _fused_pair(AddsInPlace, tmp_path)
    before = row(AddsInPlace)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 16)
            expected_x = x.clone()
            expected = reference[0](expected_x)
            got = blocks[0](x)
            assert got is x and expected is expected_x  # the result is the input, written, as eager's
            torch.testing.assert_close(x, expected_x)
    delta = delta_since(before, AddsInPlace)
    assert delta["compiles"] == 1 and delta["hits"] == 2 and delta["fallbacks"] == 0
    cache = cpu_cache(tmp_path)
    [(op, key)] = cache.entries()
    assert cache.lookup(op, key).result_structure["writes"] == [0]
    # A new process learns what the kernel writes from the entry, and finds it shared where it is.
    argv = [str(tmp_path), str(ROOT), str(ROOT / "tests"), AddsInPlace.__module__]
    child = subprocess.run([sys.executable, "-c", CHILD_WRITES, *argv], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-2000:]
    child_row = json.loads(child.stdout.strip().splitlines()[-1])
    assert (child_row["compiles"], child_row["cache_loads"], child_row["hits"]) == (0, 1, 2)


CHILD_WRITES = """
import copy, json, sys, importlib
import torch, aoti_eager
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from helpers import row
tests = importlib.import_module(sys.argv[4])
torch.manual_seed(0)
blocks = torch.nn.Sequential(tests.AddsInPlace(), tests.AddsInPlace()).eval()
reference = copy.deepcopy(blocks)
aoti_eager.fuse(blocks, cache_dir=sys.argv[1])
with torch.no_grad():
    for _ in range(3):  # the first call records what the forward reads: the original forward
        x = torch.randn(4, 16)
        expected_x = x.clone()
        expected = reference[0](expected_x)
        assert blocks[0](x) is x
        torch.testing.assert_close(x, expected_x)
print(json.dumps(row(tests.AddsInPlace)))
"""


def test_a_call_whose_written_input_shares_memory_with_another_runs_eagerly(tmp_path):
    blocks, reference = _fused_pair(ScalesInPlace, tmp_path)
    with torch.no_grad():
        for _ in range(2):  # compiled, then a hit
            x, y = torch.randn(4, 16), torch.randn(4, 16)
            x_eager = x.clone()
            torch.testing.assert_close(blocks[0](x, y), reference[0](x_eager, y))
            torch.testing.assert_close(x, x_eager)
        before = row(ScalesInPlace)
        x = torch.randn(4, 16)
        x_eager = x.clone()
        torch.testing.assert_close(blocks[0](x, x), reference[0](x_eager, x_eager))  # y is x: it reads x doubled
        torch.testing.assert_close(x, x_eager)
    assert delta_since(before, ScalesInPlace)["fallbacks"] == 1
    assert "shares memory with another of its tensors" in row(ScalesInPlace)["fallback_reason"]


def test_a_kernel_that_disagrees_with_eager_is_not_used(tmp_path, swap_compiler):
    from aoti_eager.kernels.validate import Mismatch

    def disagree(what, actual, expected, reference=None):
        raise Mismatch(f"{what}: made to differ")

    swap_compiler(compare=disagree)
    model, x = _model(seed=3), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    before = row(Block)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    assert delta_since(before, Block)["hits"] == 0
    assert row(Block)["fallback_reason"] == "compiled kernel disagrees with eager: the region's result: made to differ"


class Layer(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down, self.norm = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width), torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


class Deep(torch.nn.Module):
    """Layers of Linear, GELU and LayerNorm: compiled whole in bf16, it rounds at
    other points than eager, by more than bf16's tolerance for one op."""

    def __init__(self, width: int = 64, layers: int = 4):
        super().__init__()
        self.layers = torch.nn.Sequential(*(Layer(width) for _ in range(layers)))

    def forward(self, x):
        return self.layers(x)


def _bf16_deep_blocks():
    torch.manual_seed(0)
    return torch.nn.Sequential(Deep(), Deep()).eval().to(torch.bfloat16), torch.randn(8, 64, dtype=torch.bfloat16)


def _rmse(a, b):
    return (a.double() - b.double()).square().mean().sqrt().item()


def test_a_bf16_block_compiled_whole_is_judged_against_float64(tmp_path):
    blocks, x = _bf16_deep_blocks()
    reference, float64 = copy.deepcopy(blocks), copy.deepcopy(blocks).double()
    aoti_eager.fuse(blocks, cache_dir=tmp_path)
    before = row(Deep)
    with torch.no_grad():
        actual, expected, exact = blocks(x), reference(x), float64(x.double())
    assert delta_since(before, Deep) == {"calls": 2, "hits": 1, "fallbacks": 0, "compiles": 1, "cache_loads": 0}, row(Deep)["fallback_reason"]
    assert (actual.dtype, actual.shape, actual.stride()) == (expected.dtype, expected.shape, expected.stride())
    with pytest.raises(AssertionError):
        torch.testing.assert_close(actual, expected)  # what one op's tolerance would refuse
    # As near the float64 result as eager, within same()'s multiple for bf16.
    assert _rmse(actual, exact) <= 3 * _rmse(expected, exact) + 1e-4


def test_a_bf16_kernel_further_from_float64_than_eager_is_refused(tmp_path, swap_loading):
    class Skewed:
        """The kernel, its first output 3% too large."""

        def __init__(self, kernel):
            self.kernel, self.num_outputs = kernel, kernel.num_outputs

        def run(self, inputs):
            outputs = self.kernel.run(inputs)
            return [outputs[0].mul_(1.03), *outputs[1:]]

    load = _mechanism.current().library
    # A compile checks the skewed kernel; nothing disagreeing is published for a call to load.
    swap_loading(library=lambda *args: load(*args) if args[6] else Skewed(load(*args)))
    blocks, x = _bf16_deep_blocks()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=tmp_path)
    before = row(Deep)
    with torch.no_grad():
        torch.testing.assert_close(blocks(x), reference(x), rtol=0, atol=0)
    assert delta_since(before, Deep)["hits"] == 0
    reason = row(Deep)["fallback_reason"]
    assert reason.startswith("compiled kernel disagrees with eager: the region's result[0]: Tensor-likes are not close!")
    assert "against a float64 run of the forward: RMSE (res-fp64)" in reason


def _region_entries(root: Path, region: type) -> list:
    cache = cpu_cache(root)
    return [cache.lookup(op, key) for op, key in cache.entries() if op.endswith(f".{region.__qualname__}")]


def test_a_region_timed_slower_than_eager_stays_eager(tmp_path, monkeypatch, swap_compiler):
    from aoti_eager.kernels.speed import Timing

    timed = []

    def slower(kernel, inputs, eager):
        # What it is given: the kernel and the original forward on the same values, each giving eager's result.
        timed.append(1)
        torch.testing.assert_close(kernel.run(inputs)[0], eager())
        return Timing(2e-3, 1e-3)

    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "1")
    swap_compiler(region_timer=slower)
    delta, reason = _fused_against_eager(tmp_path, seed=7)
    assert delta == {"calls": 3, "hits": 0, "fallbacks": 3, "compiles": 1, "cache_loads": 0}
    assert timed == [1, 1]  # timed twice before eager wins, as ops are
    assert reason == "eager is faster: kernel 2.00x eager's time (measured at compile)"
    [entry] = _region_entries(tmp_path, Block)
    assert (entry.library, entry.timing) == (None, {"kernel_us": 2000.0, "eager_us": 1000.0, "ratio": 2.0})
    # With the switch off, the verdict on speed is passed over: compiled again, and used.
    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "0")
    _regions.forget()
    assert _fused_against_eager(tmp_path, seed=7)[0] == {"calls": 3, "hits": 3, "fallbacks": 0, "compiles": 1, "cache_loads": 0}


def _fused_against_eager(cache: Path, seed: int) -> tuple[dict, str | None]:
    """Fuses a model's blocks and calls it once, its result checked against eager's; what its region's calls
    did, and the last reason they ran eagerly."""
    model, x = _model(seed=seed), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    # The structure's first call in a process runs its forward to record what it reads (neither hit nor
    # fallback): made first, compiling nothing, so that the counts below do not depend on earlier tests.
    recording = aoti_eager.fuse(copy.deepcopy(model), cache_dir=cache, compile="never")
    aoti_eager.fuse(model, cache_dir=cache)
    with torch.no_grad():
        recording(x)
        before = row(Block)
        torch.testing.assert_close(model(x), reference(x))
    return delta_since(before, Block), row(Block)["fallback_reason"]


def test_a_region_timed_faster_than_eager_keeps_its_kernel(tmp_path, monkeypatch, swap_compiler):
    from aoti_eager.kernels.speed import Timing

    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "1")
    swap_compiler(region_timer=lambda kernel, inputs, eager: Timing(1e-3, 2e-3))
    assert _fused_against_eager(tmp_path, seed=8)[0] == {"calls": 3, "hits": 3, "fallbacks": 0, "compiles": 1, "cache_loads": 0}
    [entry] = _region_entries(tmp_path, Block)
    assert entry.library is not None and entry.timing == {"kernel_us": 1000.0, "eager_us": 2000.0, "ratio": 0.5}


def test_a_twin_takes_the_timing_of_the_entry_it_copies(tmp_path, monkeypatch, swap_compiler):
    """Each layer's call holds its own KV cache (a key a layer) of one program: timed once."""
    transformers = pytest.importorskip("transformers")
    from aoti_eager.kernels.speed import Timing

    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "1")
    timed = []
    swap_compiler(region_timer=lambda kernel, inputs, eager: timed.append(kernel) or Timing(1e-3, 2e-3))
    torch.manual_seed(0)
    # A width no other test's GPT-2 has: what its forward reads is learnt here, not by an earlier test.
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=3, n_embd=40, n_head=2, vocab_size=100)).eval()
    aoti_eager.fuse(model, cache_dir=tmp_path)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randint(0, 100, (1, 8)))
    entries = _region_entries(tmp_path, transformers.models.gpt2.modeling_gpt2.GPT2Block)
    assert len(entries) == 3 and len(timed) == 1, (len(entries), len(timed))
    assert all(e.library is not None and e.timing == {"kernel_us": 1000.0, "eager_us": 2000.0, "ratio": 0.5} for e in entries)


def test_a_region_is_timed_against_its_original_forward(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "1")
    _fused_against_eager(tmp_path, seed=9)  # the kernel or eager, whichever was faster here
    [entry] = _region_entries(tmp_path, Block)
    assert entry.timing["kernel_us"] > 0 and entry.timing["eager_us"] > 0
    assert (entry.library is None) == (entry.timing["ratio"] > speed.SLOWER_THAN_EAGER)


def test_a_number_read_from_the_data_keeps_eager(tmp_path):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(Scoring() for _ in range(2)).eval()
    aoti_eager.fuse(blocks, cache_dir=tmp_path)
    before = row(Scoring)
    with torch.no_grad():
        for x in (torch.randn(4, 16), torch.randn(4, 16)):
            y, total = blocks[0](x)
            assert total == y.sum().item()
    assert delta_since(before, Scoring)["hits"] == 0
    assert "computed from its tensors (their data or sizes)" in row(Scoring)["fallback_reason"]


def test_a_kernel_that_fails_to_run_falls_back_with_one_line(tmp_path, swap_loading, caplog):
    def failing(kernel, inputs):
        raise RuntimeError("a C++ error\nwith a frame dump")

    model, x = _model(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    _warm(model, x)  # its kernel in the cache
    # As in a new process: the kernel loaded from the cache (this test's own) fails to run.
    aoti_eager.unfuse(model)
    _regions.forget()
    load = _mechanism.current().library
    swap_loading(library=lambda *args: Wrapped(load(*args), failing) if args[6] else load(*args))
    aoti_eager.fuse(model, cache_dir=tmp_path)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="aoti_eager"):
        torch.testing.assert_close(model(x), reference(x))  # its result's structure learnt, then the kernel runs
        before = row(Block)
        torch.testing.assert_close(model(x), reference(x))
    assert delta_since(before, Block)["fallbacks"] == 3
    assert row(Block)["fallback_reason"] == "compiled kernel failed to run: RuntimeError: a C++ error"
    assert [r.getMessage() for r in caplog.records if "failed to run" in r.getMessage()] == [
        f"aoti_eager: region::{Block.__module__}.Block runs eagerly: compiled kernel failed to run: RuntimeError: a C++ error"]


def test_eager_error_reaches_the_caller_and_the_next_call_compiles(tmp_path):
    torch.manual_seed(0)
    lookups = torch.nn.ModuleList(Lookup() for _ in range(2))
    reference = copy.deepcopy(lookups)
    aoti_eager.fuse(lookups, cache_dir=tmp_path)
    before = row(Lookup)
    with torch.no_grad():
        with pytest.raises(IndexError):
            lookups[0](torch.tensor([[11]]))
        ids = torch.tensor([[1]])
        torch.testing.assert_close(lookups[1](ids), reference[1](ids))
    # Eager's error comes from the call that records what the forward reads; the next records again, then compiles.
    assert delta_since(before, Lookup) == {"calls": 2, "hits": 0, "fallbacks": 0, "compiles": 1, "cache_loads": 0}


def test_an_instance_with_forward_hooks_runs_them_around_its_kernel(shared_cache):
    model, x = _model(), torch.randn(4, 16)
    seen = []
    model.blocks[1].register_forward_hook(lambda module, args, result: seen.append(result.shape))
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    _warm(model, x)
    before = row(Block)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    assert seen == [torch.Size([4, 16])] * 4  # once a call of each model, not twice in the fused one
    assert delta_since(before, Block)["hits"] == 3 and delta_since(before, Block)["fallbacks"] == 0


def test_a_region_compiles_beside_enabled_ops(tmp_path):
    model, x = _model(seed=5), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    with aoti_eager.enabled(ops=["aten::gelu"], devices=["cpu"], cache_dir=tmp_path), torch.no_grad():
        aoti_eager.fuse(model, cache_dir=tmp_path)
        before = row(Block)
        actual = model(x)  # the compile's own eager runs and checks use the original gelu, not its override
        gelu = aoti_eager.stats()["aten::gelu"]
    with torch.no_grad():
        torch.testing.assert_close(actual, reference(x))
    assert (gelu["calls"], gelu["compiles"]) == (0, 0)
    assert delta_since(before, Block) == {"calls": 3, "hits": 3, "fallbacks": 0, "compiles": 1, "cache_loads": 0}


class Solving(Block):
    """A block with an op that AOTInductor leaves to its proxy executor (it has no C shim)."""

    def forward(self, x):
        y = super().forward(x)
        return y + torch.linalg.svdvals(y[:, :4]).sum()


class Projecting(Block):
    """A block with a matmul Inductor lowers to an ATen choice (a Linear's addmm
    passes Scalars, which torch's proxy executor cannot)."""

    def forward(self, x):
        return super().forward(x) @ self.fc1.weight[:16]


@pytest.mark.parametrize("block, left, undeclared", [
    (Solving, "aten::_linalg_svd", set()),
    # As torch 2.11's CUDA _grouped_mm: Inductor's matmul lowering picks an ATen
    # choice whose C shim the headers do not declare.
    (Projecting, "aten::mm", {"aoti_torch_cpu_mm_out", "aoti_torch_aten_mm_out"}),
])
def test_a_block_is_fused_around_an_op_left_to_the_proxy_executor(tmp_path, swap_toolchain, block, left, undeclared):
    declared = shims.declared_shims("cpu") - undeclared
    swap_toolchain(declared_shims=lambda device_type: declared)
    model, x = _model(block, seed=6), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    before = row(block)
    with torch.no_grad():
        model(x)
        torch.testing.assert_close(model(x), reference(x))
    delta = delta_since(before, block)
    assert delta["compiles"] == 1 and delta["fallbacks"] == 0 and delta["hits"] >= 5, row(block)
    nodes = [node["node"]["target"] for path in tmp_path.rglob("kernel.json") for node in json.loads(path.read_text())["nodes"]]
    assert left in nodes, nodes


@pytest.mark.parametrize("block", [PairBlock, TupleBlock])
def test_output_pytrees(shared_cache, block):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(block() for _ in range(2)).eval()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=shared_cache)
    before = row(block)
    x = torch.randn(4, 16)
    kwargs = {"scale": 0.5, "mask": None} if block is TupleBlock else {}
    with torch.no_grad():
        for fused, eager in zip(blocks, reference):
            actual, expected = fused(x, **kwargs), eager(x, **kwargs)
            assert type(actual) is type(expected)
            assert pytree.tree_structure(actual) == pytree.tree_structure(expected)
            for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected)):
                if isinstance(e, torch.Tensor):
                    torch.testing.assert_close(a, e)
                    assert a.stride() == e.stride()
                else:
                    assert a == e
    # 1: the first call records what its forward reads, unless an earlier test of this process did.
    assert delta_since(before, block)["hits"] in (1, 2)


def test_one_call_fuses_the_blocks_and_enables_the_ops_around_them(shared_cache):
    model, x = _model(seed=6), torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
        ops = aoti_eager.ops_reached(model, x)
        assert aoti_eager.fuse(model, ops=ops, cache_dir=shared_cache) is model
        # Compiles or loads; a block structure's first call in a process runs its original forward.
        torch.testing.assert_close(model(x), expected)
        first, before = aoti_eager.stats(), row(Block)
        actual = model(x)
    torch.testing.assert_close(actual, expected)
    stats = aoti_eager.stats()
    assert delta_since(before, Block)["hits"] == 3
    # The head, outside the blocks: its kernel ran (compiled or loaded in the first forward).
    assert stats["aten::addmm"]["calls"] == first["aten::addmm"]["calls"] + 1
    assert stats["aten::addmm"]["fallbacks"] == first["aten::addmm"]["fallbacks"]
    assert stats["aten::gelu"]["calls"] == first["aten::gelu"]["calls"]  # inside the blocks: their kernels ran instead
    aoti_eager.unfuse(model)
    assert "aten::addmm" in aoti_eager.stats()  # unfuse() leaves the ops; disable() takes them out
    aoti_eager.disable()
    assert "aten::addmm" not in aoti_eager.stats()
    with pytest.raises(ValueError, match="aten::view"):
        aoti_eager.fuse(model, ops=["aten::view.default"])
    assert all("forward" not in m.__dict__ for m in model.modules())  # refused before any block is fused


class Around(torch.nn.Module):
    """Ops before and after the blocks, outside every region."""

    def __init__(self):
        super().__init__()
        self.inner = _model(seed=7)

    def forward(self, x):
        return torch.softmax(self.inner(torch.tanh(x)), dim=-1)


def test_the_op_misses_of_a_fused_forward_compile_side_by_side_before_it_returns(tmp_path):
    model, x = Around().eval(), torch.randn(4, 16)
    outside = ["aten::tanh", "aten::_softmax", "aten::addmm"]
    with torch.no_grad():
        expected = model(x)
        aoti_eager.fuse(model, ops=aoti_eager.ops_reached(model, x), cache_dir=tmp_path)
        torch.testing.assert_close(model(x), expected)  # eager's calls while their kernels compile in workers
        first = aoti_eager.stats()
        assert [(first[op]["queued"], first[op]["compiling"], first[op]["compiles"]) for op in outside] == [(1, 0, 0)] * 3
        assert first["aten::gelu"]["queued"] == 0  # inside the blocks: the region's kernel runs it
        torch.testing.assert_close(model(x), expected)
    stats = aoti_eager.stats()
    assert [stats[op]["fallbacks"] - first[op]["fallbacks"] for op in outside] == [0, 0, 0]  # their kernels ran
    assert not _background.together()
    aoti_eager.unfuse(model)
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_a_fused_forward_compiles_side_by_side_within_the_family_limits(tmp_path):
    model = Around().eval()
    with torch.no_grad(), settings.max_shape_compiles.set_to("1"), settings.dynamic_shapes.set_to("0"):
        aoti_eager.fuse(model, ops=["aten::tanh"], cache_dir=tmp_path)
        for batch in (2, 3, 4):  # a new shape every forward, as a decode step's
            x = torch.randn(batch, 16)
            torch.testing.assert_close(model(x), torch.softmax(model.inner(torch.tanh(x)), dim=-1))
    tanh = aoti_eager.stats()["aten::tanh"]
    assert tanh["queued"] == 1  # the first shape's; the others run eagerly, as compiling here would leave them
    assert "AOTI_EAGER_MAX_SHAPE_COMPILES=1" in tanh["fallback_reason"]


def test_a_fused_forward_that_raises_or_was_interrupted_leaves_no_compile_waiting(shared_cache):
    model, x = aoti_eager.fuse(_model(), ops=["aten::tanh"], cache_dir=shared_cache), torch.randn(4, 16)
    with pytest.raises(RuntimeError), torch.no_grad():
        model(torch.randn(4, 15))
    assert not _background.together()
    _background.begin_together(model)  # as an interrupt leaves it: its forward hook never ran
    with torch.no_grad():
        model(x)
    assert not _background.together()


def test_unfuse_restores_the_original_forward(shared_cache):
    model, other = _model(), aoti_eager.fuse(_model(), cache_dir=shared_cache)  # other keeps the row in stats()
    aoti_eager.fuse(model, cache_dir=shared_cache)
    assert all(block.forward.__func__ is not Block.forward for block in model.blocks)
    assert aoti_eager.unfuse(model) is model
    assert all("forward" not in block.__dict__ and block.forward.__func__ is Block.forward for block in model.blocks)
    before = row(Block)
    with torch.no_grad():
        model(torch.randn(4, 16))
    assert delta_since(before, Block)["calls"] == 0


class Unused(Block):
    pass


def test_stats_rows_are_those_of_fused_modules_alive(shared_cache):
    torch.manual_seed(0)
    blocks = aoti_eager.fuse(torch.nn.ModuleList(Unused() for _ in range(2)), cache_dir=shared_cache)
    name = f"region::{Unused.__module__}.Unused"
    assert aoti_eager.stats()[name]["calls"] == 0
    del blocks  # freed at once: the fused modules do not hold themselves
    assert name not in aoti_eager.stats()
    blocks = aoti_eager.fuse(torch.nn.ModuleList(Unused() for _ in range(2)), cache_dir=shared_cache)
    assert name in aoti_eager.stats()
    aoti_eager.unfuse(blocks)
    assert name not in aoti_eager.stats()


def test_fuse_names_the_modules_or_classes(shared_cache):
    model = _model()
    aoti_eager.fuse(model, [model.blocks[0], torch.nn.Linear], cache_dir=shared_cache)
    fused = [name for name, m in model.named_modules() if "forward" in m.__dict__]
    # blocks.0, and the Linears outside it.
    assert fused == ["blocks.0", "blocks.1.fc1", "blocks.1.fc2", "blocks.2.fc1", "blocks.2.fc2", "head"]
    aoti_eager.unfuse(model)
    with pytest.raises(ValueError, match="compile"):
        aoti_eager.fuse(model, compile="later")


def test_compile_never_runs_eagerly_on_a_miss(tmp_path):
    model, x = _model(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, compile="never", cache_dir=tmp_path)
    before = row(Block)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    assert delta_since(before, Block) == {"calls": 3, "hits": 0, "fallbacks": 3, "compiles": 0, "cache_loads": 0}
    assert "compile='never'" in row(Block)["fallback_reason"]
    assert cache_entries(tmp_path) == []
    aoti_eager.unfuse(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)  # compile="now" is not held back by what "never" decided
    before = row(Block)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    assert delta_since(before, Block) == {"calls": 3, "hits": 3, "fallbacks": 0, "compiles": 1, "cache_loads": 0}


def test_compile_background_runs_eagerly_until_the_kernel_is_published(tmp_path, swap_compiler):
    compiled_on, go = [], threading.Event()

    def held(*args, **kwargs):
        compiled_on.append(threading.current_thread())
        assert go.wait(timeout=600)  # until the calls below have returned: none of them waits for it
        return compile_module(*args, **kwargs)

    swap_compiler(compile_module=held)
    model, x = _model(seed=10), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, compile="background", cache_dir=tmp_path)
    before = row(Block)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x), reference(x))
        assert (row(Block)["queued"], row(Block)["compiling"], row(Block)["fallback_reason"]) == (
            before["queued"] + 1, 1, "its kernel is compiling in the background")
        go.set()
        assert aoti_eager.wait(timeout=600)
        assert row(Block)["compiling"] == 0
        torch.testing.assert_close(model(x), reference(x))
    assert len(compiled_on) == 1 and compiled_on[0] is not threading.current_thread()
    assert delta_since(before, Block) == {"calls": 9, "hits": 3, "fallbacks": 6, "compiles": 1, "cache_loads": 0}


def test_training_flags_and_autocast_are_part_of_the_call(shared_cache):
    model, x = _model(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    instance = _regions._fused(model.blocks[0])
    in_eval = instance.state().structure
    model.train()
    assert instance.state().structure != in_eval
    model.eval()
    assert instance.state().structure == in_eval
    before = row(Block)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        actual, expected = model(x), reference(x)
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected)
    assert delta_since(before, Block)["fallbacks"] == 3 and "autocast" in row(Block)["fallback_reason"]


def test_gpt2_blocks(shared_cache):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    reference = copy.deepcopy(model)
    block = type(model.transformer.h[0])
    aoti_eager.fuse(model, cache_dir=shared_cache)
    before = row(block)
    # The blocks; not the final norm nor the embeddings' dropout, whose kind repeats only inside the blocks.
    assert [name for name, m in model.named_modules() if "forward" in m.__dict__] == ["transformer.h.0", "transformer.h.1"]
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        actual = model(ids, use_cache=False).logits
        expected = reference(ids, use_cache=False).logits
    torch.testing.assert_close(actual, expected)
    delta = delta_since(before, block)
    # 1 hit: the first call records what its forward reads, unless an earlier test of this process did.
    assert delta["compiles"] == 1 and delta["hits"] in (1, 2), row(block)["fallback_reason"]


# The hit path: a call keyed like one decided before, with the instance's state unchanged, runs the kernel at once.


def test_a_repeated_call_is_neither_described_nor_flattened(shared_cache):
    from aoti_eager.kernels import region

    model, x = _model(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    with torch.no_grad():
        model(x), model(x)  # decided
        before = row(Block)
        with calls_to(region.RegionCall.of, pytree.tree_flatten, pytree.tree_unflatten, pytree.tree_flatten_with_path) as counted:
            actual = [model(x) for _ in range(3)]
    with torch.no_grad():
        expected = reference(x)
    for a in actual:
        torch.testing.assert_close(a, expected)
    assert not counted, counted
    assert delta_since(before, Block) == {"calls": 9, "hits": 9, "fallbacks": 0, "compiles": 0, "cache_loads": 0}


def _warm(model, x, calls: int = 2):
    with torch.no_grad():
        for _ in range(calls):
            model(x)


class Casting(Block):
    """Takes its weights' dtype: one input, whatever dtype the state has."""

    def forward(self, x):
        return super().forward(x.to(self.fc1.weight.dtype))


def test_to_dtype_prepares_the_state_again(shared_cache):
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(Casting(), Casting()).eval()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=shared_cache)
    x = torch.randn(4, 16)
    _warm(blocks, x)
    for m in (blocks, reference):
        m.to(torch.float64)
    before = row(Casting)
    with torch.no_grad():
        actual, expected = blocks(x), reference(x)
    assert actual.dtype == torch.float64
    torch.testing.assert_close(actual, expected)
    assert delta_since(before, Casting)["hits"] == 1  # a new structure: its first call records what its forward reads


def test_data_assigned_with_other_strides_prepares_the_state_again(shared_cache):
    model, x = _model(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    _warm(model, x)
    weight = model.blocks[1].fc1.weight
    weight.data = weight.data.t().contiguous().t()  # the same values, column-major
    assert weight.stride() == (1, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))


def test_load_state_dict_uses_the_new_values_without_a_compile(shared_cache):
    model, x = _model(), torch.randn(4, 16)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    _warm(model, x)
    before = row(Block)
    for seed, assign in ((7, False), (8, True)):  # copied into the parameters; new parameter objects
        other = _model(seed=seed)
        model.load_state_dict(other.state_dict(), assign=assign)
        with torch.no_grad():
            torch.testing.assert_close(model(x), other(x))
    assert delta_since(before, Block) == {"calls": 6, "hits": 6, "fallbacks": 0, "compiles": 0, "cache_loads": 0}


class Training(Block):
    """A result that depends on its own and a submodule's training flags."""

    def forward(self, x):
        return super().forward(x) * (1 + self.training + 2 * self.fc1.training)


@pytest.mark.parametrize("flip", ["model", "submodule"])
def test_train_and_eval_are_seen_by_the_hit_path(shared_cache, flip):
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(Training(), Training()).eval()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=shared_cache)
    x = torch.randn(4, 16)
    _warm(blocks, x)
    for mode in (True, False, True):
        for m in (blocks, reference):
            (m if flip == "model" else m[0].fc1).train(mode)
        with torch.no_grad():
            torch.testing.assert_close(blocks(x), reference(x))


class Ones(Block):
    """Adds a tensor of the default dtype."""

    def forward(self, x):
        return super().forward(x) + torch.ones(16)


def test_the_default_dtype_is_seen_by_the_hit_path(shared_cache):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Ones(), Ones()]).eval()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=shared_cache)
    x = torch.randn(4, 16)
    _warm(blocks[0], x)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.no_grad():
            actual, expected = blocks[0](x), reference[0](x)
    finally:
        torch.set_default_dtype(default)
    assert actual.dtype == expected.dtype == torch.float64
    # Its float32 part computed whole: within float32's rounding of eager, as near float64 as eager (validate.py).
    torch.testing.assert_close(actual, expected, rtol=1.3e-6, atol=1e-5)


def test_grad_mode_and_requires_grad_are_seen_by_the_hit_path(shared_cache):
    model, x = _model(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    _warm(model, x)
    before = row(Block)
    actual = model(x)  # grad enabled, parameters that require it: a forward and backward kernel
    assert actual.requires_grad
    actual.sum().backward()
    reference(x).sum().backward()
    torch.testing.assert_close(model.blocks[0].fc1.weight.grad, reference.blocks[0].fc1.weight.grad)
    assert delta_since(before, Block)["hits"] == 3
    model.requires_grad_(False)
    _warm(model, x)
    before = row(Block)
    torch.testing.assert_close(model(x), reference(x))  # grad enabled, nothing requires it: the kernel
    model.blocks[2].requires_grad_(True)
    actual = model(x)
    assert actual.requires_grad
    torch.testing.assert_close(actual, reference(x))
    assert delta_since(before, Block) == {"calls": 6, "hits": 6, "fallbacks": 0, "compiles": 0, "cache_loads": 0}


def test_a_new_shape_is_decided_anew_and_the_old_one_still_hits(shared_cache):
    model = _model()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    small, large = torch.randn(4, 16), torch.randn(8, 16)
    _warm(model, small)
    before = row(Block)
    with torch.no_grad():
        for x in (large, small, large):
            torch.testing.assert_close(model(x), reference(x))
    assert delta_since(before, Block)["compiles"] <= 1 and delta_since(before, Block)["hits"] == 9


class Scaled(Block):
    """A result that tells apart what a key of its values must: True from 1, -0.0 from 0.0, one string from another."""

    def forward(self, x, scale=1.0, mode="mul"):
        y = super().forward(x)
        if isinstance(scale, bool):
            return y + 100
        return y * scale if mode == "mul" else y / scale


def test_the_hit_path_keys_values_by_type_and_value(shared_cache):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Scaled(), Scaled()]).eval()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=shared_cache)
    x = torch.randn(4, 16)
    calls = [((x, 1), {}), ((x, True), {}), ((x, 0.0, "div"), {}), ((x, -0.0, "div"), {}), ((x,), {"mode": "div", "scale": 2.0}),
             ((x,), {"scale": 2.0, "mode": "div"}), ((x, 2.0), {"mode": "mul"})]
    with torch.no_grad():
        for _ in range(3):  # decided, then hits
            for args, kwargs in calls:
                torch.testing.assert_close(blocks[0](*args, **kwargs), reference[0](*args, **kwargs))
    assert row(Scaled)["fallbacks"] == 0, row(Scaled)["fallback_reason"]


class Nested(Block):
    """Takes its tensors in a container: the call's key is that of its pytree."""

    def forward(self, xs, weights=None):
        return super().forward(xs[0] + xs[1] * (1 if weights is None else weights["b"]))


def test_nested_arguments_are_keyed_by_their_pytree(shared_cache):
    from aoti_eager.kernels import region

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Nested(), Nested()]).eval()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=shared_cache)
    x, y, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    calls = [((x, y),), ([x, y],), ([y, x],), ((x, y), {"b": w}), ((x, y), {"b": 2.0})]
    with torch.no_grad():
        for round in range(2):
            for args in calls:
                torch.testing.assert_close(blocks[0](*args), reference[0](*args))
        with calls_to(region.RegionCall.of) as described:
            for args in calls:
                torch.testing.assert_close(blocks[0](*args), reference[0](*args))
    assert not described and row(Nested)["fallbacks"] == 0, row(Nested)["fallback_reason"]


def test_new_values_of_a_number_compile_up_to_the_limit_then_run_eagerly(tmp_path):
    from aoti_eager import settings

    blocks = torch.nn.ModuleList(TupleBlock() for _ in range(2)).eval()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=tmp_path)
    before = row(TupleBlock)
    x = torch.randn(4, 16)
    with settings.max_value_variants.set_to("2"), torch.no_grad():
        for scale in (0.5, 1.5, 2.5, 3.5):
            torch.testing.assert_close(blocks[0](x, scale)[0], reference[0](x, scale)[0])
    assert delta_since(before, TupleBlock)["compiles"] == 2
    assert "AOTI_EAGER_MAX_VALUE_VARIANTS=2" in row(TupleBlock)["fallback_reason"]


class Measuring(Block):
    """Returns a size read off its input: no dynamic kernel, a static one per length."""

    def forward(self, x):
        return super().forward(x), x.shape[0]


def test_new_shapes_compile_up_to_the_limit_then_run_eagerly(tmp_path):
    from aoti_eager import settings

    blocks = torch.nn.ModuleList(Measuring() for _ in range(2)).eval()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=tmp_path)
    before = row(Measuring)
    with settings.max_shape_compiles.set_to("3"), torch.no_grad():
        for batch in range(1, 8):
            x = torch.randn(batch, 16)
            actual, expected = blocks[0](x), reference[0](x)
            torch.testing.assert_close(actual[0], expected[0])
            assert actual[1] == expected[1]
    assert delta_since(before, Measuring)["compiles"] <= 3
    assert "AOTI_EAGER_MAX_SHAPE_COMPILES=3" in row(Measuring)["fallback_reason"]


class Slicing(Model):
    """Slices its block list on every call, as Llama's forward does: a new ModuleList registers each block."""

    def forward(self, x):
        for block in self.blocks[: len(self.blocks)]:
            x = block(x)
        return self.head(x)


def _prepared(model) -> list:
    return [_regions._fused(block).prepared for block in model.blocks]


def test_an_assignment_outside_the_regions_keeps_their_prepared_state(shared_cache):
    torch.manual_seed(0)
    model, x = Slicing().eval(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    _warm(model, x)
    prepared = _prepared(model)
    before = row(Block)
    model.head = torch.nn.Linear(16, 4)  # outside the regions, on their parent
    reference.head = copy.deepcopy(model.head)
    torch.nn.Linear(2, 2).weight = torch.nn.Parameter(torch.ones(2, 2))  # anywhere else
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x), reference(x))
    assert all(a is b for a, b in zip(_prepared(model), prepared))
    assert delta_since(before, Block) == {"calls": 9, "hits": 9, "fallbacks": 0, "compiles": 0, "cache_loads": 0}


@pytest.mark.parametrize("change", ["parameter", "submodule", "buffer", "deleted"])
def test_an_assignment_inside_a_region_prepares_its_state_again(shared_cache, change):
    model, x = _model(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    _warm(model, x)
    prepared = _prepared(model)
    for m in (model, reference):
        torch.manual_seed(3)
        block = m.blocks[1]
        if change == "parameter":
            block.fc1.weight = torch.nn.Parameter(torch.randn(32, 16), requires_grad=False)
        elif change == "submodule":
            block.fc2 = torch.nn.Linear(32, 16).requires_grad_(False)
        elif change == "buffer":
            block.norm.register_buffer("unused", torch.zeros(2))
        else:
            block.fc1.bias = None
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    after = _prepared(model)
    assert after[0] is prepared[0] and after[2] is prepared[2] and after[1] is not prepared[1]


class Cache:
    """A value no kernel takes, as a KV cache object a model passes its blocks."""


class Cached(Block):
    def forward(self, x, cache=None):
        return super().forward(x)


@pytest.mark.parametrize("why", ["autocast", "input", "hooks", "code"])
def test_a_refused_call_is_decided_once(shared_cache, monkeypatch, why):
    from aoti_eager.kernels import region

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(Cached(), Cached()).eval()
    if why == "code":
        blocks[0].forward = blocks[0].forward  # replaced on the instance: refused by fuse()
    blocks.requires_grad_(False)
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=shared_cache)
    if why == "hooks":
        blocks[0].fc1.register_forward_hook(lambda *_: None)
    x, kwargs = torch.randn(4, 16), {"cache": Cache()} if why == "input" else {}
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if why == "autocast" else contextlib.nullcontext()
    with autocast:
        blocks[0](x, **kwargs)  # decided
    before = row(Cached)
    fused = type(blocks[0].forward.__self__)  # what fuse() set as the forward
    with calls_to(region.RegionCall.of, fused.state) as described, autocast:
        for _ in range(3):
            torch.testing.assert_close(blocks[0](x, **kwargs), reference[0](x))
    assert not described, described
    assert delta_since(before, Cached) == {"calls": 3, "hits": 0, "fallbacks": 3, "compiles": 0, "cache_loads": 0}


class Biased(Block):
    """A block whose first instance holds a parameter the others lack (T5's relative attention bias)."""

    def __init__(self, first: bool = False):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(16)) if first else None

    def forward(self, x):
        y = super().forward(x)
        return y + self.bias if self.bias is not None else y


def test_a_block_class_of_two_structures_is_fused_with_a_kernel_each(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Biased(first=True), Biased(), Biased(), torch.nn.ReLU(), torch.nn.ReLU()).eval()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    # The blocks, both structures; not the ReLUs nor the Linears, leaves that repeat.
    assert [name for name, m in model.named_modules() if "forward" in m.__dict__] == ["0", "1", "2"]
    x = torch.randn(4, 16)
    before = row(Biased)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x), reference(x))
    delta = delta_since(before, Biased)
    assert delta["compiles"] == 2 and delta["fallbacks"] == 0 and delta["hits"] >= 3, row(Biased)["fallback_reason"]


def test_leaf_modules_are_regions_only_where_named(shared_cache):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(inplace=True), torch.nn.Linear(16, 16),
                                torch.nn.ReLU(inplace=True), torch.nn.Dropout(), torch.nn.Dropout()).eval()
    aoti_eager.fuse(model, cache_dir=shared_cache)
    assert not [m for m in model.modules() if "forward" in m.__dict__]
    aoti_eager.fuse(model, [torch.nn.Linear], cache_dir=shared_cache)
    assert [name for name, m in model.named_modules() if "forward" in m.__dict__] == ["0", "2"]
