"""Fused regions under autograd (kernels/region_training.py): a block called
with grad enabled and tensors that require grad runs a compiled forward and
a compiled backward, with eager's result and gradients."""

from __future__ import annotations

import copy
import gc
import json
import logging
import subprocess
import sys

import pytest
import torch

import aoti_eager
from aoti_eager import cli
from helpers import ROOT, Block, Model, cpu_cache, delta_since, row


@pytest.fixture(autouse=True)
def _models_let_go():
    yield
    gc.collect()


class Split(Block):
    """Several outputs: two that require grad, an integer one that cannot."""

    def forward(self, x):
        y = super().forward(x)
        return y, torch.tanh(y).sum(-1), y.argmax(-1)


class SplitModel(Model):
    def __init__(self):
        super().__init__(Split)

    def forward(self, x):
        total = 0
        for block in self.blocks:
            x, side, index = block(x)
            total = total + side.sum() + index.float().sum() * 0
        return self.head(x).sum() + total


class Counting(Block):
    """Updates a buffer in training, as BatchNorm's running statistics."""

    def __init__(self):
        super().__init__()
        self.norm2 = torch.nn.BatchNorm1d(16)

    def forward(self, x):
        return self.norm2(super().forward(x))


class Dropping(Block):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(super().forward(x))


def _pair(model_class=Model, seed: int = 0):
    torch.manual_seed(seed)
    model = model_class().train()
    return model, copy.deepcopy(model)


def _step(model, x, scale: float = 1.0):
    loss = model(x).sum() * scale
    loss.backward()
    return loss.detach()


def _assert_same_gradients(model, reference, rtol=1e-4, atol=1e-5):
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)


def test_a_block_under_autograd_runs_its_compiled_forward_and_backward(shared_cache):
    model, reference = _pair()
    aoti_eager.fuse(model, cache_dir=shared_cache)
    x = torch.randn(4, 16, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    for _ in range(2):
        torch.testing.assert_close(_step(model, x), _step(reference, x_eager))
        before = row(Block)
    torch.testing.assert_close(_step(model, x), _step(reference, x_eager))
    # Gradients accumulated over three backward calls, the input's too.
    _assert_same_gradients(model, reference)
    torch.testing.assert_close(x.grad, x_eager.grad)
    assert delta_since(before, Block) == {"calls": 3, "hits": 3, "fallbacks": 0, "compiles": 0, "cache_loads": 0}
    assert type(model.blocks[1](x)).__name__ == "Tensor" and model.blocks[1](x).grad_fn.name() == "_RegionBackward"


def test_a_block_of_several_outputs_and_a_frozen_parameter(shared_cache):
    model, reference = _pair(SplitModel)
    for m in (model, reference):
        for block in m.blocks:
            block.fc1.weight.requires_grad_(False)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    x = torch.randn(4, 16)
    for _ in range(2):
        torch.testing.assert_close(_step(model, x), _step(reference, x))
    _assert_same_gradients(model, reference)
    assert model.blocks[0].fc1.weight.grad is None
    assert row(Split)["hits"] >= 3 and row(Split)["fallbacks"] <= 1, row(Split)


def test_retain_graph_and_tensor_hooks_see_the_kernels_gradients(shared_cache):
    model, reference = _pair()
    aoti_eager.fuse(model, cache_dir=shared_cache)
    x = torch.randn(4, 16, requires_grad=True)
    seen = []
    model.blocks[1].fc2.weight.register_hook(lambda g: seen.append(g.clone()))
    for m in (model, reference):
        loss = m(x).pow(2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    _assert_same_gradients(model, reference)
    assert len(seen) == 2
    torch.testing.assert_close(seen[0] * 2, reference.blocks[1].fc2.weight.grad)


def test_double_backward_through_a_kernel_is_an_error_not_a_wrong_gradient(shared_cache):
    model, _ = _pair()
    aoti_eager.fuse(model, cache_dir=shared_cache)
    x = torch.randn(4, 16, requires_grad=True)
    model(x)  # the first call records what the forward reads, eagerly
    (grad,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad.sum().backward()


def test_a_training_kernel_is_loaded_by_a_new_process(shared_cache):
    model, reference = _pair()
    aoti_eager.fuse(model, cache_dir=shared_cache)
    x = torch.randn(4, 16, requires_grad=True)
    _step(model, x)
    child = subprocess.run([sys.executable, "-c", _CHILD, str(shared_cache), str(ROOT / "tests")],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    stats = json.loads(child.stdout.strip().splitlines()[-1])
    assert stats["compiles"] == 0 and stats["cache_loads"] >= 1 and stats["hits"] >= 3, stats


def test_training_kernels_travel_in_a_signed_bundle_to_a_path_of_any_characters(shared_cache, key, tmp_path, capsys):
    """The backward's library is in the bundle beside the forward's: a new process on the imported cache compiles nothing."""
    model, _ = _pair()
    aoti_eager.fuse(model, cache_dir=shared_cache)
    _step(model, torch.randn(4, 16, requires_grad=True))
    bundle, target = tmp_path / "training.tar.gz", tmp_path / "caché à côté"
    assert cli.main(["--cache-dir", str(shared_cache), "cache", "export", str(bundle), "--sign-key", str(key)]) == 0
    assert cli.main(["--cache-dir", str(target), "cache", "import", str(bundle), "--trust-key", f"{key}.pub"]) == 0
    capsys.readouterr()
    assert any(target.rglob("backward.so"))
    child = subprocess.run([sys.executable, "-c", _CHILD, str(target), str(ROOT / "tests")], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    stats = json.loads(child.stdout.strip().splitlines()[-1])
    assert stats["compiles"] == 0 and stats["cache_loads"] >= 1 and stats["hits"] >= 3, stats


# A new process trains a fused Model for two steps on the cache ARGV[1], checks
# its gradients against eager's, and prints the Block region's stats row.
_CHILD = """
import copy, json, sys
import torch, aoti_eager
sys.path.insert(0, sys.argv[2])
from helpers import Block, Model, row
torch.manual_seed(0)
model = Model().train()
reference = copy.deepcopy(model)
aoti_eager.fuse(model, cache_dir=sys.argv[1])
x = torch.randn(4, 16, requires_grad=True)
for m in (model, reference):
    for _ in range(2):
        m(x).sum().backward()
for p, q in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
print(json.dumps(row(Block)))
"""


def test_the_backward_library_is_under_the_entrys_digests(tmp_path, caplog):
    model, _ = _pair()
    aoti_eager.fuse(model, cache_dir=tmp_path)
    _step(model, torch.randn(4, 16, requires_grad=True))
    backward = list(tmp_path.rglob("backward.so"))
    assert len(backward) == 1
    data = bytearray(backward[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    backward[0].write_bytes(bytes(data))
    op, key = backward[0].parent.parent.name.replace(".", "::", 1), backward[0].parent.name
    assert cpu_cache(tmp_path).lookup(op, key) is None  # set aside: compiled again
    assert "beside the library" in caplog.text and "backward.so" in caplog.text


def test_dropout_in_training_keeps_eagers_statistics(shared_cache):
    torch.manual_seed(0)
    model = Model(Dropping).train()
    aoti_eager.fuse(model, cache_dir=shared_cache)
    block, x = model.blocks[0], torch.randn(64, 16, requires_grad=True)
    block(x)  # the first call records what the forward reads, eagerly
    kept = Block.forward(block, x).detach() * 2  # what dropout(0.5) keeps, scaled
    masks = []
    for _ in range(4):
        out = block(x)
        assert out.grad_fn.name() == "_RegionBackward"
        dropped = out == 0
        torch.testing.assert_close(out[~dropped], kept[~dropped])
        masks.append(dropped)
        (grad,) = torch.autograd.grad(out.sum(), x)
        assert grad.abs().sum() > 0
    share = torch.stack(masks).float().mean().item()
    assert 0.45 < share < 0.55, share
    assert not torch.equal(masks[0], masks[1])  # each call draws anew
    assert row(Dropping)["hits"] >= 4 and row(Dropping)["fallbacks"] == 0, row(Dropping)


def test_a_call_under_autograd_runs_eagerly_with_compile_background(shared_cache):
    """A compile in a thread would set torch's compiling flags under the training loop: the call runs eagerly, with the reason."""
    model, reference = _pair()
    aoti_eager.fuse(model, cache_dir=shared_cache, compile="background")
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for m in (model, reference)]
    x = torch.randn(5, 16)  # a batch no other test compiles
    before = row(Block)
    for _ in range(3):
        losses = []
        for m, optimizer in zip((model, reference), optimizers):
            optimizer.zero_grad()
            losses.append(_step(m, x))
            optimizer.step()
        torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)
    assert aoti_eager.wait(timeout=0)  # nothing was queued
    assert "compile='background' compiles no call under autograd" in row(Block)["fallback_reason"], row(Block)
    grew = delta_since(before, Block)
    assert grew["calls"] == 9 and grew["hits"] == grew["compiles"] == 0, grew


def test_a_block_refused_for_training_runs_eagerly_with_its_reason(shared_cache):
    block, reason = Counting, "writes into its inputs, parameters or buffers"
    torch.manual_seed(0)
    model = Model(block).train()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    x = torch.randn(4, 16)
    torch.manual_seed(1)
    loss = _step(model, x)
    torch.manual_seed(1)
    torch.testing.assert_close(loss, _step(reference, x))
    _assert_same_gradients(model, reference)
    assert reason in row(block)["fallback_reason"] and row(block)["hits"] == 0, row(block)


def test_a_block_refused_in_training_mode_runs_its_kernels_in_eval_mode(shared_cache):
    """The refusal holds for the training flag it was decided with: fine-tuning
    with the block in eval mode (its statistics frozen) runs kernels."""
    torch.manual_seed(0)
    model = Model(Counting).train()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    x = torch.randn(4, 16)
    torch.testing.assert_close(_step(model, x), _step(reference, x))
    for m in (model, reference):
        m.eval()
    before = row(Counting)
    for _ in range(2):
        torch.testing.assert_close(_step(model, x), _step(reference, x))
    _assert_same_gradients(model, reference)
    grew = delta_since(before, Counting)
    assert grew["calls"] == 6 and grew["hits"] >= 3, grew


@pytest.mark.parametrize("use_cache", [False, None])
def test_gpt2_trains_through_its_fused_blocks(shared_cache, caplog, use_cache):
    """Called as users do, its forward builds a KV cache: each layer's call holds its own, of one program (a twin)."""
    transformers = pytest.importorskip("transformers")
    caplog.set_level(logging.INFO, logger="aoti_eager")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                     resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    ids = torch.randint(0, 100, (2, 12))
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    for _ in range(3):
        losses = []
        for m, optimizer in zip((model, reference), optimizers):
            optimizer.zero_grad()
            loss = m(input_ids=ids, labels=ids, **({} if use_cache is None else {"use_cache": use_cache})).loss
            loss.backward()
            losses.append(loss.detach())
        _assert_same_gradients(model, reference)
        for optimizer in optimizers:
            optimizer.step()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    name = "region::transformers.models.gpt2.modeling_gpt2.GPT2Block"
    assert aoti_eager.stats()[name]["hits"] >= 4, aoti_eager.stats()[name]
    if use_cache is None:
        assert "its exported program is one compiled before" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_block_trains_on_cuda_with_eagers_gradients(shared_cache):
    model, reference = _pair()
    model, reference = model.cuda(), reference.cuda()
    aoti_eager.fuse(model, cache_dir=shared_cache)
    x = torch.randn(4, 16, device="cuda", requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    for _ in range(3):
        torch.testing.assert_close(_step(model, x), _step(reference, x_eager))
    _assert_same_gradients(model, reference)
    torch.testing.assert_close(x.grad, x_eager.grad)
    assert row(Block)["hits"] >= 6, row(Block)


def test_autocast_is_part_of_the_key_and_compiled_into_the_kernels(shared_cache):
    model, reference = _pair()
    aoti_eager.fuse(model, cache_dir=shared_cache)
    x = torch.randn(4, 16, requires_grad=True)
    x_eager = x.detach().clone().requires_grad_()
    start = row(Block)
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16):
        before = row(Block)
        for m, given in ((model, x), (reference, x_eager)):
            with torch.autocast("cpu", dtype=dtype):
                out = m(given)
            assert out.dtype == dtype
            out.float().sum().backward()
        assert delta_since(before, Block)["fallbacks"] <= 1, row(Block)  # the first call of a key records what it reads
    _assert_same_gradients(model, reference, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=2e-2, atol=2e-2)
    assert delta_since(start, Block)["hits"] >= 8, row(Block)


# Rank ARGV[3] of ARGV[4] (backend ARGV[6], port ARGV[5]; with nccl, on the GPU of its rank) trains a fused Model
# under DistributedDataParallel beside an eager one, on the cache ARGV[1], its data its rank's, and prints their
# losses and the Block region's row.
_DDP_RANK = """
import copy, json, os, sys
import torch, torch.distributed as dist, aoti_eager
sys.path.insert(0, sys.argv[2])
from helpers import Block, Model, row
rank, world, backend = int(sys.argv[3]), int(sys.argv[4]), sys.argv[6]
device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{sys.argv[5]}", rank=rank, world_size=world)
torch.manual_seed(0)
model = Model().train().to(device)
reference = copy.deepcopy(model)
aoti_eager.fuse(model, cache_dir=sys.argv[1])
ids = [rank] if device.type == "cuda" else None
ddp, eager = (torch.nn.parallel.DistributedDataParallel(m, device_ids=ids) for m in (model, reference))
optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, eager)]
x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank)).to(device)
losses = {"fused": [], "eager": []}
for _ in range(3):
    for name, m, optimizer in zip(("fused", "eager"), (ddp, eager), optimizers):
        optimizer.zero_grad()
        loss = m(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses[name].append(loss.item())
for p, q in zip(model.parameters(), reference.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
print(json.dumps({"losses": losses, "row": row(Block)}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two GPUs"), id="nccl-cuda")])
def test_distributed_data_parallel_trains_as_eager_with_the_kernels_one_rank_compiled(tmp_path, backend):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [subprocess.Popen([sys.executable, "-c", _DDP_RANK, str(tmp_path), str(ROOT / "tests"), str(rank), "2", str(port),
                               backend],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    results = []
    for rank in ranks:
        out, err = rank.communicate(timeout=600)
        assert rank.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]["fused"]), torch.tensor(result["losses"]["eager"]))
        assert result["row"]["hits"] >= 6 and result["row"]["fallbacks"] == 0, result["row"]
    # One rank compiled (two keys: the first block's input requires no grad), under the cache's lock; the other loaded.
    loaded, compiled = sorted((r["row"] for r in results), key=lambda row: row["compiles"])
    assert loaded["compiles"] == 0 and loaded["cache_loads"] == compiled["compiles"] == 2, results


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_of_a_transformers_model_runs_its_blocks_eagerly_with_the_reason(shared_cache, reentrant):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                     resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).train()
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    aoti_eager.fuse(model, cache_dir=shared_cache)
    ids = torch.randint(0, 100, (2, 12))
    for _ in range(2):
        for m in (model, reference):
            m.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
        _assert_same_gradients(model, reference)
    name = "region::transformers.models.gpt2.modeling_gpt2.GPT2Block"
    assert "gradient checkpointing is on" in aoti_eager.stats()[name]["fallback_reason"]


class Checkpointed(Model):
    """Each block called through torch.utils.checkpoint (not reentrant), or not."""

    checkpointed = True

    def forward(self, x):
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def test_a_block_under_torch_utils_checkpoint_saves_what_its_recompute_saves(shared_cache):
    torch.manual_seed(0)
    model = Checkpointed().train()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=shared_cache)
    x = torch.randn(4, 16, requires_grad=True)
    for checkpointed in (True, False, True):
        # Undecided inside a checkpoint: eager in its forward and its recompute; decided outside: the kernel in both.
        model.checkpointed = reference.checkpointed = checkpointed
        for m in (model, reference):
            m.zero_grad()
            m(x).sum().backward()
        _assert_same_gradients(model, reference)
    assert row(Block)["hits"] >= 3, row(Block)
