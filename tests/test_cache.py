"""The persistent store: publication, lookup, integrity and keys."""

from __future__ import annotations

import json
import os
import stat
import threading
import uuid

import filelock
import pytest
import torch

from aoti_eager.cache import Entry, KernelCache, UntrustedEntry, layout
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE

CPU = torch.device("cpu")
SIGNATURE = [{"name": "self", "kind": "tensor", "dtype": "float32", "sizes": [4], "strides": [1]}]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "cpu_isa", lambda root: "avx2")
    return KernelCache(tmp_path, CPU)


def publish_kernel(cache: KernelCache, tmp_path, key: str = "sig", content: bytes = b"\x7fELF kernel") -> Entry:
    library = tmp_path / f"built-{key}-{uuid.uuid4().hex}.so"
    library.write_bytes(content)
    entry = Entry(op="aten::abs", signature=SIGNATURE, output_counts=[-1], library=library, compile_seconds=1.5)
    return cache.publish(key, entry, {LIBRARY_FILE: library})


def test_publish_then_lookup(cache, tmp_path):
    published = publish_kernel(cache, tmp_path)
    found = cache.lookup("aten::abs", "sig")
    assert found.library == published.library == cache.entry_dir("aten::abs", "sig") / LIBRARY_FILE
    assert found.library.read_bytes() == b"\x7fELF kernel"
    assert (found.signature, found.output_counts, found.compile_seconds) == (SIGNATURE, [-1], 1.5)
    assert len(found.sha256) == 64


def test_entry_json_holds_the_input_metadata(cache, tmp_path):
    publish_kernel(cache, tmp_path)
    data = json.loads((cache.entry_dir("aten::abs", "sig") / ENTRY_FILE).read_text())
    assert data["signature"] == SIGNATURE
    assert data["library"] == LIBRARY_FILE
    assert data["compile_seconds"] == 1.5


def test_eager_entries_have_no_library(cache):
    cache.publish("sig", Entry(op="aten::abs", signature=SIGNATURE, reason="torch.export failed: X"))
    found = cache.lookup("aten::abs", "sig")
    assert found.library is None and found.reason == "torch.export failed: X"


def test_directories_are_private_and_no_temporary_files_remain(cache, tmp_path):
    publish_kernel(cache, tmp_path)
    op_dir = cache.entry_dir("aten::abs", "sig").parent
    for directory in (op_dir, op_dir.parent, cache.entry_dir("aten::abs", "sig")):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert not [p for p in op_dir.iterdir() if p.name.startswith(".tmp-")]


def test_missing_entry(cache):
    assert cache.lookup("aten::abs", "nothing-here") is None


@pytest.mark.parametrize("damage", ["corrupt-json", "altered-artifact", "truncated-artifact", "missing-artifact"])
def test_damaged_entry_is_set_aside_alone(cache, tmp_path, damage):
    publish_kernel(cache, tmp_path, "good")
    publish_kernel(cache, tmp_path, "bad", content=b"\x7fELF another kernel")
    directory = cache.entry_dir("aten::abs", "bad")
    if damage == "corrupt-json":
        (directory / ENTRY_FILE).write_text("{not json")
    elif damage == "altered-artifact":
        (directory / LIBRARY_FILE).write_bytes(b"\x7fELF anotheR kernel")
    elif damage == "truncated-artifact":
        (directory / LIBRARY_FILE).write_bytes(b"\x7fELF")
    else:
        (directory / LIBRARY_FILE).unlink()
    assert cache.lookup("aten::abs", "bad") is None
    assert not directory.exists()
    assert any((tmp_path / "quarantine").iterdir())
    assert cache.lookup("aten::abs", "good") is not None


def test_first_publisher_wins(cache, tmp_path):
    first = publish_kernel(cache, tmp_path, content=b"first")
    second = publish_kernel(cache, tmp_path, content=b"second")
    assert second.sha256 == first.sha256
    assert cache.lookup("aten::abs", "sig").library.read_bytes() == b"first"


def test_concurrent_publishers_leave_one_complete_entry(cache, tmp_path):
    errors = []

    def publish(i):
        try:
            publish_kernel(cache, tmp_path, content=f"kernel {i}".encode())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert cache.lookup("aten::abs", "sig").library.read_bytes().startswith(b"kernel ")


def test_environment_key_changes_with_what_shapes_a_kernel(tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "cpu_isa", lambda root: "avx2")
    base = layout.environment_key(tmp_path, CPU)
    assert base.startswith("cpu-avx2-torch")
    monkeypatch.setattr(layout, "cpu_isa", lambda root: "avx512")
    assert layout.environment_key(tmp_path, CPU) != base
    monkeypatch.setattr(layout, "cpu_isa", lambda root: "avx2")
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert layout.environment_key(tmp_path, CPU) != base
    monkeypatch.undo()


def test_environment_key_names_the_compiler_and_the_inductor_options(tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "cpu_isa", lambda root: "avx2")
    base = layout.environment_key(tmp_path, CPU, {"cpp.min_chunk_size": 32768})
    assert layout.environment_key(tmp_path, CPU, {"cpp.min_chunk_size": 1}) != base
    monkeypatch.setattr(layout, "cpp_compiler", lambda compiler=None: "g++: g++ 99.0")
    assert layout.environment_key(tmp_path, CPU, {"cpp.min_chunk_size": 32768}) != base


def test_entries_abandoned_mid_publish_are_removed_under_the_lock(cache, tmp_path):
    publish_kernel(cache, tmp_path)
    op_dir = cache.entry_dir("aten::abs", "sig").parent
    abandoned = op_dir / ".tmp-deadbeef"
    abandoned.mkdir()
    (abandoned / LIBRARY_FILE).write_bytes(b"half")
    with cache.lock("aten::abs"):
        cache.remove_abandoned("aten::abs")
    assert not abandoned.exists()
    assert cache.lookup("aten::abs", "sig") is not None


def test_device_index_is_not_in_the_key(tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "cpu_isa", lambda root: "avx2")
    assert layout.environment_key(tmp_path, torch.device("cpu")) == layout.environment_key(tmp_path, torch.device("cpu", 0))


def test_isa_probe_is_remembered_on_disk(tmp_path, monkeypatch):
    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    calls = []
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: calls.append(1) or "avx512")
    layout._cpu_isa.cache_clear()
    assert layout.cpu_isa(tmp_path) == "avx512"
    layout._cpu_isa.cache_clear()
    assert layout.cpu_isa(tmp_path) == "avx512"
    assert calls == [1]
    layout._cpu_isa.cache_clear()


def test_default_root_is_per_user(monkeypatch):
    monkeypatch.delenv("AOTI_EAGER_CACHE_DIR", raising=False)
    root = layout.default_root()
    assert root.name == "aoti_eager" and str(root).startswith(os.path.expanduser("~"))


@pytest.mark.parametrize("what", ["entry-dir", "artifact", "environment-dir"])
def test_group_writable_entries_are_refused(cache, tmp_path, what):
    publish_kernel(cache, tmp_path)
    directory = cache.entry_dir("aten::abs", "sig")
    target = {"entry-dir": directory, "artifact": directory / LIBRARY_FILE, "environment-dir": cache.directory}[what]
    os.chmod(target, stat.S_IMODE(target.stat().st_mode) | stat.S_IWGRP)
    with pytest.raises(UntrustedEntry, match="writable by group or others"):
        cache.lookup("aten::abs", "sig")
    assert directory.exists()  # refused, not deleted


@pytest.mark.skipif(os.getuid() != 0, reason="changing a file's owner needs root")
def test_entries_of_another_user_are_refused(cache, tmp_path):
    publish_kernel(cache, tmp_path)
    os.chown(cache.entry_dir("aten::abs", "sig") / LIBRARY_FILE, 65534, -1)
    with pytest.raises(UntrustedEntry, match="belongs to uid 65534"):
        cache.lookup("aten::abs", "sig")


def test_lock_file_is_private_and_times_out(cache):
    held = cache.lock("aten::abs")
    with held:
        assert stat.S_IMODE((cache.entry_dir("aten::abs", "x").parent / ".lock").stat().st_mode) == 0o600
        with pytest.raises(filelock.Timeout):
            cache.lock("aten::abs", timeout=0.1).acquire()
