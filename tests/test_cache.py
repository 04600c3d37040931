"""The persistent store: publication, lookup, integrity, keys, trust and eviction."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time

import filelock
import pytest
import torch

from aoti_eager.cache import Entry, KernelCache, UntrustedEntry, inventory, layout
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE
from aoti_eager.kernels import toolchain
from aoti_eager.kernels.toolchain import environment_name
from helpers import SIGNATURE, edit_entry_json, publish_kernel

CPU = torch.device("cpu")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain, "cpu_isa", lambda: "avx2")
    return KernelCache(tmp_path, environment_name(CPU))


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


DAMAGES = {
    "corrupt-json": (lambda d: (d / ENTRY_FILE).write_text("{not json"), "unreadable entry.json"),
    "json-without-fields": (lambda d: (d / ENTRY_FILE).write_text('{"op": "aten::abs"}'), "incomplete entry"),
    "missing-json": (lambda d: (d / ENTRY_FILE).unlink(), "entry.json is missing"),
    "altered-artifact": (lambda d: (d / LIBRARY_FILE).write_bytes(b"\x7fELF anotheR kernel"), "sha256"),
    "truncated-artifact": (lambda d: (d / LIBRARY_FILE).write_bytes(b"\x7fELF"), "sha256"),
    "missing-artifact": (lambda d: (d / LIBRARY_FILE).unlink(), "incomplete entry: FileNotFoundError"),
    "edited-json": (lambda d: edit_entry_json(d, compile_seconds=0.5), "entry.json does not match its recorded digest"),
    "json-without-digest": (lambda d: edit_entry_json(d, metadata_sha256=None), "does not match its recorded digest"),
    # Edited with the digest recorded again: what the C++ side reads is checked against the op's schema.
    "output-counts-of-two-returns": (lambda d: edit_entry_json(d, redigest=True, output_counts=[-1, -1]),
                                     "does not describe the 1 returns of aten::abs"),
    "output-counts-of-a-list": (lambda d: edit_entry_json(d, redigest=True, output_counts=[3]), "does not match the return"),
    "library-outside-the-entry": (lambda d: edit_entry_json(d, redigest=True, library="../../kernel.so"),
                                  "names the library '../../kernel.so'"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_entry_is_set_aside_alone(cache, tmp_path, damage, caplog):
    publish_kernel(cache, tmp_path, "good")
    publish_kernel(cache, tmp_path, "bad", content=b"\x7fELF another kernel")
    directory = cache.entry_dir("aten::abs", "bad")
    inflict, reason = DAMAGES[damage]
    inflict(directory)
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        assert cache.lookup("aten::abs", "bad") is None
    assert [r.message for r in caplog.records if "set aside" in r.message and reason in r.message], caplog.text
    assert not directory.exists()
    assert len(list((tmp_path / "quarantine").iterdir())) == 1
    assert cache.lookup("aten::abs", "good") is not None
    # The signature can be published again.
    assert publish_kernel(cache, tmp_path, "bad").library.read_bytes() == b"\x7fELF kernel"


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


@pytest.mark.parametrize("recorded", ["torch-version", "isa"])
def test_an_entry_of_another_torch_or_isa_is_never_found(tmp_path, monkeypatch, recorded):
    monkeypatch.setattr(toolchain, "cpu_isa", lambda: "avx512")
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    publish_kernel(KernelCache(tmp_path, environment_name(CPU)), tmp_path)
    assert KernelCache(tmp_path, environment_name(CPU)).lookup("aten::abs", "sig") is not None
    if recorded == "isa":
        monkeypatch.setattr(toolchain, "cpu_isa", lambda: "avx2")
    else:
        monkeypatch.setattr(torch, "__version__", "2.98.0")
    assert KernelCache(tmp_path, environment_name(CPU)).lookup("aten::abs", "sig") is None


def test_environment_name_names_the_compiler_and_the_inductor_options(tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain, "cpu_isa", lambda: "avx2")
    base = toolchain.environment_name(CPU, {"cpp.min_chunk_size": 32768})
    assert toolchain.environment_name(CPU, {"cpp.min_chunk_size": 1}) != base
    monkeypatch.setattr(toolchain, "compiler_identity", lambda compiler=None: "g++: g++ 99.0")
    assert toolchain.environment_name(CPU, {"cpp.min_chunk_size": 32768}) != base


def test_environment_names_are_those_of_cache_layout_v2(monkeypatch):
    """Directory names of existing caches: the same inputs must keep naming
    the same environment (these were computed before the names' code moved)."""
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(torch.version, "git_version", "0123abc")
    monkeypatch.setattr(toolchain.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(toolchain, "__version__", "0.9.0")
    monkeypatch.setattr(toolchain, "cpu_isa", lambda: "avx512 avx512_vnni")
    monkeypatch.setattr(toolchain, "_cpu_identity", lambda: "cpu0123456789abc")
    monkeypatch.setattr(toolchain, "compiler_identity", lambda compiler=None: f"{compiler}: g++ (GCC) 13.2.0")
    options = {"cpp.min_chunk_size": 32768, "cpp.cxx": (None, "/usr/bin/g++")}
    assert environment_name(CPU) == "cpu-avx512_avx512_vnni-torch2.13.0+cpu-24a5972abebb"
    assert environment_name(CPU, options) == "cpu-avx512_avx512_vnni-torch2.13.0+cpu-80f91319226b"


def test_what_dead_publications_left_is_removed_under_the_lock(cache, tmp_path):
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
    monkeypatch.setattr(toolchain, "cpu_isa", lambda: "avx2")
    assert toolchain.environment_name(torch.device("cpu")) == toolchain.environment_name(torch.device("cpu", 0))


def test_isa_probe_is_remembered_on_disk(private_root, monkeypatch):
    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    calls = []
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: calls.append(1) or "avx512")
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: ["avx512", "avx2"])
    assert toolchain.cpu_isa() == "avx512"
    toolchain._vec_isas.cache_clear()
    assert (toolchain.cpu_isa(), toolchain.usable_vec_isas()) == ("avx512", ["avx512", "avx2"])
    assert calls == [1]


def test_default_root_is_per_user(monkeypatch):
    monkeypatch.delenv("AOTI_EAGER_CACHE_DIR", raising=False)
    root = layout.default_root()
    assert root.name == "aoti_eager" and str(root).startswith(os.path.expanduser("~"))


@pytest.mark.parametrize("what", ["entry-dir", "artifact", "op-dir", "environment-dir"])
def test_group_writable_entries_are_refused(cache, tmp_path, what):
    publish_kernel(cache, tmp_path)
    directory = cache.entry_dir("aten::abs", "sig")
    target = {
        "entry-dir": directory,
        "artifact": directory / LIBRARY_FILE,
        "op-dir": directory.parent,
        "environment-dir": cache.directory,
    }[what]
    os.chmod(target, stat.S_IMODE(target.stat().st_mode) | stat.S_IWGRP)
    with pytest.raises(UntrustedEntry, match="writable by group or others"):
        cache.lookup("aten::abs", "sig")
    assert directory.exists()  # refused, not deleted
    if what in ("op-dir", "environment-dir"):
        # Not even a miss: nothing is compiled into a directory others could write.
        with pytest.raises(UntrustedEntry):
            cache.lookup("aten::abs", "not-compiled-yet")


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


def test_a_shared_cache_trusts_the_group_it_names(cache, tmp_path, monkeypatch):
    import grp

    publish_kernel(cache, tmp_path)
    directory = cache.entry_dir("aten::abs", "sig")
    os.chmod(directory, 0o770)
    with pytest.raises(UntrustedEntry):
        cache.lookup("aten::abs", "sig")
    monkeypatch.setenv("AOTI_EAGER_CACHE_GROUP", grp.getgrgid(directory.stat().st_gid).gr_name)
    assert cache.lookup("aten::abs", "sig") is not None
    os.chmod(directory, 0o772)
    with pytest.raises(UntrustedEntry, match="writable by others"):
        cache.lookup("aten::abs", "sig")


def test_a_shared_cache_is_created_for_the_group(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_CACHE_GROUP", str(os.getgid()))
    monkeypatch.setattr(toolchain, "cpu_isa", lambda: "avx2")
    cache = KernelCache(tmp_path / "team", environment_name(CPU))
    published = publish_kernel(cache, tmp_path)
    for path in (published.library.parent, published.library.parent.parent, tmp_path / "team"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o2770 and path.stat().st_gid == os.getgid(), path
    assert stat.S_IMODE(published.library.stat().st_mode) == 0o640
    assert cache.lookup("aten::abs", "sig") is not None


def test_lookup_records_the_last_use(cache, tmp_path):
    publish_kernel(cache, tmp_path)
    directory = cache.entry_dir("aten::abs", "sig")
    os.utime(directory, (1000, 1000))
    cache.lookup("aten::abs", "sig")
    assert directory.stat().st_mtime > time.time() - 60


def publish_aged(cache, tmp_path, ages: dict[str, float]) -> None:
    """Publishes an entry per key, last used ``age`` seconds ago."""
    for key, age in ages.items():
        publish_kernel(cache, tmp_path, key, content=b"k" * 1000)
        os.utime(cache.entry_dir("aten::abs", key), (time.time() - age,) * 2)


def remaining(cache) -> set[str]:
    return {listing.directory.name for listing in inventory.entries(cache.root)}


def test_eviction_removes_the_least_recently_used_first(cache, tmp_path):
    publish_aged(cache, tmp_path, {"old": 300, "middle": 200, "new": 100})
    # Entries differ by a few bytes (their metadata holds times): room for two of the largest.
    size = max(listing.bytes for listing in inventory.entries(cache.root))
    eviction = inventory.evict(cache.root, max_bytes=2 * size)
    assert [listing.directory.name for listing in eviction.removed] == ["old"]
    assert remaining(cache) == {"middle", "new"}
    assert not [p for p in cache.entry_dir("aten::abs", "x").parent.iterdir() if p.name.startswith(".tmp-")]


def test_eviction_by_age(cache, tmp_path):
    publish_aged(cache, tmp_path, {"old": 3 * 86400, "new": 60})
    inventory.evict(cache.root, older_than=86400)
    assert remaining(cache) == {"new"}


def test_eviction_never_removes_an_entry_being_loaded(cache, tmp_path):
    publish_aged(cache, tmp_path, {"loading": 300, "idle": 200})
    with cache.in_use("aten::abs", "loading"):
        eviction = inventory.evict(cache.root, max_bytes=0)
        assert cache.lookup("aten::abs", "loading").library.read_bytes() == b"k" * 1000
    assert [listing.directory.name for listing in eviction.in_use] == ["loading"]
    assert remaining(cache) == {"loading"}
    inventory.evict(cache.root, max_bytes=0)
    assert remaining(cache) == set()
