"""Blocks called with a KV cache (kernels/region_caches.py): the layer's
tensors are the kernel's inputs and outputs, the caller's cache is left as
eager's update leaves it, and caches the kernel does not take run eagerly."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import aoti_eager
from conftest import needs_cuda
from helpers import delta_since, row

transformers = pytest.importorskip("transformers")


# Sizes no other test's blocks have: what a cache call reads (layer_idx) keys every later call of the structure.
def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=48, n_head=3, vocab_size=100, n_positions=96, bos_token_id=0,
                                     eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=100, max_position_embeddings=96,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def _block(model):
    return type(model.model.layers[0] if hasattr(model, "model") else model.transformer.h[0])


def _generate(model, ids, tokens):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)


def _fused(make, cache_dir):
    model = make()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=cache_dir)
    return model, reference


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_plain_forward_fills_the_cache_as_eager_does(make, shared_cache):
    """A causal LM called the ordinary way (use_cache on) builds a DynamicCache for its blocks."""
    model, reference = _fused(make, shared_cache)
    before = row(_block(model))
    ids = torch.randint(1, 100, (2, 9))
    with torch.no_grad():
        actual, expected = model(input_ids=ids), reference(input_ids=ids)
        again = model(input_ids=ids)  # the kernels, each block's reads recorded by now
    torch.testing.assert_close(actual.logits, expected.logits)
    torch.testing.assert_close(again.logits, expected.logits)
    for ours, eager in zip(again.past_key_values.layers, expected.past_key_values.layers):
        assert ours.is_initialized and ours.device == eager.device
        torch.testing.assert_close(ours.keys, eager.keys)
        torch.testing.assert_close(ours.values, eager.values)
    delta = delta_since(before, _block(model))
    assert delta["hits"] >= 2 and delta["fallbacks"] == 0, row(_block(model))["fallback_reason"]


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_generate_gives_eagers_tokens_and_a_longer_one_compiles_nothing(make, shared_cache):
    model, reference = _fused(make, shared_cache)
    ids = torch.randint(1, 100, (1, 7))
    assert _generate(model, ids, 12).tolist() == _generate(reference, ids, 12).tolist()
    before = row(_block(model))
    longer = torch.randint(1, 100, (1, 7))
    assert _generate(model, longer, 30).tolist() == _generate(reference, longer, 30).tolist()
    delta = delta_since(before, _block(model))
    assert delta["compiles"] == 0 and delta["fallbacks"] == 0 and delta["hits"] == delta["calls"] == 2 * 30


def test_another_batch_gives_eagers_tokens(shared_cache):
    model, reference = _fused(_gpt2, shared_cache)
    ids = torch.randint(1, 100, (3, 6))
    before = row(_block(model))  # the region's counts are the process's, over every model of its class
    assert _generate(model, ids, 6).tolist() == _generate(reference, ids, 6).tolist()
    assert delta_since(before, _block(model))["fallbacks"] == 0, row(_block(model))["fallback_reason"]


def test_a_static_cache_runs_eagerly_with_its_reason(shared_cache):
    model, reference = _fused(_gpt2, shared_cache)
    ids = torch.randint(1, 100, (1, 5))
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static")
        expected = reference.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                      cache_implementation="static")
    assert tokens.tolist() == expected.tolist()
    assert "its cache is of type StaticCache (of transformers' caches" in row(_block(model))["fallback_reason"]


class Peeking(torch.nn.Module):
    """Adds its cache's length to its output: it reads more of its cache than its own layer's update."""

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, cache):
        keys, _ = cache.update(self.proj(x)[:, None], x[:, None], self.layer_idx)
        return keys.sum(2)[:, 0] + cache.get_seq_length(0)


def test_a_block_that_reads_more_of_its_cache_runs_eagerly(shared_cache):
    blocks = torch.nn.ModuleList([Peeking(0), Peeking(1)]).eval()
    reference = copy.deepcopy(blocks)
    aoti_eager.fuse(blocks, cache_dir=shared_cache)
    ours, theirs = transformers.DynamicCache(), transformers.DynamicCache()
    x = torch.randn(2, 1, 8)
    with torch.no_grad():
        for _ in range(3):
            a = blocks[1](blocks[0](x, ours), ours)
            b = reference[1](reference[0](x, theirs), theirs)
            torch.testing.assert_close(a, b)
    torch.testing.assert_close(ours.layers[1].keys, theirs.layers[1].keys)
    assert "uses its cache's 'get_seq_length'" in row(Peeking)["fallback_reason"]


TWIN = "its exported program is one compiled before"


@pytest.mark.parametrize("scaled", [False, True], ids=["same", "scaled by layer"])
def test_a_layer_whose_program_is_another_layers_takes_its_library(scaled, tmp_path, caplog):
    """A layer's kernel differs from another's by the index of its cache
    layer alone: the exported programs are one, and the library is copied.
    GPT-2 scaled by the inverse layer index has two programs: two compiles."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=48, n_head=3, vocab_size=100, n_positions=96, scale_attn_by_inverse_layer_idx=scaled)).eval()
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=tmp_path)
    ids = torch.randint(1, 100, (1, 6))
    with caplog.at_level(logging.INFO, logger="aoti_eager"), torch.no_grad():
        model(input_ids=ids)
        actual, expected = model(input_ids=ids).logits, reference(input_ids=ids).logits
    torch.testing.assert_close(actual, expected)
    compiled = [r.getMessage() for r in caplog.records if "aoti_eager: compiled region::" in r.getMessage()]
    assert len(compiled) == 2 and sum(TWIN in line for line in compiled) == (0 if scaled else 1), compiled


@needs_cuda
def test_generate_on_cuda_gives_eagers_tokens(shared_cache):
    """fp32: bf16's near-tied logits of random weights would part greedy tokens on any compiled side."""
    model, reference = _fused(_llama, shared_cache)
    model.cuda(), reference.cuda()
    ids = torch.randint(1, 100, (2, 7), device="cuda")
    assert _generate(model, ids, 16).tolist() == _generate(reference, ids, 16).tolist()
    assert row(_block(model))["fallbacks"] == 0, row(_block(model))["fallback_reason"]


def test_a_generation_compiles_a_prefill_and_a_decode_kernel_per_layer(tmp_path, caplog):
    """The decode kernel takes its cache's length from its first step; the second layer's are the first's programs."""
    model, reference = _fused(_gpt2, tmp_path)
    ids = torch.randint(1, 100, (1, 6))
    with caplog.at_level(logging.INFO, logger="aoti_eager"):
        assert _generate(model, ids, 10).tolist() == _generate(reference, ids, 10).tolist()
    compiled = [r.getMessage() for r in caplog.records if "aoti_eager: compiled region::" in r.getMessage()]
    assert len(compiled) == 4 and sum(TWIN in line for line in compiled) == 2, compiled
