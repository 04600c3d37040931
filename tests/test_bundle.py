"""Bundles: signed export and import, and reading a hostile bundle safely.

Every kernel here is a stand-in (bytes, never loaded): nothing compiles.
"""

from __future__ import annotations

import json
import os
import stat
import tarfile
import threading
from pathlib import Path

import pytest
import torch

from aoti_eager.cache import KernelCache, bundle, inventory, signing
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE
from aoti_eager.cli import main
from aoti_eager.kernels import toolchain
from aoti_eager.kernels.compile import compile_options
from aoti_eager.kernels.toolchain import environment_name
from helpers import publish_kernel, rewrite, with_crafted_library


@pytest.fixture(autouse=True)
def _no_probes(swap_toolchain):
    """Every new cache directory would probe the CPU ISA and check the C++
    compiler (seconds each); both sides of a bundle agree on stand-ins."""
    swap_toolchain(cpu_isa=lambda: "avx2", compiler=lambda: "g++")


@pytest.fixture
def stand_in_cache(tmp_path):
    """A cache of this machine's environment holding one stand-in kernel."""
    root = tmp_path / "source"
    cache = KernelCache(root, environment_name(torch.device("cpu"), compile_options("cpu")))
    publish_kernel(cache, tmp_path, "0123abcd", content=b"kernel bytes")
    return cache


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def export(capsys, cache: KernelCache, path: Path, *options) -> Path:
    code, _, err = cli(capsys, "--cache-dir", cache.root, "cache", "export", path, *options)
    assert code == 0, err
    return path


def import_into(capsys, target: Path, path: Path, *options) -> tuple[int, str, str]:
    return cli(capsys, "--cache-dir", target, "cache", "import", path, *options)


def assert_refused(code: int, out: str, err: str, target: Path, *why: str) -> None:
    """Exit 1, one line on stderr saying why, and nothing in the cache."""
    assert code == 1, out + err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for words in why:
        assert words in err, err
    assert inventory.entries(target) == []


def members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {info.name: tar.extractfile(info).read() for info in tar.getmembers()}


def test_keygen_writes_a_private_key_only_this_user_reads_and_never_replaces_one(tmp_path, capsys):
    code, out, _ = cli(capsys, "cache", "keygen", tmp_path / "team-key", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["public_key"] == str(tmp_path / "team-key.pub") and report["fingerprint"].startswith("ed25519:")
    assert stat.S_IMODE((tmp_path / "team-key").stat().st_mode) == 0o600
    before = (tmp_path / "team-key").read_bytes()
    code, _, err = cli(capsys, "cache", "keygen", tmp_path / "team-key")
    assert code == 1 and "not replacing a key" in err and len(err.splitlines()) == 1
    assert (tmp_path / "team-key").read_bytes() == before


def test_a_bundle_signed_by_a_trusted_key_imports(stand_in_cache, key, tmp_path, capsys):
    path = export(capsys, stand_in_cache, tmp_path / "kernels.tar.gz", "--sign-key", key)
    target = tmp_path / "target"
    code, out, err = import_into(capsys, target, path, "--trust-key", key.with_suffix(".pub"), "--json")
    assert code == 0, err
    report = json.loads(out)
    assert len(report["imported"]) == 1 and report["signed_by"].startswith("ed25519:")
    cache = KernelCache(target, environment_name(torch.device("cpu"), compile_options("cpu")))
    assert cache.lookup("aten::abs", "0123abcd").library.read_bytes() == b"kernel bytes"


def test_keys_come_from_the_environment_by_default(stand_in_cache, key, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_SIGNING_KEY", str(key))
    path = export(capsys, stand_in_cache, tmp_path / "kernels.tar.gz")
    signing.generate_key_pair(tmp_path / "other")
    monkeypatch.setenv("AOTI_EAGER_TRUSTED_KEYS", f"{tmp_path / 'other.pub'}:{key}.pub")
    code, out, err = import_into(capsys, tmp_path / "target", path)
    assert code == 0 and "imported 1 entries" in out, err


def test_an_unsigned_bundle_is_refused_unless_allowed_with_a_warning(stand_in_cache, key, tmp_path, capsys):
    code, _, err = cli(capsys, "--cache-dir", stand_in_cache.root, "cache", "export", tmp_path / "kernels.tar.gz")
    assert code == 0 and "not signed" in err
    target = tmp_path / "target"
    refused = import_into(capsys, target, tmp_path / "kernels.tar.gz", "--trust-key", f"{key}.pub")
    assert_refused(*refused, target, "not signed", "nothing imported", "--allow-unsigned")
    code, out, err = import_into(capsys, target, tmp_path / "kernels.tar.gz", "--allow-unsigned")
    assert code == 0 and "imported 1 entries" in out
    assert "native code that will run in this user's processes" in err


def test_a_bundle_signed_by_an_untrusted_key_is_refused(stand_in_cache, key, tmp_path, capsys):
    path = export(capsys, stand_in_cache, tmp_path / "kernels.tar.gz", "--sign-key", key)
    signing.generate_key_pair(tmp_path / "mine")
    target = tmp_path / "target"
    refused = import_into(capsys, target, path, "--trust-key", tmp_path / "mine.pub")
    assert_refused(*refused, target, "not a trusted key")
    assert_refused(*import_into(capsys, target, path), target, "not a trusted key", "trusted: none")
    missing = tmp_path / "missing.pub"
    assert_refused(*import_into(capsys, target, path, "--trust-key", missing), target, f"{missing}")


def test_a_crafted_library_in_a_signed_bundle_is_refused(stand_in_cache, key, tmp_path, capsys):
    path = export(capsys, stand_in_cache, tmp_path / "kernels.tar.gz", "--sign-key", key)
    target = tmp_path / "target"
    crafted = import_into(capsys, target, rewrite(path, with_crafted_library), "--trust-key", f"{key}.pub")
    assert_refused(*crafted, target, "do not match its signed manifest")
    dropped = rewrite(path, lambda info, data: None if info.name.endswith(LIBRARY_FILE) else (info, data), "dropped.tar")
    assert_refused(*import_into(capsys, target, dropped, "--trust-key", f"{key}.pub"), target, "signed manifest")


def test_a_manifest_changed_after_signing_is_refused(stand_in_cache, key, tmp_path, capsys):
    path = export(capsys, stand_in_cache, tmp_path / "kernels.tar.gz", "--sign-key", key)
    def forge(info, data):
        return (info, data.replace(b"aoti_eager bundle 1", b"aoti_eager bundle 1 ")) if info.name == bundle.MANIFEST else (info, data)
    target = tmp_path / "target"
    refused = import_into(capsys, target, rewrite(path, forge), "--trust-key", f"{key}.pub")
    assert_refused(*refused, target, "does not match its contents")


def test_import_skips_entries_of_another_environment(tmp_path, key, monkeypatch, capsys):
    with toolchain.scope(cpu_isa=lambda: "another-isa"):
        foreign = KernelCache(tmp_path / "foreign", environment_name(torch.device("cpu"), compile_options("cpu")))
    publish_kernel(foreign, tmp_path, "0123abcd")
    path = export(capsys, foreign, tmp_path / "foreign.tar.gz", "--sign-key", key)
    code, out, _ = import_into(capsys, tmp_path / "here", path, "--trust-key", f"{key}.pub")
    assert code == 0 and "imported 0 entries, skipped 1" in out
    assert f"skipped {foreign.directory.name}/aten.abs/0123abcd: built for another environment" in out
    assert inventory.entries(tmp_path / "here") == []


def test_import_publishes_verified_entries_once(stand_in_cache, key, tmp_path, capsys):
    path = export(capsys, stand_in_cache, tmp_path / "kernels.tar.gz", "--sign-key", key)
    outs = [import_into(capsys, tmp_path / "target", path, "--trust-key", f"{key}.pub")[1] for _ in range(2)]
    assert "imported 1 entries, skipped 0" in outs[0] and "imported 0 entries, 1 already present, skipped 0" in outs[1]


def test_an_unsigned_import_still_checks_each_kernel_against_its_checksum(stand_in_cache, tmp_path, capsys):
    path = export(capsys, stand_in_cache, tmp_path / "kernels.tar.gz")
    tampered = rewrite(path, lambda info, data: (info, b"evil bytes" if info.name.endswith(LIBRARY_FILE) else data))
    code, out, _ = import_into(capsys, tmp_path / "target", tampered, "--allow-unsigned")
    assert code == 0 and "sha256" in out
    assert inventory.entries(tmp_path / "target") == []


@pytest.mark.parametrize("name", ["../../escaped/kernel.so", "/tmp/escaped/a/b/kernel.so", "env/aten.abs/../kernel.so"])
def test_import_refuses_paths_out_of_the_cache(stand_in_cache, tmp_path, capsys, name):
    path = export(capsys, stand_in_cache, tmp_path / "kernels.tar.gz")
    hostile = rewrite(path, lambda info, data: (tarfile.TarInfo(name), data) if info.name.endswith(LIBRARY_FILE) else (info, data))
    target = tmp_path / "target" / "cache"
    assert_refused(*import_into(capsys, target, hostile, "--allow-unsigned"), target, "nothing imported")
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/escaped").exists()


def _claiming(path: Path, name: str, size: int) -> Path:
    """A bundle of one header that claims ``size`` bytes for ``name``, and none of them."""
    info = tarfile.TarInfo(name)
    info.size = size
    path.write_bytes(info.tobuf(format=tarfile.GNU_FORMAT))
    return path


@pytest.mark.parametrize("member, size", [(LIBRARY_FILE, 50 << 30), (ENTRY_FILE, bundle.MAX_JSON_BYTES + 1),
                                          (LIBRARY_FILE, bundle.MAX_LIBRARY_BYTES + 1)])
def test_import_refuses_a_member_larger_than_its_limit_before_reading_it(stand_in_cache, tmp_path, capsys, member, size):
    name = f"{stand_in_cache.directory.name}/aten.abs/0123abcd/{member}"
    target = tmp_path / "target"
    refused = import_into(capsys, target, _claiming(tmp_path / "huge.tar", name, size), "--allow-unsigned")
    assert_refused(*refused, target, f"claims {size} bytes", "nothing imported")


def _returns_within(seconds: float, call) -> int:
    """``call()``'s result; fails if it has not returned in time (a read that never ends)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"still running after {seconds} s"
    return result[0]


def test_import_refuses_a_path_that_is_not_a_regular_file(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = tmp_path / "target"
    for path in ["/dev/zero", fifo, tmp_path]:
        code = _returns_within(20, lambda: main(["--cache-dir", str(target), "cache", "import", str(path), "--allow-unsigned"]))
        out, err = capsys.readouterr()
        assert_refused(code, out, err, target, str(path))


def test_export_replaces_only_a_regular_file(stand_in_cache, tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outside = tmp_path / "outside.txt"
    outside.write_text("canary")
    link = tmp_path / "link.tar.gz"
    link.symlink_to(outside)
    for path in [fifo, link]:
        code, _, err = cli(capsys, "--cache-dir", stand_in_cache.root, "cache", "export", path)
        assert code == 1 and len(err.splitlines()) == 1 and "not a regular file" in err, err
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and link.is_symlink() and outside.read_text() == "canary"
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    existing = export(capsys, stand_in_cache, tmp_path / "kernels.tar.gz")
    assert export(capsys, stand_in_cache, existing).exists()  # a regular file is replaced


def test_export_never_writes_a_link_member(stand_in_cache, key, tmp_path, capsys):
    library = stand_in_cache.entry_dir("aten::abs", "0123abcd") / LIBRARY_FILE
    outside = tmp_path / "outside.so"
    outside.write_bytes(library.read_bytes())
    library.unlink()
    library.symlink_to(outside)
    code, out, _ = cli(capsys, "--cache-dir", stand_in_cache.root, "cache", "export", tmp_path / "b.tar.gz",
                       "--sign-key", key, "--json")
    assert code == 0 and json.loads(out)["skipped"][0]["reason"].endswith("nothing in the cache is reached through a link")
    with tarfile.open(tmp_path / "b.tar.gz") as tar:
        assert all(info.isfile() for info in tar.getmembers())
    code, _, err = import_into(capsys, tmp_path / "target", tmp_path / "b.tar.gz", "--trust-key", f"{key}.pub")
    assert code == 0, err
