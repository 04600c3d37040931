"""CUDA-only behaviour: streams, devices, pinned memory, CPU scalars, graph capture.

(The per-op table in test_ops.py runs on CUDA too.)"""

from __future__ import annotations

import pytest
import torch

import aoti_eager
from conftest import needs_cuda
from helpers import assert_same_as_eager, xfail_if_kernels_cannot_load

pytestmark = needs_cuda


def test_cuda_runs_on_the_current_stream(shared_cache):
    x = torch.randn(1 << 20, device="cuda")
    new_values = torch.randn(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    with aoti_eager.enabled(["aten::abs.default"], devices=["cuda"], cache_dir=shared_cache):
        torch.abs(x)  # decide the signature
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            # The copy waits behind the sleep: a kernel launched on any other
            # stream than this one would read x before it.
            torch.cuda._sleep(50_000_000)
            x.copy_(new_values)
            y = torch.abs(x)
        torch.cuda.current_stream().wait_stream(side)
        stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(y, new_values.abs())
    xfail_if_kernels_cannot_load(stats)
    assert stats["hits"] == 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.skipif(
    torch.cuda.device_count() >= 2 and torch.cuda.get_device_capability(0) != torch.cuda.get_device_capability(1),
    reason="needs two GPUs of one architecture",
)
def test_cuda_kernel_compiled_for_one_device_serves_another(tmp_path):
    x0 = torch.randn(4096, device="cuda:0")
    x1 = x0.to("cuda:1")
    with aoti_eager.enabled(["aten::abs.default"], devices=["cuda"], cache_dir=tmp_path):
        with torch.cuda.device(0):  # cuda:1's input is not on the current device
            y0 = torch.abs(x0)
            y1 = torch.abs(x1)
            y1 = torch.abs(x1)
        stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(y0, x0.abs())
    assert_same_as_eager(y1, x1.abs())
    xfail_if_kernels_cannot_load(stats)
    # The cache is keyed by architecture, not device index: cuda:1 loads the
    # kernel compiled for cuda:0.
    assert (stats["compiles"], stats["cache_loads"], stats["hits"]) == (1, 1, 1), stats


def test_cuda_copies_from_pinned_memory(shared_cache):
    pinned = torch.randn(4096).pin_memory()
    expected = pinned.to("cuda").abs()
    with aoti_eager.enabled(["aten::abs.default"], devices=["cuda"], cache_dir=shared_cache):
        for _ in range(2):
            # _to_copy's CUDA copy_, and a direct one, from a CPU source.
            x = pinned.to("cuda", non_blocking=True)
            y = torch.abs(x)
            z = torch.empty_like(x).copy_(pinned, non_blocking=True).abs()
        stats = aoti_eager.stats()
    assert_same_as_eager(y, expected)
    assert_same_as_eager(z, expected)
    xfail_if_kernels_cannot_load(stats["aten::abs"])
    assert (stats["aten::abs"]["misses"], stats["aten::abs"]["hits"]) == (1, 3), stats


@pytest.mark.parametrize("cpu_first", [False, True])
def test_cuda_with_a_cpu_tensor_raises_eagers_error(cpu_first, shared_cache):
    args = (torch.randn(8, device="cuda"), torch.randn(8))
    args = args[::-1] if cpu_first else args
    with pytest.raises(Exception) as eager:
        torch.add(*args)
    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu", "cuda"], cache_dir=shared_cache):
        with pytest.raises(type(eager.value)) as overridden:
            torch.add(*args)
        stats = aoti_eager.stats()["aten::add.Tensor"]
    assert type(overridden.value) is type(eager.value)
    assert str(overridden.value).splitlines()[0] == str(eager.value).splitlines()[0]
    assert (stats["calls"], stats["hits"]) == (1, 0), stats


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



@pytest.mark.parametrize("op", ["mm", "addmm", "bmm"])
def test_cuda_matmul_with_an_unaligned_dim_runs_padded_with_eagers_strides(op, tmp_path):
    # An odd vocabulary: the kernel pads the weight's rows, and copies its result into eager's layout.
    x, weight = torch.randn(512, 60, device="cuda", dtype=torch.bfloat16), torch.randn(1001, 60, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1001, device="cuda", dtype=torch.bfloat16)
    call = {
        "mm": lambda: torch.mm(x, weight.t()),
        "addmm": lambda: torch.addmm(bias, x, weight.t()),
        "bmm": lambda: torch.bmm(x.view(4, 128, 60), weight.t().expand(4, 60, 1001)),
    }[op]
    from torch._inductor import metrics

    generated = metrics.generated_kernel_count
    with aoti_eager.enabled([f"aten::{op}"], devices=["cuda"], cache_dir=tmp_path):
        y = call()
        stats = aoti_eager.stats()[f"aten::{op}"]
    assert_same_as_eager(y, call())
    xfail_if_kernels_cannot_load(stats)
    assert (stats["compiles"], stats["fallbacks"]) == (1, 0), stats
    assert metrics.generated_kernel_count > generated  # the padding and the copy: cuBLAS alone generates none
