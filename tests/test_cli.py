"""The command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from aoti_eager import settings
from aoti_eager.cache import KernelCache, inventory
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE
from aoti_eager.cli import main
from aoti_eager.kernels import toolchain
from aoti_eager.kernels.toolchain import environment_name
from helpers import publish_kernel


def test_cache_path_follows_the_environment(tmp_path):
    env_dir = tmp_path / "cache"
    out = subprocess.run(
        [sys.executable, "-m", "aoti_eager", "cache", "path"],
        capture_output=True, text=True, env={**os.environ, "AOTI_EAGER_CACHE_DIR": str(env_dir)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(env_dir)


def test_unknown_command_exits_2():
    out = subprocess.run([sys.executable, "-m", "aoti_eager", "bogus"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "invalid choice" in out.stderr


@pytest.fixture
def cache(tmp_path, swap_toolchain):
    """A cache with two entries of abs (the older one used a day ago) and one of add."""
    swap_toolchain(cpu_isa=lambda: "avx2")
    cache = KernelCache(tmp_path / "cache", environment_name(torch.device("cpu")))
    publish_kernel(cache, tmp_path, "old", content=b"old kernel")
    os.utime(cache.entry_dir("aten::abs", "old"), (time.time() - 86400,) * 2)
    publish_kernel(cache, tmp_path, "new", content=b"new kernel")
    publish_kernel(cache, tmp_path, "add", content=b"add kernel", op="aten::add.Tensor")
    return cache


def cli(cache, capsys, *argv) -> tuple[int, str]:
    code = main(["--cache-dir", str(cache.root), *argv])
    return code, capsys.readouterr().out


def cli_json(cache, capsys, *argv) -> tuple[int, Any]:
    code, out = cli(cache, capsys, *argv, "--json")
    return code, json.loads(out)


def test_list(cache, capsys):
    code, out = cli(cache, capsys, "cache", "list")
    assert code == 0
    assert "aten::abs: 2 entries" in out and "aten::add.Tensor: 1 entries" in out
    assert out.count("(self=float32[4])") == 3 and "compiled in 1.5 s" in out
    code, rows = cli_json(cache, capsys, "cache", "list", "--op", "aten::abs")
    assert [row["key"] for row in rows] == ["old", "new"]  # least recently used first
    assert {(row["op"], row["device"], row["signature"], row["compile_seconds"]) for row in rows} == {
        ("aten::abs", "cpu", "self=float32[4]", 1.5)
    }
    assert all(row["bytes"] > len(b"old kernel") for row in rows)  # the kernel and entry.json


def test_list_and_stats_show_signatures_kept_eager_as_faster(cache, capsys):
    from aoti_eager.cache import Entry
    from helpers import SIGNATURE

    timing = {"kernel_us": 13.2, "eager_us": 10.0, "ratio": 1.32}
    reason = "eager is faster: kernel 1.32x eager's time (measured at compile)"
    cache.publish("slow", Entry(op="aten::abs", signature=SIGNATURE, reason=reason, compile_seconds=2.0, timing=timing))
    code, rows = cli_json(cache, capsys, "cache", "list", "--op", "aten::abs")
    (row,) = [row for row in rows if row["key"] == "slow"]
    assert row["kept_eager_as_faster"] and row["timing"] == timing and row["eager_reason"] == reason
    assert not any(row["kept_eager_as_faster"] for row in rows if row["key"] != "slow")
    code, out = cli(cache, capsys, "cache", "list")
    assert f"eager: {reason} (kernel 13.2 us, eager 10.0 us)" in out
    code, stats = cli_json(cache, capsys, "cache", "stats")
    assert stats["kept_eager_as_faster"] == 1 and stats["by_op"]["aten::abs"]["kept_eager_as_faster"] == 1
    code, out = cli(cache, capsys, "cache", "stats")
    assert "1 kept eager as faster than their kernel" in out


def test_stats(cache, capsys):
    code, stats = cli_json(cache, capsys, "cache", "stats")
    assert code == 0
    sizes = {listing.directory.name: listing.bytes for listing in inventory.entries(cache.root)}
    assert (stats["entries"], stats["bytes"]) == (3, sum(sizes.values()))
    assert stats["by_op"]["aten::abs"] == {"entries": 2, "bytes": sizes["old"] + sizes["new"], "kept_eager_as_faster": 0}
    assert stats["by_device"] == {"cpu": {"entries": 3, "bytes": sum(sizes.values()), "kept_eager_as_faster": 0}}
    code, out = cli(cache, capsys, "cache", "stats")
    assert code == 0 and "3 entries" in out and "aten::add.Tensor: 1 entries" in out


def test_verify_reports_and_quarantines_bad_entries(cache, capsys):
    assert cli(cache, capsys, "cache", "verify")[0] == 0
    (cache.entry_dir("aten::abs", "old") / LIBRARY_FILE).write_bytes(b"OLD kernel")
    code, report = cli_json(cache, capsys, "cache", "verify")
    assert code == 1
    assert report["checked"] == 3 and [bad["op"] for bad in report["bad"]] == ["aten::abs"]
    assert "sha256" in report["bad"][0]["problem"]
    code, out = cli(cache, capsys, "cache", "verify", "--quarantine")
    assert code == 1 and "1 bad (moved to the quarantine)" in out
    assert not cache.entry_dir("aten::abs", "old").exists() and len(inventory.quarantined(cache.root)) == 1
    assert cli(cache, capsys, "cache", "verify")[0] == 0


def test_prune_by_size_and_by_age(cache, capsys):
    one_entry = max(listing.bytes for listing in inventory.entries(cache.root))
    code, report = cli_json(cache, capsys, "cache", "prune", "--max-size", str(2 * one_entry))
    assert code == 0 and report["removed"] == 1
    assert not cache.entry_dir("aten::abs", "old").exists() and cache.entry_dir("aten::abs", "new").exists()
    os.utime(cache.entry_dir("aten::abs", "new"), (time.time() - 7200,) * 2)
    code, out = cli(cache, capsys, "cache", "prune", "--older-than", "1h")
    assert code == 0 and "removed 1 entries" in out
    assert [listing.op for listing in inventory.entries(cache.root)] == ["aten::add.Tensor"]


def test_clear_one_op_then_everything(cache, capsys):
    code, report = cli_json(cache, capsys, "cache", "clear", "--op", "add")
    assert code == 0 and report["removed"] == 1
    assert {listing.op for listing in inventory.entries(cache.root)} == {"aten::abs"}
    (cache.entry_dir("aten::abs", "old") / ENTRY_FILE).write_text("{")
    cache.lookup("aten::abs", "old")  # sets it aside
    code, out = cli(cache, capsys, "cache", "clear")
    assert code == 0 and "removed 1 entries" in out and "removed 1 quarantined" in out
    assert inventory.entries(cache.root) == [] and inventory.quarantined(cache.root) == []


def test_prune_removes_the_directories_of_an_earlier_layout(cache, capsys, tmp_path):
    old_entry = cache.root / "v1" / "cpu-avx512 avx512_vnni-torch2.13.0+cpu-0123" / "aten.abs" / "0123abcd"
    old_entry.mkdir(parents=True)
    (old_entry / "kernel.so").write_bytes(b"kernel of layout v1")
    outside = tmp_path / "outside"
    outside.mkdir()
    (cache.root / "v0").symlink_to(outside)  # a link is never followed, nor removed as a layout
    code, report = cli_json(cache, capsys, "cache", "prune")
    assert code == 0 and report["old_layouts_removed"] == 1
    assert not (cache.root / "v1").exists() and outside.exists()
    assert [listing.op for listing in inventory.entries(cache.root)]  # this layout's entries stay


def test_path_json(cache, capsys):
    assert cli_json(cache, capsys, "cache", "path") == (0, str(cache.root))


def test_doctor(cache, capsys):
    code, report = cli_json(cache, capsys, "doctor")
    assert code == 0, report["problems"]
    assert report["torch"] == torch.__version__ and report["cpu_isa"] == "avx2"
    assert report["extension"]["loads"] and report["cache"]["mode"] == "700"
    assert report["cuda"]["available"] == torch.cuda.is_available()
    assert len(report["cuda"]["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert list(report["settings"]) == [setting.name for setting in settings.ALL]
    assert report["settings"]["AOTI_EAGER_KEEP_FASTER"] == {"value": "0", "set": True}  # by tests/conftest.py
    os.chmod(cache.root, 0o770)
    code, out = cli(cache, capsys, "doctor")
    assert code == 1 and "PROBLEM: cache directory" in out and "writable by group or others" in out


@pytest.mark.parametrize("argv", [["cache"], ["cache", "prune", "--max-size", "lots"], ["cache", "prune", "--older-than", "soon"]])
def test_usage_errors_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert raised.value.code == 2


def _regular_file(tmp_path):
    (tmp_path / "notes.txt").write_text("not an archive\n")
    return tmp_path / "notes.txt"


def _truncated_bundle(tmp_path):
    import gzip
    import io
    import tarfile

    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        info = tarfile.TarInfo("env/aten.abs/key/kernel.so")
        info.size = 100_000
        tar.addfile(info, io.BytesIO(os.urandom(100_000)))
    (tmp_path / "cut.tar.gz").write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
    return tmp_path / "cut.tar.gz"


# (argv, {variable: value}): each must fail with one line, never a traceback.
# "{dir}", "{file}", "{cut}", "{missing}" are a directory, a text file, a truncated
# bundle and a path that does not exist.
FAILURES = [
    (["cache", "import", "{dir}"], {}),
    (["cache", "import", "/dev/null"], {}),
    (["cache", "import", "{file}"], {}),
    (["cache", "import", "{cut}", "--allow-unsigned"], {}),
    (["cache", "import", "{missing}"], {}),
    (["cache", "import", "{file}", "--trust-key", "/dev/null"], {}),
    (["cache", "export", "{dir}"], {}),
    (["cache", "export", "{missing}/kernels.tar.gz"], {}),
    (["cache", "export", "{dir}/kernels.tar.gz", "--sign-key", "{missing}"], {}),
    (["cache", "export", "{dir}/kernels.tar.gz", "--sign-key", "{file}"], {}),
    (["cache", "keygen", "{dir}"], {}),
    (["cache", "keygen", "{missing}/key"], {}),
    (["prewarm", "{dir}"], {}),
    (["prewarm", "{missing}"], {}),
    (["prewarm", "{file}"], {}),
    (["cache", "stats"], {"AOTI_EAGER_CACHE_SIZE": "abc"}),
    (["cache", "prune"], {"AOTI_EAGER_CACHE_SIZE": "abc"}),
    (["cache", "verify"], {"AOTI_EAGER_CACHE_GROUP": "nosuchgroup"}),
    (["doctor"], {"AOTI_EAGER_CACHE_SIZE": "abc"}),
]


@pytest.mark.parametrize("json_output", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("argv, settings", FAILURES, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_every_failure_is_one_line_never_a_traceback(cache, tmp_path, capsys, monkeypatch, argv, settings, json_output, swap_toolchain):
    swap_toolchain(compiler=lambda: "g++")  # doctor: no compiler check
    (tmp_path / "a-dir").mkdir()
    names = {"dir": tmp_path / "a-dir", "file": _regular_file(tmp_path), "cut": _truncated_bundle(tmp_path),
             "missing": tmp_path / "missing"}
    for name, value in settings.items():
        monkeypatch.setenv(name, value.format(**names))
    argv = [arg.format(**names) for arg in argv] + (["--json"] if json_output else [])
    code = main(["--cache-dir", str(cache.root), *argv])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    if json_output:
        assert json.loads(out)["error"] and err == ""
    else:
        assert len(err.splitlines()) == 1 and err.startswith("aoti-eager: "), err
        assert "unexpected" not in err, err  # each of these is an expected failure, said as such
        for name in settings:
            assert name in err, f"the message names the setting: {err}"


def test_debug_shows_the_traceback(cache, monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_CACHE_SIZE", "abc")
    with pytest.raises(ValueError, match="not a size"):
        main(["--debug", "--cache-dir", str(cache.root), "cache", "stats"])


def test_a_bug_is_one_line_that_says_how_to_see_it(cache, capsys, monkeypatch):
    monkeypatch.setattr(inventory, "entries", lambda *args: 1 / 0)
    assert main(["--cache-dir", str(cache.root), "cache", "stats"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "unexpected ZeroDivisionError" in err and "--debug" in err


def _abandoned_temporary(cache):
    tmp = cache.entry_dir("aten::abs", "old").parent / ".tmp-killed"
    tmp.mkdir()
    (tmp / "kernel.cpp").write_bytes(b"x" * 1000)
    return tmp


def test_stats_counts_and_clear_removes_what_killed_processes_left(cache, capsys):
    tmp = _abandoned_temporary(cache)
    code, stats = cli_json(cache, capsys, "cache", "stats")
    assert (stats["abandoned"], stats["abandoned_bytes"]) == (1, 1000)
    code, report = cli_json(cache, capsys, "cache", "clear")
    assert code == 0 and report["abandoned_removed"] == 1 and not tmp.exists()


def test_clear_leaves_the_temporary_directory_of_a_live_compile(cache, capsys):
    tmp = _abandoned_temporary(cache)
    with cache.lock("aten::abs", timeout=0):  # as a compile of abs holds it
        code, stats = cli_json(cache, capsys, "cache", "stats")
        assert stats["abandoned"] == 0
        code, report = cli_json(cache, capsys, "cache", "clear")
        assert code == 0 and report["abandoned_removed"] == 0 and tmp.exists()
    assert cli_json(cache, capsys, "cache", "clear", "--op", "abs")[1]["abandoned_removed"] == 1 and not tmp.exists()
