"""The local store (aoti_eager.cache.store).

The tests that take the ``store`` fixture hold the EntryStore contract
(aoti_eager.cache.entry_store) and use only the interface, so that a further
store (a remote tier) can be run through them by adding it to that fixture.
Those that take ``cache`` are the local store's own: entry directories and
their files, damage set aside, who may have written an entry, and the op lock.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading

import filelock
import pytest

from aoti_eager.cache import DamagedEntry, Entry, KernelCache, UntrustedEntry, inventory, layout
from aoti_eager.cache import store as store_module
from aoti_eager.cache.entry_store import EntryStore
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE, TEMPORARY_PREFIX, received_entry
from helpers import SIGNATURE, edit_entry_json, publish_kernel


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


class TierOfACache:
    """A tier behind the local store (see RemoteTier) that serves another
    local store's entries as the fleet cache serves its own: written into
    the directory it is given, then received."""

    def __init__(self, cache: KernelCache):
        self.cache, self.fetched, self.offered = cache, [], []

    def fetch(self, op, signature_key, into):
        self.fetched.append((op, signature_key))
        entry = self.cache.lookup(op, signature_key)
        if entry is None:
            return None
        files = {name: into / name for name in (ENTRY_FILE, LIBRARY_FILE)}
        for name, path in files.items():
            shutil.copyfile(self.cache.entry_dir(op, signature_key) / name, path)
        return received_entry(op, files, entry.sha256)

    def offer(self, op, signature_key, directory):
        self.offered.append((op, signature_key, sorted(p.name for p in directory.iterdir())))
        return True

    def lock_signature(self, op, signature_key, timeout=-1):
        return contextlib.nullcontext(True)


def test_a_local_miss_materializes_the_entry_of_the_store_behind(store, tmp_path):
    fleet = KernelCache(tmp_path / "fleet", "cpu-test-environment")
    publish_kernel(fleet, tmp_path, content=b"from the fleet")
    store.behind = TierOfACache(fleet)
    found = store.lookup("aten::abs", "sig")
    assert found.library.is_relative_to(store.directory) and found.library.read_bytes() == b"from the fleet"
    assert store.lookup("aten::abs", "sig") is not None and store.behind.fetched == [("aten::abs", "sig")]
    assert store.lookup("aten::abs", "elsewhere") is None
    assert not list(store.directory.rglob(f"{TEMPORARY_PREFIX}*"))
    # What came from behind is not offered back; a local publication is.
    assert store.behind.offered == []
    publish_kernel(store, tmp_path, key="compiled here")
    assert store.behind.offered == [("aten::abs", "compiled here", [ENTRY_FILE, LIBRARY_FILE])]


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


def test_what_dead_publications_left_is_removed_under_the_lock(cache, tmp_path):
    publish_kernel(cache, tmp_path)
    op_dir = cache.entry_dir("aten::abs", "sig").parent
    abandoned = op_dir / ".tmp-deadbeef"
    abandoned.mkdir()
    (abandoned / LIBRARY_FILE).write_bytes(b"half")
    with cache.lock_signature("aten::abs", "live"):  # cleans up first
        assert not abandoned.exists()
        live = op_dir / ".tmp-live"  # what the compile assembles
        live.mkdir()
        cache.remove_abandoned("aten::abs")  # as another signature's compile starting
        assert live.exists()
    cache.remove_abandoned("aten::abs")
    assert not live.exists()
    assert cache.lookup("aten::abs", "sig") is not None


def test_signatures_of_one_op_compile_side_by_side_and_one_signature_once(cache):
    with cache.lock_signature("aten::abs", "one"):
        with cache.lock_signature("aten::abs", "two", timeout=0.1):
            pass
        with pytest.raises(filelock.Timeout):
            cache.lock_signature("aten::abs", "one", timeout=0.1).__enter__()
        # Cleaning up the op waits for its compiles.
        with pytest.raises(filelock.Timeout):
            cache.lock("aten::abs", timeout=0.1).acquire()


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



def _signature_locks(cache) -> list[str]:
    return sorted(p.name for p in cache.directory.rglob(".lock-*"))


def test_signature_lock_files_go_when_their_compiles_end(cache, tmp_path):
    for n in range(50):
        with cache.lock_signature("aten::abs", f"junk-{n}"):
            assert _signature_locks(cache) == [f".lock-junk-{n}"]
    assert _signature_locks(cache) == []
    # One that a killed process left goes with the next compile of the op.
    (cache.directory / "aten.abs" / ".lock-left-by-a-killed-process").touch()
    with cache.lock_signature("aten::abs", "next"):
        pass
    assert _signature_locks(cache) == []


def test_a_removed_lock_file_still_lets_one_holder_at_a_time(cache):
    held = []

    def waiter():
        # Opens the file the first holder removes on release, then locks the new one.
        with cache.lock_signature("aten::abs", "sig", timeout=30):
            held.append("waiter")
            with pytest.raises(filelock.Timeout):
                with cache.lock_signature("aten::abs", "sig", timeout=0.2):
                    pass

    with cache.lock_signature("aten::abs", "sig"):
        thread = threading.Thread(target=waiter)
        thread.start()
        thread.join(0.3)
        assert held == []
    thread.join()
    assert held == ["waiter"] and _signature_locks(cache) == []


@pytest.mark.parametrize("refused", ["group-writable root", "parent writable by all"])
def test_a_miss_makes_nothing_in_a_root_it_refuses(tmp_path, refused):
    parent = tmp_path / "parent"
    root = parent / "cache"
    root.mkdir(parents=True)
    os.chmod(*((root, 0o775) if refused == "group-writable root" else (parent, 0o777)))
    cache = KernelCache(root, "cpu-environment")
    with pytest.raises(UntrustedEntry, match="writable by"):
        cache.lookup("aten::abs", "sig")
    with pytest.raises(UntrustedEntry, match="writable by"):
        with cache.lock_signature("aten::abs", "sig"):
            pass
    assert list(root.iterdir()) == []
    # The sticky bit (as on /tmp) keeps others from moving what they do not own.
    os.chmod(*((root, 0o700) if refused == "group-writable root" else (parent, 0o1777)))
    assert cache.lookup("aten::abs", "sig") is None


def test_a_library_is_loaded_from_a_private_copy_that_goes_after_the_load(cache, tmp_path, private_root, monkeypatch):
    publish_kernel(cache, tmp_path, content=b"\x7fELF verified", sidecar="{}")  # kernel.json: the runner looks beside it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = private_root / "load" / f"{layout.process_prefix('load')}{dead.stdout.strip()}-0123"
    left.mkdir(parents=True)  # as a killed process leaves it
    monkeypatch.setattr(store_module, "_load_directories", {})
    with cache.hold("aten::abs", "sig") as entry:
        mine = entry.library.parent
        assert mine.parent == private_root / "load" and stat.S_IMODE(mine.stat().st_mode) == 0o700
        assert entry.library.read_bytes() == b"\x7fELF verified"
        assert entry.library.with_suffix(".json").read_text() == "{}"
    assert list((private_root / "load").iterdir()) == [mine] and list(mine.iterdir()) == []


@pytest.mark.skipif(os.getuid() != 0, reason="an entry written by another user is made with chown, which needs root")
def test_verify_reports_another_members_unsigned_entry_and_leaves_it_to_those_who_trust_it(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_CACHE_GROUP", str(os.getgid()))
    publish_kernel(cache, tmp_path)
    directory = cache.entry_dir("aten::abs", "sig")
    for path in [directory, *directory.iterdir()]:
        os.chown(path, 65534, -1)
    with pytest.raises(UntrustedEntry, match="written by uid 65534, another user, and it is not signed"):
        cache.lookup("aten::abs", "sig")
    problems = inventory.verify(cache.root, quarantine=True)
    assert [p.path for p in problems] == [directory] and "AOTI_EAGER_TRUSTED_KEYS" in problems[0].problem
    assert directory.exists() and inventory.quarantined(cache.root) == []


def test_a_copy_that_does_not_fit_leaves_the_entry_in_place(cache, tmp_path, monkeypatch):
    publish_kernel(cache, tmp_path)
    copy_hashed = store_module.cache_files.copy_hashed

    def private_disk_full(source, target=None):
        if target is not None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return copy_hashed(source, target)

    monkeypatch.setattr(store_module.cache_files, "copy_hashed", private_disk_full)
    with pytest.raises(OSError) as raised:
        with cache.hold("aten::abs", "sig"):
            pass
    assert raised.value.errno == errno.ENOSPC and not isinstance(raised.value, DamagedEntry)
    assert cache.lookup("aten::abs", "sig") is not None and inventory.quarantined(cache.root) == []


def _team_cache(monkeypatch, shared: bool) -> None:
    if shared:
        monkeypatch.setenv("AOTI_EAGER_CACHE_GROUP", str(os.getgid()))
    else:
        monkeypatch.delenv("AOTI_EAGER_CACHE_GROUP", raising=False)


@pytest.mark.parametrize("shared", [False, True], ids=["private", "team"])
@pytest.mark.parametrize("moved_to", ["another key", "another op"])
def test_an_entry_moved_to_another_signatures_directory_is_not_loaded_there(cache, tmp_path, monkeypatch, caplog,
                                                                             shared, moved_to):
    # A team-cache member may rename a directory it did not write; the entry.json it carries is the publisher's.
    _team_cache(monkeypatch, shared)
    publish_kernel(cache, tmp_path, key="other", content=b"\x7fELF a kernel of another signature")
    op = "aten::abs" if moved_to == "another key" else "aten::neg"
    target = cache.entry_dir(op, "sig")
    target.parent.mkdir(exist_ok=True)
    os.rename(cache.entry_dir("aten::abs", "other"), target)
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        assert cache.lookup(op, "sig") is None
    assert "not for where it is" in caplog.text and not target.exists()
    assert [path.name.rsplit("-", 1)[0] for path in inventory.quarantined(cache.root)] == ["sig"]


def _as_an_older_version_wrote_it(directory) -> None:
    data = json.loads((directory / ENTRY_FILE).read_text())
    del data["signature_key"], data["sidecar_sha256"]
    data["metadata_sha256"] = store_module.metadata_digest(data)
    (directory / ENTRY_FILE).write_text(json.dumps(data))


@pytest.mark.parametrize("shared", [False, True], ids=["private", "team"])
def test_an_entry_that_does_not_record_its_key_is_loaded_only_from_a_private_cache(cache, tmp_path, monkeypatch, shared):
    _team_cache(monkeypatch, shared)
    publish_kernel(cache, tmp_path, content=b"\x7fELF older")
    _as_an_older_version_wrote_it(cache.entry_dir("aten::abs", "sig"))
    entry = cache.lookup("aten::abs", "sig")
    if shared:
        assert entry is None and len(inventory.quarantined(cache.root)) == 1
    else:
        assert entry is not None and entry.library.read_bytes() == b"\x7fELF older"


@pytest.mark.parametrize("change", ["edited", "added", "removed"])
def test_a_kernel_json_other_than_the_one_published_is_damage(cache, tmp_path, caplog, change):
    publish_kernel(cache, tmp_path, sidecar=None if change == "added" else '{"ops": []}')
    sidecar = cache.entry_dir("aten::abs", "sig") / "kernel.json"
    if change == "removed":
        sidecar.unlink()
    else:
        sidecar.write_text('{"ops": ["aten::something_else"]}')
    with caplog.at_level(logging.WARNING, logger="aoti_eager"), cache.hold("aten::abs", "sig") as entry:
        assert entry is None
    assert "kernel.json) do not match their recorded sha256" in caplog.text
    assert len(inventory.quarantined(cache.root)) == 1
