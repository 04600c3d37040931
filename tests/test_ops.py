"""Per-op correctness: each case of op_cases.CASES, overridden, against eager."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import aoti_eager
from aoti_eager._ops import qualified_name
from conftest import DEVICES, needs_cuda
from helpers import assert_same_as_eager, clone_tree, xfail_if_kernels_cannot_load
from op_cases import CASES, HALF_PRECISION_CASES, Case


def call(case: Case, args, kwargs):
    return case.op(*args, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_matches_eager(case: Case, device: str, shared_cache):
    check_matches_eager(case, device, shared_cache)


@needs_cuda
@pytest.mark.parametrize("case", HALF_PRECISION_CASES, ids=[c.id for c in HALF_PRECISION_CASES])
def test_matches_eager_cuda_half_precision(case: Case, shared_cache):
    check_matches_eager(case, "cuda", shared_cache)


def in_float(case: Case, args, kwargs, expected):
    """Eager's result computed in float32 on the same values, rounded as ``expected``."""
    upcast = pytree.tree_map_only(torch.Tensor, lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t,
                                  clone_tree((args, kwargs)))
    in_float = call(case, *upcast)
    return pytree.tree_map(lambda f, e: f.to(e.dtype) if isinstance(e, torch.Tensor) else e, in_float, expected)


def check_matches_eager(case: Case, device: str, cache_dir) -> None:
    args, kwargs = case.make(device)
    expected_args, expected_kwargs = clone_tree((args, kwargs))
    expected = call(case, expected_args, expected_kwargs)
    if case.reference_in_float:
        expected = in_float(case, args, kwargs, expected)

    runs = [clone_tree((args, kwargs)) for _ in range(2)]
    with aoti_eager.enabled([case.op], devices=[device], cache_dir=cache_dir):
        # The first call decides the signature (compile or cache), the second
        # must be served by that decision.
        results = [(call(case, a, k), a, k) for a, k in runs]
        stats = aoti_eager.stats()[qualified_name(case.op)]

    for result, run_args, run_kwargs in results:
        assert_same_as_eager(result, expected)
        assert_same_as_eager(run_args, expected_args, "arguments")
        assert_same_as_eager(run_kwargs, expected_kwargs, "keyword arguments")
        if case.returns_input == "out":
            assert result is run_kwargs["out"]
        elif case.returns_input is not None:
            assert result is run_args[case.returns_input]

    assert stats["calls"] == 2
    xfail_if_kernels_cannot_load(stats)
    if case.eager_reason is None:
        assert stats["fallback_reason"] is None, stats
        assert (stats["misses"], stats["hits"], stats["fallbacks"]) == (1, 1, 0), stats
        assert stats["compiles"] + stats["cache_loads"] == 1, stats
    else:
        assert case.eager_reason in stats["fallback_reason"], stats
        assert (stats["hits"], stats["fallbacks"]) == (0, 2), stats
