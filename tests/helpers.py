"""Comparisons against eager, cache entries and a stand-in kernel, shared by the tests."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

import aoti_eager
from aoti_eager.cache import Entry, KernelCache
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE, metadata_digest

SIGNATURE = [{"name": "self", "kind": "tensor", "dtype": "float32", "device": "cpu", "sizes": [4], "strides": [1], "aligned": True}]


def publish_kernel(cache: KernelCache, tmp_path: Path, key: str = "sig", content: bytes = b"\x7fELF kernel",
                   op: str = "aten::abs", sidecar: str | None = None) -> Entry:
    """Publishes a stand-in kernel (bytes, never loaded) under ``key``, with
    ``sidecar`` as its kernel.json if given."""
    library = tmp_path / f"built-{key}-{uuid.uuid4().hex}.so"
    library.write_bytes(content)
    files = {LIBRARY_FILE: library}
    if sidecar is not None:
        files["kernel.json"] = library.with_suffix(".json")
        files["kernel.json"].write_text(sidecar)
    entry = Entry(op=op, signature=SIGNATURE, output_counts=[-1], library=library, compile_seconds=1.5)
    return cache.publish(key, entry, files)


def edit_entry_json(directory: Path, redigest: bool = False, **fields: Any) -> None:
    """Changes fields of an entry's ``entry.json`` by hand; ``redigest`` records
    its digest again, as someone who knew the format would."""
    data = json.loads((directory / ENTRY_FILE).read_text())
    data.update(fields)
    if redigest:
        data["metadata_sha256"] = metadata_digest(data)
    (directory / ENTRY_FILE).write_text(json.dumps(data))


class FakeKernel:
    """A kernel written in Python, with what check_matches_eager uses of a
    compiled one: ``run`` takes the call's tensors in schema order and returns
    the outputs that are not arguments; ``output_counts`` says how they make
    up each return (-1: one tensor, n: a list of n, 0: an argument written into)."""

    def __init__(self, run: Callable[[list[torch.Tensor]], list[torch.Tensor]], output_counts: list[int]):
        self.run = run
        self.output_counts = output_counts


def clone_tree(value: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """Copies every tensor with its exact sizes, strides and storage offset; a
    tensor that appears twice is copied once (aliasing is kept)."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            copy = torch.empty(0, dtype=value.dtype, device=value.device)
            copy.set_(value.untyped_storage().clone(), value.storage_offset(), value.size(), value.stride())
            memo[id(value)] = copy
        return memo[id(value)]
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tree(v, memo) for v in value)
    if isinstance(value, dict):
        return {k: clone_tree(v, memo) for k, v in value.items()}
    return value


def assert_same_as_eager(actual: Any, expected: Any, what: str = "result", **tolerances: float) -> None:
    """Values (assert_close, with ``atol``/``rtol`` if given), dtype, shape and,
    where eager defines them, strides."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: {type(actual)}"
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
        assert actual.device == expected.device, f"{what}: device {actual.device} != {expected.device}"
        if expected.numel() > 1:
            dims = [i for i, n in enumerate(expected.shape) if n > 1]
            assert [actual.stride(i) for i in dims] == [expected.stride(i) for i in dims], (
                f"{what}: strides {actual.stride()} != {expected.stride()}"
            )
        torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}", **tolerances)
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{what}: {actual!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_as_eager(a, e, f"{what}[{i}]", **tolerances)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{what}: {actual.keys()} != {expected.keys()}"
        for k in expected:
            assert_same_as_eager(actual[k], expected[k], f"{what}[{k!r}]", **tolerances)
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def run_shapes(op_name: str, cache_dir: Path, op: Callable, shapes: list, make: Callable, device: str = "cpu",
               **options: Any) -> tuple[list[int], dict[str, Any]]:
    """Each call of ``op`` on ``make(shape)`` with the op enabled (``options``:
    more of enable()'s), compared with eager; the compiles each call made, and
    the op's stats."""
    compiles, results = [], []
    with aoti_eager.enabled([op_name], devices=[device], cache_dir=cache_dir, **options):
        for shape in shapes:
            args = make(shape)
            before = aoti_eager.stats()[op_name]["compiles"]
            results.append((op(*args), args))
            compiles.append(aoti_eager.stats()[op_name]["compiles"] - before)
        stats = aoti_eager.stats()[op_name]
    for result, args in results:
        assert_same_as_eager(result, op(*args), atol=0, rtol=0)
    return compiles, stats


def xfail_if_kernels_cannot_load(stats: dict[str, Any]) -> None:
    """Where AOTInductor's runtime crashes loading kernels (the runtime then
    runs everything eagerly), a test about the compiled path cannot pass."""
    reason = stats.get("fallback_reason") or ""
    if "crashed a test process" in reason:
        import pytest

        pytest.xfail(f"results equal eager's, but kernels cannot be loaded here: {reason}")
