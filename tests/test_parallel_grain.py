"""A dynamic CPU kernel's loop nests take one thread per ATen grain of work."""

from __future__ import annotations

import pytest
import torch

from aoti_eager.kernels.compile import compile_options
from aoti_eager.kernels.inductor.parallel_grain import GRAIN_SIZE, parallel_above_grain
from helpers import assert_same_as_eager


class _AddThenNorm(torch.nn.Module):
    """A pointwise loop nest and a reduction's."""

    def forward(self, x, y):
        s = x + y
        return s, torch.nn.functional.layer_norm(s, (s.shape[-1],))


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grain")
    example = (torch.randn(8, 1024), torch.randn(8, 1024))
    rows = torch.export.Dim("rows")
    exported = torch.export.export(_AddThenNorm(), example, dynamic_shapes=({0: rows}, {0: rows}), strict=False)
    options = {**compile_options("cpu"), "cpp.dynamic_threads": True, "aot_inductor.output_path": str(directory / "k.so")}
    with parallel_above_grain():
        library = torch._inductor.aot_compile(exported.module(), example, options=options)
    sources = "\n".join(p.read_text() for p in directory.rglob("*.cpp"))
    return torch._C._aoti.AOTIModelContainerRunnerCpu(library, 1), sources


def test_every_parallel_region_is_sized_by_its_work(kernel):
    _, sources = kernel
    regions = [line.strip() for line in sources.splitlines() if "#pragma omp parallel" in line]
    assert regions, "the kernel has no parallel region to size"
    assert all(f"/ {GRAIN_SIZE}" in line and "num_threads(" in line for line in regions), regions


@pytest.mark.parametrize("rows", [2, 8, 4 * GRAIN_SIZE // 1024 + 3])  # below the grain, and over several grains
def test_results_are_eagers_below_and_above_the_grain(kernel, rows):
    runner, _ = kernel
    x, y = torch.randn(rows, 1024), torch.randn(rows, 1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        added, normed = runner.run([x, y])
    finally:
        torch.set_num_threads(threads)
    expected_added, expected_normed = _AddThenNorm()(x, y)
    assert_same_as_eager(added, expected_added)
    assert_same_as_eager(normed, expected_normed)


def test_inductor_is_left_as_it_was():
    from torch._inductor.codegen import cpp

    before = (cpp.CppKernelProxy.codegen_loops_impl, cpp.WorkSharing.parallel)
    with parallel_above_grain():
        assert cpp.WorkSharing.parallel is not before[1]
    assert (cpp.CppKernelProxy.codegen_loops_impl, cpp.WorkSharing.parallel) == before
