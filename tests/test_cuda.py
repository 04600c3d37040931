"""CUDA-only behaviour: streams, devices, pinned memory, CPU scalars, graph capture.

(The per-op table in test_ops.py runs on CUDA too.)"""

from __future__ import annotations

import pytest
import torch

import aoti_eager
from helpers import assert_same_as_eager, xfail_if_kernels_cannot_load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_runs_on_the_current_stream(shared_cache):
    x = torch.randn(1 << 20, device="cuda")
    expected = torch.abs(x)
    side = torch.cuda.Stream()
    with aoti_eager.enabled(["aten::abs.default"], devices=["cuda"], cache_dir=shared_cache):
        torch.abs(x)  # decide the signature
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y = torch.abs(x)
            z = y * 1  # ordered after y on the side stream only
        torch.cuda.current_stream().wait_stream(side)
        stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(z, expected)
    xfail_if_kernels_cannot_load(stats)
    assert stats["hits"] == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_input_on_another_device_than_the_current_one(shared_cache):
    x0 = torch.randn(4096, device="cuda:0")
    x1 = x0.to("cuda:1")
    with aoti_eager.enabled(["aten::abs.default"], devices=["cuda"], cache_dir=shared_cache):
        with torch.cuda.device(0):
            y0 = torch.abs(x0)
            y1 = torch.abs(x1)
            y1 = torch.abs(x1)
        stats = aoti_eager.stats()["aten::abs"]
    assert y1.device == torch.device("cuda:1")
    assert_same_as_eager(y1.cpu(), y0.cpu())
    assert stats["compiles"] + stats["cache_loads"] <= 2 and stats["hits"] >= 1


def test_cuda_pinned_memory_input(shared_cache):
    x = torch.randn(128).pin_memory()
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=shared_cache):
        y = torch.abs(x)
        y = torch.abs(x)
    assert_same_as_eager(y, x.abs())


def test_cuda_with_a_cpu_scalar_tensor_runs_eagerly(shared_cache):
    x = torch.randn(64, device="cuda")
    s = torch.tensor(2.5)
    expected = torch.mul(x, s)
    with aoti_eager.enabled(["aten::mul.Tensor"], devices=["cuda"], cache_dir=shared_cache):
        y = torch.mul(x, s)
        stats = aoti_eager.stats()["aten::mul.Tensor"]
    assert_same_as_eager(y, expected)
    assert "cpu tensor" in stats["fallback_reason"]


def test_cuda_graph_capture_replays_the_kernel(shared_cache):
    x = torch.randn(1 << 16, device="cuda")
    with aoti_eager.enabled(["aten::abs.default", "aten::neg.default"], devices=["cuda"], cache_dir=shared_cache):
        torch.abs(x)  # compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = torch.abs(x)
            z = torch.neg(x)  # a new signature during capture runs eagerly
        x.copy_(torch.randn(1 << 16, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
    assert_same_as_eager(y, x.abs())
    assert_same_as_eager(z, x.neg())
