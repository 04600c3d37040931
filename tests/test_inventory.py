"""The whole cache at once (aoti_eager.cache.inventory): entries listed with
their last use, and eviction."""

from __future__ import annotations

import os
import time

from aoti_eager.cache import inventory
from helpers import publish_kernel


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



def test_an_op_names_its_overloads_and_no_other_op(cache, tmp_path):
    for op in ("aten::add.Tensor", "aten::add.Scalar", "aten::addmm"):
        publish_kernel(cache, tmp_path, op=op)
    assert {listing.op for listing in inventory.entries(cache.root, "aten::add")} == {"aten::add.Tensor", "aten::add.Scalar"}
    assert [listing.op for listing in inventory.entries(cache.root, "aten::add.Tensor")] == ["aten::add.Tensor"]
    (listing,) = inventory.entries(cache.root, "aten::addmm")
    assert (listing.environment, listing.device) == (cache.directory.name, "cpu")
    inventory.evict(cache.root, max_bytes=0, op="aten::add")
    assert [listing.op for listing in inventory.entries(cache.root)] == ["aten::addmm"]
