"""The examples in docstrings run, and give what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

import aoti_eager  # noqa: F401 - gives kernels/ the wrapped-number test that examples use

# Modules whose examples stand alone. Those of aoti_eager, _prewarm,
# load_probe and cache.{remote,resp,signing,store} need a manifest, a server, a
# key or a library built first: they show use, and are not run.
MODULES = [
    "aoti_eager._ops", "aoti_eager._reach", "aoti_eager.kernels.compile", "aoti_eager.kernels.dynamic",
    "aoti_eager.kernels.examples", "aoti_eager.kernels.signature", "aoti_eager.kernels.wrapper_split",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples that write files write them here
    results = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert results.failed == 0, f"{results.failed} of {results.attempted} examples of {name} failed (output above)"
