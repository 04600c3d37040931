"""A region's kernel against eager (kernels/region.py, kernels/validate.py):
judged as torch's accuracy checks judge it, against a float64 run where one
op's tolerance refuses it, and a refusal kept to the process that measured
it (its key holds the block's structure, not the weights it was measured with)."""

from __future__ import annotations

import pytest
import torch

import aoti_eager
from aoti_eager import _regions
from aoti_eager.kernels import pipeline
from aoti_eager.kernels.pipeline import Published
from aoti_eager.kernels.region import RegionCall, region_name, state_of, state_structure
from aoti_eager.kernels.region_target import RegionTarget
from helpers import FakeKernel, cache_entries, fake_artifact, row

WIDTH = 1024


def spread(offset: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    x = x + offset
    return (x * x).mean(-1) - x.mean(-1).square()


class Spread(torch.nn.Module):
    """Each row's variance as E[x²] - E[x]², of rows far from 0: in float32,
    eager's result is itself ~1e-4 (relative) from a float64 run."""

    def __init__(self, offset: float = 50.0):
        super().__init__()
        self.offset = torch.nn.Parameter(torch.full((WIDTH,), offset))

    def forward(self, x):
        return spread(self.offset, x)


def as_near_float64_as_eager(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Eager's error, mirrored around the float64 result: as near it as eager
    is, and twice eager's error away from eager's result."""
    exact = spread(*(t.double() for t in inputs))
    return [(2 * exact - spread(*inputs)).float()]


def wrong(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [spread(*inputs) * 1.03]


def _call(module: Spread, x: torch.Tensor) -> RegionCall:
    names, tensors = state_of(module)
    return RegionCall.of(region_name(module), names, tensors, state_structure(module, names, tensors), (x,), {})


def test_a_float32_kernel_as_near_float64_as_eager_is_published(cache, tmp_path, monkeypatch, swap_compiler):
    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "0")
    swap_compiler(compile_module=fake_artifact(tmp_path))
    module, x = Spread().eval(), torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = module(x)
        kernel = FakeKernel(as_near_float64_as_eager, [-1])
        with pytest.raises(AssertionError):
            torch.testing.assert_close(kernel.run([module.offset, x])[0], expected)  # what float32's tolerance refuses
    call = _call(module, x)
    outcome = pipeline.compile_target(RegionTarget(module, call), cache, lambda library, counts: kernel)
    assert isinstance(outcome, Published), outcome
    assert cache.lookup(call.name, call.key).library is not None


def test_a_kernel_that_disagrees_is_refused_for_this_process_and_not_recorded(tmp_path, swap_loading, swap_compiler):
    compiled = []
    compile = fake_artifact(tmp_path)
    swap_compiler(compile_module=lambda *args, **kwargs: compiled.append(1) or compile(*args, **kwargs))
    swap_loading(library=lambda *args: pytest.fail("nothing was published to load") if args[6] else FakeKernel(wrong, [-1]))
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0))

    def calls(module: Spread) -> None:
        reference = spread(module.offset.detach(), x)
        aoti_eager.fuse(module, [Spread], cache_dir=tmp_path)
        with torch.no_grad():
            for _ in range(2):
                torch.testing.assert_close(module(x), reference, rtol=0, atol=0)

    calls(Spread())
    assert row(Spread)["fallback_reason"].startswith("compiled kernel disagrees with eager: the region's result")
    assert (len(compiled), cache_entries(tmp_path)) == (1, [])  # decided once for this process, recorded nowhere
    # A new process (no decision of this one), a block of the same structure with other weights: checked again.
    _regions.forget()
    calls(Spread(offset=20.0))
    assert (len(compiled), cache_entries(tmp_path)) == (2, [])
