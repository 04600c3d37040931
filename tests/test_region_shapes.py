"""Dynamic shapes of fused regions: a second batch size or sequence length
compiles one kernel with those dims symbolic, which serves every later call
its guards admit, in this process and others; a call they do not admit is
never run by it."""

from __future__ import annotations

import copy
import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

import aoti_eager
from aoti_eager import _region_state, _regions
from aoti_eager.kernels import region_shapes
from aoti_eager.kernels.compile import compile_module
from aoti_eager.kernels.validate import Mismatch, compare

ROOT = Path(__file__).resolve().parent.parent


class Block(torch.nn.Module):
    """A 2-layer MLP with a residual and a norm."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Biased(Block):
    """Export finds the bias's rows and the input's one dim; eager also broadcasts a bias of one row."""

    def forward(self, x, bias):
        return super().forward(x) + bias


class Branching(Block):
    """Branches on its batch size, which export cannot keep symbolic."""

    def forward(self, x):
        y = super().forward(x)
        return 2 * y if x.shape[0] == 3 else y


class Model(torch.nn.Module):
    def __init__(self, block: type = Block, blocks: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(block() for _ in range(blocks))

    def forward(self, x, *args):
        for block in self.blocks:
            x = block(x, *args)
        return x


@pytest.fixture(autouse=True)
def _models_let_go():
    yield
    gc.collect()


def _row(name: str) -> dict:
    return dict(aoti_eager.stats().get(name, {"calls": 0, "hits": 0, "fallbacks": 0, "compiles": 0, "cache_loads": 0}))


def _name(block: type) -> str:
    return f"region::{block.__module__}.{block.__qualname__}"


def _fused(block: type, cache_dir: Path) -> tuple[Model, Model]:
    torch.manual_seed(0)
    model = Model(block).eval()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=cache_dir)
    return model, reference


def _entries(root: Path, name: str) -> dict[str, dict]:
    """The cache's entries of region ``name``, by key."""
    from aoti_eager.cache import KernelCache
    from aoti_eager.kernels.compile import compile_options
    from aoti_eager.kernels.toolchain import environment_name

    cache = KernelCache(root, environment_name(torch.device("cpu"), compile_options("cpu")))
    return {key: vars(cache.lookup(op, key)) for op, key in cache.entries() if op == name}


def _compiles_at(model: Model, reference: Model, name: str, batches: list[int], *args) -> list[int]:
    """The region's compiles after each batch size, each output checked against eager's."""
    counts = []
    for batch in batches:
        x = torch.randn(batch, 16)
        with torch.no_grad():
            torch.testing.assert_close(model(x, *args), reference(x, *args))
        counts.append(_row(name)["compiles"])
    return counts


def test_a_second_batch_size_compiles_one_dynamic_kernel_for_every_later_one(tmp_path):
    model, reference = _fused(Block, tmp_path)
    name = _name(Block)
    before = _row(name)
    # Batch 1 too: the kernel was checked against eager there (traced size-obliviously).
    assert _compiles_at(model, reference, name, [2, 3, 5, 8, 1]) == [before["compiles"] + n for n in (1, 2, 2, 2, 2)]
    after = _row(name)
    # The first call records what the forward reads: the original forward.
    assert (after["calls"] - before["calls"], after["hits"] - before["hits"], after["fallbacks"] - before["fallbacks"]) == (15, 14, 0)
    dynamic = [entry for entry in _entries(tmp_path, name).values() if entry["dynamic"]]
    assert len(dynamic) == 1 and dynamic[0]["library"] and dynamic[0]["dynamic"]["dims"] == [[0]]


def _comparing(before: Callable[[list[torch.Tensor]], None]) -> Callable[..., None]:
    """The pipeline's compare of a region's results, after ``before(actual)``."""
    return lambda what, actual, *rest: before(actual) or compare(what, actual, *rest)


def test_the_dynamic_kernel_is_checked_against_eager_at_another_size(tmp_path, swap_compiler):
    checked = []
    model, reference = _fused(Block, tmp_path)
    _compiles_at(model, reference, _name(Block), [2])
    swap_compiler(compare=_comparing(lambda actual: checked.append(actual[0].shape[0])))
    x, random_state = torch.randn(3, 16), torch.get_rng_state()
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x))
    # At the batch that made it, the one seen before and one neither had; then at 1.
    assert checked[0] == 3 and {2, 1} <= set(checked) and set(checked) - {1, 2, 3}
    # The checks' random inputs are not drawn from the caller's random numbers.
    assert torch.equal(torch.get_rng_state(), random_state)


def test_a_dynamic_kernel_that_disagrees_with_eager_keeps_static_kernels(tmp_path, swap_compiler, caplog):
    def disagrees_elsewhere(actual: list[torch.Tensor]) -> None:
        if actual[0].shape[0] not in (1, 2, 3, 5):  # a size no call has, where only a dynamic kernel is checked
            raise Mismatch("the region's result: made to differ at another batch size")

    swap_compiler(compare=_comparing(disagrees_elsewhere))
    model, reference = _fused(Block, tmp_path)
    name = _name(Block)
    before = _row(name)["compiles"]
    with caplog.at_level("INFO", logger="aoti_eager"):
        assert _compiles_at(model, reference, name, [2, 3, 5]) == [before + n for n in (1, 2, 3)]
    assert "no dynamic kernel: compiled kernel disagrees with eager" in caplog.text
    assert not any(entry["dynamic"] for entry in _entries(tmp_path, name).values())


def test_a_dim_export_fixes_keeps_static_kernels_and_is_recorded_for_every_process(tmp_path, swap_compiler):
    model, reference = _fused(Branching, tmp_path)
    name = _name(Branching)
    before = _row(name)["compiles"]
    assert _compiles_at(model, reference, name, [2, 3, 5]) == [before + n for n in (1, 2, 3)]
    static = [entry for key, entry in _entries(tmp_path, name).items() if key.endswith("-static")]
    assert len(static) == 1 and static[0]["library"] is None and "no dynamic kernel: torch.export failed" in static[0]["reason"]
    assert "args[0]" in static[0]["reason"] and "L['flat']" not in static[0]["reason"]  # the input, by the region's name
    # A process that knows nothing of the family reads the verdict instead of trying again.
    _regions.forget()
    exported = []
    swap_compiler(compile_module=lambda *args, **kwargs: exported.append(kwargs.get("dynamic_shapes")) or compile_module(*args, **kwargs))
    assert _compiles_at(model, reference, name, [6, 7]) == [before + n for n in (4, 5)]
    assert exported == [None, None]  # each shape alone: no dynamic kernel tried again


def test_a_call_outside_the_guards_is_not_run_by_the_dynamic_kernel(tmp_path, monkeypatch):
    model, reference = _fused(Biased, tmp_path)
    name = _name(Biased)
    block, eager = model.blocks[0], reference.blocks[0]
    runs = []

    def calls(x, bias):
        with torch.no_grad():
            torch.testing.assert_close(block(x, bias), eager(x, bias))
        return _row(name)["compiles"]

    start = _row(name)["compiles"]
    assert [calls(torch.randn(n, 16), torch.randn(n, 16)) for n in (2, 3)] == [start + 1, start + 2]
    (family,) = [f for (directory, _), f in _region_state.regions.families.items() if directory.startswith(str(tmp_path)) and f.decisions]
    (decided,) = family.decisions.values()
    kernel = decided.kernel
    monkeypatch.setattr(decided, "kernel", type("Spy", (), {
        "num_outputs": kernel.num_outputs, "run": lambda self, inputs: runs.append(inputs[-1].shape) or kernel.run(inputs)})())
    assert calls(torch.randn(5, 16), torch.randn(5, 16)) == start + 2 and runs == [(5, 16)]
    # Export gave the bias's rows the input's symbol: a bias of one row is another kernel's.
    assert calls(torch.randn(5, 16), torch.randn(1, 16)) == start + 3 and runs == [(5, 16)]


def _gpt2(cache_dir: Path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=cache_dir)
    return model, reference, _name(type(model.transformer.h[0]))


@pytest.fixture(scope="module")
def gpt2_lengths(tmp_path_factory):
    """A tiny GPT-2 fused and called at sequence lengths 8, 12 and 16: its
    cache, and the blocks' compiles, calls and hits after each length."""
    cache_dir = tmp_path_factory.mktemp("gpt2_lengths")
    model, reference, name = _gpt2(cache_dir)
    before, rows = _row(name), []
    for length in (8, 12, 16):
        ids = torch.randint(0, 100, (2, length))
        with torch.no_grad():
            torch.testing.assert_close(model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits)
        row = _row(name)
        rows.append(tuple(row[k] - before[k] for k in ("compiles", "calls", "hits")))
    return cache_dir, name, rows


def test_gpt2_blocks_share_one_dynamic_kernel_after_the_second_length(gpt2_lengths):
    cache_dir, name, rows = gpt2_lengths
    assert [(compiles, calls) for compiles, calls, _ in rows] == [(1, 2), (2, 4), (2, 6)]
    # Every call a hit but the first, which records what the forward reads where no earlier test's call did.
    assert all(calls - 1 <= hits <= calls for _, calls, hits in rows)
    (entry,) = [entry for entry in _entries(cache_dir, name).values() if entry["dynamic"]]
    # The hidden states' length and the position ids' are symbols.
    assert entry["dynamic"]["dims"][0] == [1] and entry["library"]


GPT2_CHILD = """
import copy, json, sys
import torch, transformers, aoti_eager
torch.manual_seed(0)
config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
model = transformers.GPT2LMHeadModel(config).eval()
reference = copy.deepcopy(model)
aoti_eager.fuse(model, cache_dir=sys.argv[1])
ids = torch.randint(0, 100, (2, 10))
with torch.no_grad():
    for _ in range(2):
        torch.testing.assert_close(model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits)
print(json.dumps(aoti_eager.stats()[sys.argv[2]]))
"""


def test_a_new_process_serves_a_new_length_with_the_family_kernel(gpt2_lengths):
    cache_dir, name, _ = gpt2_lengths
    child = subprocess.run([sys.executable, "-c", GPT2_CHILD, str(cache_dir), name], capture_output=True, text=True,
                           timeout=600, cwd=ROOT)
    assert child.returncode == 0, child.stderr[-2000:]
    row = json.loads(child.stdout.strip().splitlines()[-1])
    # Loaded once; every call a hit: the entry keeps the result's structure, as a static one does.
    # Its first call records what the forward reads: the original forward.
    assert (row["compiles"], row["cache_loads"], row["calls"], row["hits"], row["fallbacks"]) == (0, 1, 4, 3, 0)


def test_a_shape_no_dynamic_kernel_admits_compiles_a_wider_one_only_for_dims_none_takes():
    from aoti_eager._planner import Family
    from aoti_eager.kernels.dynamic import ShapeFamily

    family = Family(seen=[[(2, 8, 32), (1, 8)]])
    # The second length: its dims, of the hidden states and the position ids.
    assert family.moved_dims([(2, 12, 32), (1, 12)]) == ShapeFamily(((1,), (1,)))
    family.published["k"] = ShapeFamily(((1,), (1,)))
    family.saw([(2, 12, 32), (1, 12)], "k2")
    # A batch that moved: batch and length; a length of 1 stays fixed (export would fix it).
    assert family.moved_dims([(3, 12, 32), (1, 12)]) == ShapeFamily(((0, 1), (1,)))
    assert family.moved_dims([(3, 1, 32), (1, 1)]) == ShapeFamily(((0,), ()))
    # Only dims the kernel takes moved (its guards refused the call): a static kernel.
    assert family.moved_dims([(2, 16, 32), (1, 12)]) is None
    family.dynamic_failed = "export fixed dim 1 of args[0] to 8"
    assert family.moved_dims([(3, 12, 32), (1, 12)]) is None


def test_gpt2_attention_mask_takes_the_hidden_states_length_symbol(gpt2_lengths):
    cache_dir, name, _ = gpt2_lengths
    model, reference, _ = _gpt2(cache_dir)
    for length in (9, 12):
        ids, mask = torch.randint(0, 100, (2, length)), torch.ones(2, length, dtype=torch.long)
        mask[0, :2] = 0
        with torch.no_grad():
            torch.testing.assert_close(model(ids, attention_mask=mask, use_cache=False).logits,
                                       reference(ids, attention_mask=mask, use_cache=False).logits)
    (entry,) = [e for e in _entries(cache_dir, name).values() if e["dynamic"] and len(e["dynamic"]["dims"]) == 3]
    # (tensor, dim, symbol, size): the hidden states' dim 1 and the mask's dims 2 and 3 are one symbol.
    symbols = {(tensor, dim): symbol for tensor, dim, symbol, _ in entry["dynamic"]["guards"]}
    assert symbols[0, 1] == symbols[1, 2] == symbols[1, 3] >= 0
