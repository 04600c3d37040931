"""What someone planted in a cache, a bundle or the fleet never hangs,
crashes or floods a call or a command: deeply nested JSON, pipes and
oversized files in the place of an entry's files are damaged entries, set
aside and reported like any other."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from aoti_eager.cache import KernelCache, files, inventory, signing
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE
from aoti_eager.cli import main
from aoti_eager.kernels import compile as compile_module
from aoti_eager.kernels import toolchain
from aoti_eager.kernels.toolchain import environment_name
from helpers import ENVIRONMENT, machine, publish_kernel, refusals, rewrite

NESTED = "[" * 200000


@pytest.fixture
def cache(tmp_path, swap_toolchain):
    """An empty cache of this machine's environment, as the command line names it (no probes)."""
    swap_toolchain(cpu_isa=lambda: "avx2", compiler=lambda: "g++")
    return KernelCache(tmp_path / "cache", environment_name(torch.device("cpu"), compile_module.compile_options("cpu")))


def cli(capsys, root, *argv) -> tuple[int, str, str]:
    code = main(["--cache-dir", str(root), *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_nested_deeper_than_the_package_writes_is_unreadable():
    with pytest.raises(ValueError, match="nested deeper"):
        files.load_json(NESTED)
    with pytest.raises(ValueError, match="nested deeper"):
        files.load_json("[" * 100 + "]" * 100)  # parses, and is still refused
    assert files.load_json('{"a": [[1], {"b": 2}]}') == {"a": [[1], {"b": 2}]}


def test_a_nested_signature_or_manifest_is_refused_as_unreadable(key):
    with pytest.raises(signing.SignatureError, match="unreadable"):
        signing.trusted_signer(b"{}", NESTED.encode(), [key.with_name("key.pub")])
    manifest = NESTED.encode()
    with pytest.raises(signing.SignatureError, match="unreadable"):
        signing.check_manifest(manifest, signing.sign(manifest, key), {}, [key.with_name("key.pub")])


def test_a_nested_entry_json_is_set_aside_and_verify_reports_it_and_goes_on(cache, tmp_path, capsys):
    publish_kernel(cache, tmp_path, key="intact")
    publish_kernel(cache, tmp_path, key="nested")
    (cache.entry_dir("aten::abs", "nested") / ENTRY_FILE).write_text(NESTED)
    code, out, err = cli(capsys, cache.root, "cache", "verify")
    assert code == 1 and "Traceback" not in err and "nested deeper" in out, out + err
    assert cache.lookup("aten::abs", "nested") is None  # set aside
    assert len(inventory.quarantined(cache.root)) == 1
    assert cache.lookup("aten::abs", "intact") is not None
    assert cli(capsys, cache.root, "cache", "verify")[0] == 0


def test_a_bundle_with_a_nested_signature_is_refused_and_one_with_a_nested_entry_is_imported_without_it(
        cache, tmp_path, key, capsys):
    publish_kernel(cache, tmp_path, key="0123abcd")
    publish_kernel(cache, tmp_path, key="4567cdef")
    bundle = tmp_path / "kernels.tar.gz"
    assert cli(capsys, cache.root, "cache", "export", bundle, "--sign-key", key)[0] == 0

    nested_signature = rewrite(bundle, lambda info, data: (info, NESTED.encode() if info.name == "manifest.sig" else data))
    code, out, err = cli(capsys, tmp_path / "a", "cache", "import", nested_signature, "--trust-key", f"{key}.pub")
    assert code == 1 and "unreadable" in err and "Traceback" not in err, out + err

    def nest_one_entry(info, data):
        return info, NESTED.encode() if info.name.endswith(f"4567cdef/{ENTRY_FILE}") else data

    nested_entry = rewrite(bundle, nest_one_entry, "entry.tar")
    code, out, err = cli(capsys, tmp_path / "b", "cache", "import", nested_entry, "--allow-unsigned")
    assert code == 0 and "Traceback" not in err, out + err
    imported = KernelCache(tmp_path / "b", cache.directory.name)
    assert [key for _, key in imported.entries()] == ["0123abcd"]


def test_a_fleet_entry_with_a_nested_signature_is_refused_with_one_warning(server, keys, tmp_path, caplog):
    from aoti_eager.cache import remote

    publish_kernel(machine(tmp_path / "a", server.url), tmp_path, key="k")
    server.client.hset(remote.entry_key(ENVIRONMENT, "aten::abs", "k"), remote.SIGNATURE_FIELD, NESTED)
    second = machine(tmp_path / "b", server.url)
    assert second.lookup("aten::abs", "k") is None
    assert second.lookup("aten::abs", "k") is None
    said = refusals(caplog)
    assert len(said) == 1 and "unreadable" in said[0], said


def returns_within(seconds: float, call, unblock):
    """``call()``'s result; fails if it has not returned within ``seconds``
    (then ``unblock()`` frees it, so that no thread stays stuck)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        unblock()
        thread.join()
        pytest.fail(f"{call} was still blocked after {seconds} s")
    return result[0]


def _open_for_writing(path):
    def unblock():
        with open(path, "wb"):
            pass
    return unblock


@pytest.mark.parametrize("planted", [ENTRY_FILE, LIBRARY_FILE])
def test_a_pipe_in_place_of_an_entry_file_never_hangs_a_call_or_a_command(cache, tmp_path, capsys, planted):
    publish_kernel(cache, tmp_path, key="piped")
    path = cache.entry_dir("aten::abs", "piped") / planted
    path.unlink()
    os.mkfifo(path, 0o600)
    unblock = _open_for_writing(path)
    code, out, _ = returns_within(20, lambda: cli(capsys, cache.root, "cache", "list"), unblock)
    assert code == 0
    code, out, _ = returns_within(20, lambda: cli(capsys, cache.root, "cache", "verify"), unblock)
    assert code == 1 and "not a regular file" in out, out
    assert returns_within(20, lambda: cache.lookup("aten::abs", "piped"), unblock) is None
    assert len(inventory.quarantined(cache.root)) == 1


def test_an_oversized_entry_json_is_not_read_whole(cache, tmp_path, caplog):
    publish_kernel(cache, tmp_path, key="huge")
    path = cache.entry_dir("aten::abs", "huge") / ENTRY_FILE
    with open(path, "r+b") as f:
        f.truncate(files.MAX_JSON_BYTES + (4 << 20))  # sparse: no disk taken
    assert cache.lookup("aten::abs", "huge") is None
    assert any(f"more than {files.MAX_JSON_BYTES} bytes" in r.getMessage() for r in caplog.records), caplog.text

