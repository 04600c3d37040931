"""Faults injected into a copy of a really compiled entry: the runtime never
loads it, says why in a log line, and the call still gives eager's result."""

from __future__ import annotations

import logging
import os
import shutil
import stat

import pytest
import torch

import aoti_eager
from aoti_eager import _runtime
from aoti_eager.cache import KernelCache, inventory
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE
from aoti_eager.kernels import CallSignature, CompileError
from aoti_eager.kernels.compile import compile_options
from aoti_eager.kernels.load_probe import VERDICT_FILE
from helpers import assert_same_as_eager

X = torch.linspace(-3, 3, 128)


@pytest.fixture(scope="module")
def compiled_entry(shared_cache):
    """The entry of ``abs`` on X, compiled once into the session's cache."""
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=shared_cache):
        torch.abs(X)
    signature = CallSignature.of(torch.ops.aten.abs.default, "cpu", [X])
    return KernelCache(shared_cache, signature.device, compile_options("cpu", shared_cache)).entry_dir("aten::abs", signature.key)


@pytest.fixture
def entry(compiled_entry, tmp_path):
    """A copy of the compiled entry in a cache of its own."""
    copy = tmp_path / compiled_entry.relative_to(compiled_entry.parents[3])
    copy.parent.mkdir(parents=True, mode=0o700)
    os.chmod(copy.parents[1], 0o700)
    os.chmod(copy.parents[2], 0o700)
    shutil.copytree(compiled_entry, copy)
    shutil.copyfile(compiled_entry.parents[1] / VERDICT_FILE, copy.parents[1] / VERDICT_FILE)
    return copy


def run_abs(cache_dir, monkeypatch):
    """abs(X) with the entry's cache; a compile, were one tried, fails (eager)."""
    compiles = []

    def no_compile(signature, *args):
        compiles.append(signature)
        raise CompileError("injected: no compile in this test")

    monkeypatch.setattr(_runtime, "compile_call", no_compile)
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=cache_dir):
        results = [torch.abs(X) for _ in range(3)]
        stats = aoti_eager.stats()["aten::abs"]
    for result in results:
        assert_same_as_eager(result, X.abs())
    return stats, compiles


def test_the_intact_copy_is_loaded(entry, tmp_path, monkeypatch):
    stats, compiles = run_abs(tmp_path, monkeypatch)
    assert (stats["cache_loads"], stats["hits"], stats["fallbacks"]) == (1, 2, 0), stats
    assert not compiles


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGES = {
    "truncated-artifact": (lambda d: os.truncate(d / LIBRARY_FILE, 4096), "sha256"),
    "altered-artifact": (lambda d: flip_a_byte(d / LIBRARY_FILE), "sha256"),
    "corrupt-json": (lambda d: (d / ENTRY_FILE).write_text((d / ENTRY_FILE).read_text()[:-20]), "unreadable entry.json"),
    "missing-artifact": (lambda d: (d / LIBRARY_FILE).unlink(), "FileNotFoundError"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_entry_is_set_aside_and_the_call_runs_eagerly(damage, entry, tmp_path, monkeypatch, caplog):
    inflict, reason = DAMAGES[damage]
    inflict(entry)
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        stats, compiles = run_abs(tmp_path, monkeypatch)
    assert any("set aside" in r.message and reason in r.message for r in caplog.records), caplog.text
    assert (stats["cache_loads"], stats["hits"], stats["fallbacks"]) == (0, 0, 3), stats
    assert len(compiles) == 1  # set aside, then compiled again (here: fails, so eager)
    assert len(inventory.quarantined(tmp_path)) == 1


def give_to_another_user(entry):
    os.chown(entry / LIBRARY_FILE, 65534, -1)


def make_group_writable(entry):
    os.chmod(entry / LIBRARY_FILE, stat.S_IMODE((entry / LIBRARY_FILE).stat().st_mode) | stat.S_IWGRP)


@pytest.mark.parametrize(
    "tamper",
    [
        make_group_writable,
        pytest.param(give_to_another_user, marks=pytest.mark.skipif(os.getuid() != 0, reason="chown needs root")),
    ],
)
def test_an_entry_someone_else_could_write_is_refused(tamper, entry, tmp_path, monkeypatch, caplog):
    tamper(entry)
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        stats, compiles = run_abs(tmp_path, monkeypatch)
    assert any("refused an untrusted cache entry" in r.message for r in caplog.records), caplog.text
    assert (stats["cache_loads"], stats["hits"], stats["fallbacks"]) == (0, 0, 3), stats
    assert not compiles
    assert (entry / LIBRARY_FILE).exists()  # refused, left where it is


def test_last_use_is_recorded_once_per_process_not_per_call(entry, tmp_path, monkeypatch):
    os.utime(entry, (1000, 1000))
    monkeypatch.setattr(KernelCache, "lookup", counting(KernelCache.lookup, lookups := []))
    stats, _ = run_abs(tmp_path, monkeypatch)
    assert stats["hits"] == 2 and len(lookups) == 1
    assert entry.stat().st_mtime > 1000


def counting(function, calls):
    def wrapper(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    return wrapper


def misplace_paths(root, entry):
    """Blocks every write a miss makes, for any user: the lock of the cached
    op is a directory, and the directory of another op a file."""
    (entry.parent / ".lock").mkdir()
    (entry.parents[1] / "aten.neg").write_bytes(b"")


def make_read_only(root, entry):
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        os.chmod(directory, 0o555)


@pytest.mark.parametrize(
    "block",
    [
        misplace_paths,
        pytest.param(make_read_only, marks=pytest.mark.skipif(
            os.geteuid() == 0, reason="chmod does not stop root's writes (misplace_paths blocks them for root)")),
    ],
)
def test_a_cache_that_cannot_be_written_serves_its_kernels_and_runs_misses_eagerly(block, entry, tmp_path, monkeypatch, caplog):
    block(tmp_path, entry)
    monkeypatch.setattr(_runtime, "compile_call", lambda *a, **k: pytest.fail("must not compile: the cache cannot be written"))
    other = torch.linspace(-1, 1, 96)
    try:
        with caplog.at_level(logging.WARNING, logger="aoti_eager"):
            with aoti_eager.enabled(["aten::abs.default", "aten::neg.default"], devices=["cpu"], cache_dir=tmp_path):
                cached = [torch.abs(X) for _ in range(2)]
                missed = [torch.abs(other) for _ in range(3)] + [torch.neg(X) for _ in range(3)]
                stats = aoti_eager.stats()
    finally:
        for directory in [tmp_path, *(p for p in tmp_path.rglob("*") if p.is_dir())]:
            os.chmod(directory, 0o700)
    for result in cached:
        assert_same_as_eager(result, X.abs())
    for result, expected in zip(missed, [other.abs()] * 3 + [X.neg()] * 3):
        assert_same_as_eager(result, expected)
    assert (stats["aten::abs"]["cache_loads"], stats["aten::abs"]["hits"]) == (1, 1), stats
    # Remembered: one miss per signature, not one per call.
    assert (stats["aten::abs"]["misses"], stats["aten::neg"]["misses"]) == (2, 1), stats
    warnings = [r for r in caplog.records if "cannot be used" in r.getMessage()]
    assert sorted(r.getMessage().split()[1] for r in warnings) == ["aten::abs", "aten::neg"], caplog.text
    assert not any(r.exc_info for r in caplog.records), caplog.text
