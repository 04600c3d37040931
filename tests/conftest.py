from __future__ import annotations

import pytest
import torch

import aoti_eager

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
    """One cache for the tests that are not about the cold path, so that each
    signature is compiled once per session."""
    return tmp_path_factory.mktemp("aoti_eager_cache")


@pytest.fixture(autouse=True)
def _restore_kernels():
    yield
    aoti_eager.disable()
