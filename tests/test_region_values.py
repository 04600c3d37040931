"""A fused region serves eager's result whatever its modules' Python values,
hooks, copies and threads do (kernels/region_values.py): values its forward
reads are in its key and watched on every call, hooks inside it keep it
eager, a copy is fused with its own state, a compile traces a copy."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading

import pytest
import torch

import aoti_eager
from aoti_eager.kernels import region_values


class Scaled(torch.nn.Module):
    """Its forward reads a Python number; ``unread`` it never reads."""

    def __init__(self, scale: float = 1.0, unread: int = 0):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.scale, self.unread = scale, unread

    def forward(self, x):
        return torch.tanh(self.fc(x)) * self.scale


class Config:
    def __init__(self, slope: float):
        self.slope = slope


class Configured(torch.nn.Module):
    """Reads a config object's value, as transformers' blocks do."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.fc = torch.nn.Linear(8, 8)
        self.act = torch.nn.Softplus()

    def forward(self, x):
        return self.act(self.fc(x)) * self.config.slope


class Stack(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _stack(*blocks) -> Stack:
    torch.manual_seed(0)
    return Stack(blocks).eval()


def _same(fused: torch.nn.Module, eager: torch.nn.Module, x: torch.Tensor, calls: int = 2) -> None:
    with torch.no_grad():
        for _ in range(calls):
            torch.testing.assert_close(fused(x), eager(x))


def _compiles(region: type) -> int:
    return aoti_eager.stats().get(f"region::{region.__module__}.{region.__qualname__}", {}).get("compiles", 0)


@pytest.fixture(autouse=True)
def _models_let_go():
    yield
    gc.collect()


@pytest.mark.parametrize("blocks, compiles", [
    (lambda: [Scaled(0.5), Scaled(2.0), Scaled(0.5)], 2),  # a value the forward reads: a kernel per value
    (lambda: [Scaled(unread=1), Scaled(unread=2), Scaled(unread=3)], 1),  # one it never reads: one kernel for all
], ids=["read", "unread"])
def test_blocks_share_a_kernel_where_the_values_their_forward_reads_are_equal(tmp_path, blocks, compiles):
    model = _stack(*blocks())
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    before = _compiles(Scaled)  # its row is there while fused modules are
    _same(model, reference, torch.randn(4, 8))
    assert _compiles(Scaled) - before == compiles


def test_a_value_changed_after_the_compile_is_seen(tmp_path):
    model = _stack(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Softplus())
                     for _ in range(2)))
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    x = torch.randn(4, 8)
    _same(model, reference, x)
    for m in (model, reference):
        m.blocks[0][1].eps = 0.5
        m.blocks[1][2].beta = 3.0
    _same(model, reference, x)


def test_a_config_value_is_keyed_and_watched(tmp_path):
    model = _stack(Configured(Config(1.0)), Configured(Config(1.0)))
    other = _stack(Configured(Config(3.0)), Configured(Config(3.0)))
    references = copy.deepcopy(model), copy.deepcopy(other)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    aoti_eager.fuse(other, cache_dir=tmp_path)  # the same cache: the first model's kernel must not serve it
    x = torch.randn(4, 8)
    _same(model, references[0], x)
    _same(other, references[1], x)
    for m in (other, references[1]):
        m.blocks[1].config.slope = -2.0
    _same(other, references[1], x)


def test_gpt2_scaled_by_its_layer_index_gives_eager_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                     scale_attn_by_inverse_layer_idx=True, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    ids = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(ids).logits, reference(ids).logits)


class Holding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.lock = threading.Lock()  # no key holds a lock's value

    def forward(self, x):
        with self.lock:
            return self.fc(x).relu()


def test_a_value_no_key_holds_runs_eagerly_with_its_reason(tmp_path, caplog):
    model, reference = _stack(Holding(), Holding()), _stack(Holding(), Holding())  # a lock does not deep-copy
    reference.load_state_dict(model.state_dict())
    aoti_eager.fuse(model, cache_dir=tmp_path)
    _same(model, reference, torch.randn(4, 8), calls=3)
    assert _compiles(Holding) == 0
    assert "lock" in aoti_eager.stats()[f"region::{Holding.__module__}.Holding"]["fallback_reason"]


def test_the_instances_own_hooks_run_once_around_its_kernel(tmp_path):
    model = _stack(Scaled(), Scaled())
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    before = _compiles(Scaled)  # its row is there while fused modules are
    for m in (model, reference):  # after fuse(), before the first call
        m.blocks[0].register_forward_hook(lambda module, args, out: out * 2)
        m.blocks[1].register_forward_pre_hook(lambda module, args: (args[0] + 1,))
    _same(model, reference, torch.randn(4, 8))
    assert _compiles(Scaled) - before == 1


def test_a_hook_on_a_submodule_keeps_that_instance_eager_and_out_of_the_cache(tmp_path):
    model = _stack(Scaled(), Scaled())
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    seen = []
    handles = [m.blocks[0].fc.register_forward_hook(lambda module, args, out: out * 0) for m in (model, reference)]
    model.blocks[1].fc.register_forward_hook(lambda module, args, out: seen.append(out))
    reference.blocks[1].fc.register_forward_hook(lambda module, args, out: None)
    x = torch.randn(4, 8)
    _same(model, reference, x)
    assert len(seen) == 2 and all(type(t) is torch.Tensor for t in seen)  # real tensors, every call
    for handle in handles:
        handle.remove()
    _same(model, reference, x)
    # A later model, hooks gone, gets a kernel of its own values, not one with the hook inside.
    fresh = _stack(Scaled(), Scaled())
    fresh_reference = copy.deepcopy(fresh)
    aoti_eager.fuse(fresh, cache_dir=tmp_path)
    _same(fresh, fresh_reference, x)


def test_a_global_hook_keeps_regions_eager(tmp_path):
    model = _stack(Scaled(), Scaled())
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out + 1 if isinstance(module, torch.nn.Linear) else None)
    x = torch.randn(4, 8)
    try:
        _same(model, reference, x)
    finally:
        handle.remove()
    # Nothing compiled with the hook inside serves a later model.
    fresh = _stack(Scaled(), Scaled())
    fresh_reference = copy.deepcopy(fresh)
    aoti_eager.fuse(fresh, cache_dir=tmp_path)
    _same(fresh, fresh_reference, x)


class Pausing(Scaled):
    """While another thread traces it, waits for the main thread's calls."""

    traced = threading.Event()
    resume = threading.Event()

    def forward(self, x):
        if torch.compiler.is_exporting() and threading.current_thread() is not threading.main_thread():
            Pausing.traced.set()
            Pausing.resume.wait(60)
        return super().forward(x)


def test_calls_of_other_threads_during_a_compile_get_eager_results(tmp_path):
    model = _stack(Pausing(), Pausing())
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    x = torch.randn(4, 8)
    _same(model, reference, x)  # compiled for x
    errors: list[BaseException] = []

    def new_shape():
        try:
            y = torch.randn(3, 5, 8)
            with torch.no_grad():
                torch.testing.assert_close(model(y), reference(y))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    compiling = threading.Thread(target=new_shape)
    compiling.start()
    try:
        assert Pausing.traced.wait(120)
        with torch.no_grad():
            for _ in range(3):
                result = model(x)
                assert type(result) is torch.Tensor
                torch.testing.assert_close(result, reference(x))
    finally:
        Pausing.resume.set()
        compiling.join(300)
    assert not errors


def test_a_deep_copy_before_the_first_call_uses_its_own_weights(tmp_path):
    model = _stack(Scaled(), Scaled())
    aoti_eager.fuse(model, cache_dir=tmp_path)
    copied = copy.deepcopy(model)
    reference = copy.deepcopy(model)
    aoti_eager.unfuse(reference)
    with torch.no_grad():
        for m in (copied, reference):
            m.blocks[0].fc.weight.mul_(3)
    del model
    gc.collect()
    _same(copied, reference, torch.randn(4, 8))
    assert all("forward" in b.__dict__ for b in copied.blocks)  # fused alike


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_fused_model_copies_after_a_call(tmp_path, how):
    model = _stack(Scaled(), Scaled())
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    x = torch.randn(4, 8)
    _same(model, reference, x)
    if how == "deepcopy":
        copied = copy.deepcopy(model)
    elif how == "pickle":
        copied = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        for m in (copied, reference):
            m.blocks[1].fc.bias.add_(1)
    _same(copied, reference, x)
    assert all("forward" in b.__dict__ for b in copied.blocks)  # fused alike


class Aliasing(torch.nn.Module):
    def __init__(self, returns: str):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.returns = returns

    def forward(self, x, bias=None):
        y = self.fc(x)
        if self.returns == "input":
            return {"y": y, "bias": bias}  # T5's position bias, handed from block to block
        if self.returns == "input view":
            return y, x[1:]
        if self.returns == "view":
            return y, y.view(-1)
        return y, self.fc.weight


@pytest.mark.parametrize("returns", ["input view", "view", "parameter"])
def test_a_result_that_aliases_keeps_eagers_aliasing(tmp_path, returns):
    model = _stack(Aliasing(returns), Aliasing(returns))
    aoti_eager.fuse(model, cache_dir=tmp_path)
    block = model.blocks[0]
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(2):
            y, other = block(x)
            expected = {"input view": x, "view": y, "parameter": block.fc.weight}[returns]
            assert other.untyped_storage().data_ptr() == expected.untyped_storage().data_ptr()
    assert "shares memory" in aoti_eager.stats()[f"region::{Aliasing.__module__}.Aliasing"]["fallback_reason"]


class Passing(Aliasing):
    """A region of its own: its stats() row counts this test's calls."""


def test_a_result_that_is_an_input_is_that_input(tmp_path):
    x, bias = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):  # compiled, then another model of the same blocks
        model = _stack(Passing("input"), Passing("input"))
        reference = copy.deepcopy(model)
        aoti_eager.fuse(model, cache_dir=tmp_path)
        with torch.no_grad():
            for _ in range(3):
                result = model.blocks[0](x, bias=bias)
                torch.testing.assert_close(result["y"], reference.blocks[0](x)["y"])
                assert result["bias"] is bias
    row = aoti_eager.stats()[f"region::{Passing.__module__}.Passing"]
    assert row["hits"] >= 5 and row["compiles"] == 1 and row["fallbacks"] == 0, row


class Dropping(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.fc(x))


def test_a_compile_leaves_the_random_stream_as_eager_does(tmp_path):
    model = _stack(Dropping(), Dropping()).train()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    x = torch.randn(4, 8)
    results = []
    for m in (model, reference):
        torch.manual_seed(7)
        with torch.no_grad():
            # The first call compiles: its masks, and the numbers drawn after it, are the unfused model's.
            results.append([m.blocks[0](x), torch.rand(3)])
    torch.testing.assert_close(results[0], results[1])


def test_recorded_reads_name_the_attributes_read():
    block = Configured(Config(2.0))
    result, reads = region_values.recorded(block, lambda: block(torch.randn(2, 8)))
    assert type(block) is Configured and result.shape == (2, 8)
    assert ("", "config") in reads and ("act", "beta") in reads and ("", "fc") not in reads
    described = dict(region_values.described(block, reads))
    assert described["config"][0] == "object" and ["slope", ["float", "2.0"]] in described["config"][2]


class Offset(Scaled):
    """Reads a tensor that is no parameter or buffer: a constant its kernel would keep."""

    def __init__(self):
        super().__init__()
        self.offset = torch.zeros(8)

    def forward(self, x):
        return super().forward(x) + self.offset


def test_a_plain_tensor_attribute_keeps_the_region_eager(tmp_path):
    model = _stack(Offset(), Offset())
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    x = torch.randn(4, 8)
    _same(model, reference, x)
    for m in (model, reference):
        m.blocks[0].offset.fill_(3.0)  # in place
    _same(model, reference, x)
    assert "register it as a buffer" in aoti_eager.stats()[f"region::{Offset.__module__}.Offset"]["fallback_reason"]


@pytest.mark.parametrize("trace", ["torch.compile", "torch.jit.trace", "torch.export"])
def test_a_fused_model_traced_whole_traces_its_blocks_forwards(tmp_path, trace):
    model = _stack(Scaled(0.5), Scaled(2.0))
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    x = torch.randn(4, 8)
    _same(model, reference, x)
    with torch.no_grad():
        if trace == "torch.compile":
            traced = torch.compile(model, backend="eager")
        elif trace == "torch.jit.trace":
            traced = torch.jit.trace(model, (x,), check_trace=False)
        else:
            traced = torch.export.export(model, (x,)).module()
        for y in (x, torch.randn(4, 8)):
            torch.testing.assert_close(traced(y), reference(y))
