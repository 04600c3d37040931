"""The EntryStore contract (aoti_eager.cache.entry_store), on the local store.

Only the interface is used here, so a further store (a remote tier) can be run
through the same tests by adding it to the ``store`` fixture.
"""

from __future__ import annotations

import threading

import pytest

from aoti_eager.cache import DamagedEntry, Entry, KernelCache, inventory
from aoti_eager.cache.entry_store import EntryStore
from helpers import SIGNATURE, publish_kernel



@pytest.fixture
def store(tmp_path) -> EntryStore:
    return KernelCache(tmp_path / "store", "cpu-test-environment")


def test_a_miss_is_none(store):
    assert store.lookup("aten::abs", "sig") is None
    with store.hold("aten::abs", "sig") as entry:
        assert entry is None


def test_published_entry_is_found_with_its_library(store, tmp_path):
    publish_kernel(store, tmp_path, content=b"kernel bytes")
    found = store.lookup("aten::abs", "sig")
    assert found.op == "aten::abs" and found.output_counts == [-1]
    assert found.library.read_bytes() == b"kernel bytes"
    assert list(store.entries()) == [("aten::abs", "sig")]


def test_an_eager_decision_is_an_entry_without_library(store):
    store.publish("sig", Entry(op="aten::abs", signature=SIGNATURE, reason="eager is faster"))
    found = store.lookup("aten::abs", "sig")
    assert found.library is None and found.reason == "eager is faster"


def test_the_first_publication_of_a_key_wins(store, tmp_path):
    first = publish_kernel(store, tmp_path, content=b"first")
    second = publish_kernel(store, tmp_path, content=b"second")
    assert second.library == first.library and second.sha256 == first.sha256
    assert store.lookup("aten::abs", "sig").library.read_bytes() == b"first"


def test_removed_entry_is_a_miss(store, tmp_path):
    publish_kernel(store, tmp_path)
    assert store.remove("aten::abs", "sig")
    assert store.lookup("aten::abs", "sig") is None and list(store.entries()) == []
    assert store.remove("aten::abs", "sig")  # nothing to remove: gone all the same


def test_a_held_entry_is_not_removed(store, tmp_path):
    publish_kernel(store, tmp_path)
    with store.hold("aten::abs", "sig") as entry:
        assert entry is not None
        assert not store.remove("aten::abs", "sig")
        assert inventory.evict(store.root, max_bytes=0).removed == []
    assert store.remove("aten::abs", "sig")


def test_a_damaged_entry_found_while_held_is_set_aside(store, tmp_path):
    publish_kernel(store, tmp_path)
    with pytest.raises(DamagedEntry):
        with store.hold("aten::abs", "sig"):
            raise DamagedEntry("its kernel does not load")
    assert store.lookup("aten::abs", "sig") is None


def test_trim_removes_least_recently_used_first(store, tmp_path):
    publish_kernel(store, tmp_path, key="old", content=b"o" * 100_000)
    publish_kernel(store, tmp_path, key="new", content=b"n" * 100_000)
    store.lookup("aten::abs", "new")  # its last use
    eviction = inventory.evict(store.root, max_bytes=150_000)
    assert len(eviction.removed) == 1 and eviction.removed[0].bytes >= 100_000
    assert list(store.entries()) == [("aten::abs", "new")]


def test_a_locked_signature_is_compiled_once(store):
    with store.lock_signature("aten::abs", "sig"):
        with pytest.raises(TimeoutError):
            with store.lock_signature("aten::abs", "sig", timeout=0.1):
                pass
    order = []

    def compile_after_the_holder():
        with store.lock_signature("aten::abs", "sig"):
            order.append("second")

    with store.lock_signature("aten::abs", "sig"):
        waiting = threading.Thread(target=compile_after_the_holder)
        waiting.start()
        waiting.join(0.3)
        order.append("first")
    waiting.join()
    assert order == ["first", "second"]


def test_the_lock_cleans_up_after_dead_publishers(store, tmp_path):
    publish_kernel(store, tmp_path)
    abandoned = store.directory / "aten.abs" / ".tmp-deadbeef"
    abandoned.mkdir()
    with store.lock_signature("aten::abs", "other"):
        assert not abandoned.exists()
    assert store.lookup("aten::abs", "sig") is not None


def test_a_local_miss_materializes_the_entry_of_the_store_behind(store, tmp_path, monkeypatch):
    behind = KernelCache(tmp_path / "fleet", "cpu-test-environment")
    publish_kernel(behind, tmp_path, content=b"from the fleet")
    store.behind = behind
    asked = []
    monkeypatch.setattr(behind, "lookup", lambda *key: asked.append(key) or KernelCache.lookup(behind, *key))
    found = store.lookup("aten::abs", "sig")
    assert found.library.is_relative_to(store.directory) and found.library.read_bytes() == b"from the fleet"
    assert store.lookup("aten::abs", "sig") is not None and asked == [("aten::abs", "sig")]
    assert store.lookup("aten::abs", "elsewhere") is None
