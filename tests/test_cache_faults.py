"""Faults injected into a copy of a really compiled entry: the runtime never
loads it, says why in a log line, and the call still gives eager's result."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch
import torch.utils._pytree as pytree

import aoti_eager
from aoti_eager import _mechanism, _overrides, cli
from aoti_eager._ops import qualified_name
from aoti_eager.cache import KernelCache, inventory, signing
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE, read_entry, sha256_of
from aoti_eager.kernels import CallSignature, CompileError, pipeline
from aoti_eager.kernels.inductor import load_probe
from aoti_eager.kernels.compile import compile_options
from aoti_eager.kernels.toolchain import environment_name
from helpers import ROOT, ROW_IN_A_CHILD, Block, assert_same_as_eager, compile_block, cpu_cache, edit_entry_json

A = torch.ops.aten
X = torch.linspace(-3, 3, 128)


def compile_entry(cache_dir, op, args):
    """The cache entry of ``op`` called on ``args``, compiled if the cache lacks it."""
    with aoti_eager.enabled([op], devices=["cpu"], cache_dir=cache_dir):
        op(*args)
    signature = CallSignature.of(op, "cpu", list(args))
    return KernelCache(cache_dir, environment_name(signature.device, compile_options("cpu"))).entry_dir(qualified_name(op), signature.key)


@pytest.fixture(scope="module")
def compiled_entry(shared_cache):
    """The entry of ``abs`` on X, compiled once into the session's cache."""
    return compile_entry(shared_cache, A.abs.default, [X])


def copy_entry(compiled, root):
    """A copy of a compiled entry in the cache ``root``."""
    copy = root / compiled.relative_to(compiled.parents[3])
    copy.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    os.chmod(copy.parents[1], 0o700)
    os.chmod(copy.parents[2], 0o700)
    shutil.copytree(compiled, copy)
    return copy


@pytest.fixture
def entry(compiled_entry, tmp_path):
    """A copy of the compiled entry in a cache of its own."""
    return copy_entry(compiled_entry, tmp_path)


def run_abs(cache_dir):
    """abs(X) with the entry's cache; a compile, were one tried, fails (eager)."""
    compiles = []

    def no_compile(signature, *args, **kwargs):
        compiles.append(signature)
        raise CompileError("injected: no compile in this test")

    with pipeline.scope(compile=no_compile), aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=cache_dir):
        results = [torch.abs(X) for _ in range(3)]
        stats = aoti_eager.stats()["aten::abs"]
    _overrides.forget()  # the next call starts as a new process
    for result in results:
        assert_same_as_eager(result, X.abs())
    return stats, compiles


def test_the_intact_copy_is_loaded(entry, tmp_path, monkeypatch):
    stats, compiles = run_abs(tmp_path)
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
        stats, compiles = run_abs(tmp_path)
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
        stats, compiles = run_abs(tmp_path)
    assert any("refused an untrusted cache entry" in r.message for r in caplog.records), caplog.text
    assert (stats["cache_loads"], stats["hits"], stats["fallbacks"]) == (0, 0, 3), stats
    assert not compiles
    assert (entry / LIBRARY_FILE).exists()  # refused, left where it is


def test_last_use_is_recorded_once_per_process_not_per_call(entry, tmp_path, monkeypatch):
    os.utime(entry, (1000, 1000))
    monkeypatch.setattr(KernelCache, "lookup", counting(KernelCache.lookup, lookups := []))
    stats, _ = run_abs(tmp_path)
    assert stats["hits"] == 2 and len(lookups) == 1
    assert entry.stat().st_mtime > 1000


def counting(function, calls):
    def wrapper(*args, **kwargs):
        calls.append(args)
        return function(*args, **kwargs)

    return wrapper


def replace_library(directory, library, redigest=True):
    shutil.copyfile(library, directory / LIBRARY_FILE)
    edit_entry_json(directory, redigest=redigest, sha256=sha256_of(directory / LIBRARY_FILE))


# A child process calls FUNCTION(*ARGS) twice with OP enabled on CACHE_DIR,
# compiling nothing (a set-aside entry runs eagerly), and saves the results
# and stats; a crash shows in its exit code.
CALL_IN_A_CHILD = """
import sys, torch, aoti_eager
op, function, cache_dir, saved = sys.argv[1:]
args = torch.load(saved)
aoti_eager.enable([op], devices=["cpu"], cache_dir=cache_dir, compile="never")
results = [getattr(torch, function)(*args) for _ in range(2)]
(stats,) = aoti_eager.stats().values()
torch.save({"results": results, "stats": stats}, saved)
"""


# Before a child's script: its load probe keeps its verdicts in the directory its last argument names,
# not in the user's (a verdict that a test provokes is believed nowhere else).
VERDICTS_IN_LAST_ARGUMENT = """
import pathlib, sys
from aoti_eager.kernels.inductor import load_probe
load_probe.verdict_directory = lambda directory=pathlib.Path(sys.argv.pop()): directory
"""


def call_in_a_child(op, function, args, cache_dir, tmp_path, verdicts=None):
    """CALL_IN_A_CHILD's stats and what it printed (with ``verdicts``: its load probe's verdicts kept there)."""
    saved = tmp_path / "call.pt"
    torch.save(args, saved)
    script, argv = CALL_IN_A_CHILD, [op, function, str(cache_dir), str(saved)]
    if verdicts is not None:
        script, argv = VERDICTS_IN_LAST_ARGUMENT + script, [*argv, str(verdicts)]
    child = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"exit code {child.returncode}: {child.stderr[-3000:]}"
    outcome = torch.load(saved)
    expected = getattr(torch, function)(*args)
    for result in outcome["results"]:
        assert_same_as_eager(result, expected)
    return outcome["stats"], child.stderr


TWO = [X, torch.linspace(0, 1, 64)]


@pytest.fixture(scope="module")
def compiled_foreach_entry(shared_cache):
    """An entry whose op returns a Tensor[]: output_counts [2]."""
    return compile_entry(shared_cache, A._foreach_abs.default, [TWO])


@pytest.fixture(scope="module")
def compiled_mul_entry(shared_cache):
    """A library of two inputs and one output."""
    return compile_entry(shared_cache, A.mul.Tensor, [X, X])


# Edits of entry.json that the cache sees on reading it, so `cache verify` reports them too.
EDITS = {
    "output_counts-too-long": (dict(output_counts=[-1, -1]), False, "does not match its recorded digest"),
    "output_counts-too-long-redigested": (dict(output_counts=[-1, -1]), True, "does not describe the 1 returns of aten::abs"),
    "output_counts-a-list-redigested": (dict(output_counts=[2]), True, "does not match the return"),
    "library-elsewhere-redigested": (dict(library="../kernel.so"), True, "names the library '../kernel.so'"),
    "compile_seconds": (dict(compile_seconds=0.25), False, "does not match its recorded digest"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_edited_entry_json_is_set_aside_and_reported_by_verify(edit, entry, tmp_path):
    fields, redigest, problem = EDITS[edit]
    edit_entry_json(entry, redigest, **fields)
    (reported,) = inventory.verify(tmp_path)
    assert reported.path == entry and problem in reported.problem, reported
    stats, stderr = call_in_a_child("aten::abs.default", "abs", [X], tmp_path, tmp_path)
    assert "set aside" in stderr and problem in stderr, stderr
    assert (stats["hits"], stats["cache_loads"]) == (0, 0), stats
    assert len(inventory.quarantined(tmp_path)) == 1 and not entry.exists()


def test_output_counts_that_the_library_disagrees_with_never_reach_a_call(compiled_foreach_entry, tmp_path):
    # A Tensor[] of 3 passes the schema; the library returns 2 tensors. The
    # call used to read past them and abort the process.
    entry = copy_entry(compiled_foreach_entry, tmp_path)
    edit_entry_json(entry, redigest=True, output_counts=[3])
    stats, stderr = call_in_a_child("aten::_foreach_abs.default", "_foreach_abs", [TWO], tmp_path, tmp_path)
    assert "set aside" in stderr and "describes 3 outputs, its library returns 2" in stderr, stderr
    assert (stats["hits"], stats["cache_loads"]) == (0, 0), stats
    assert len(inventory.quarantined(tmp_path)) == 1


def test_the_intact_tensor_list_entry_is_loaded(compiled_foreach_entry, tmp_path):
    copy_entry(compiled_foreach_entry, tmp_path)
    stats, _ = call_in_a_child("aten::_foreach_abs.default", "_foreach_abs", [TWO], tmp_path, tmp_path)
    assert (stats["cache_loads"], stats["hits"], stats["fallbacks"]) == (1, 1, 0), stats


def test_a_library_that_takes_other_inputs_than_the_call_never_runs(entry, compiled_mul_entry, tmp_path):
    # A library of mul (two inputs) under abs's entry, its sha256 and digest
    # recorded again: only the library's own answer tells.
    replace_library(entry, compiled_mul_entry / LIBRARY_FILE)
    stats, stderr = call_in_a_child("aten::abs.default", "abs", [X], tmp_path, tmp_path)
    assert "set aside" in stderr and "its library takes 2 inputs" in stderr, stderr
    assert (stats["hits"], stats["cache_loads"]) == (0, 0), stats
    assert len(inventory.quarantined(tmp_path)) == 1


def test_a_library_that_fails_to_load_is_set_aside_not_the_environment(entry, compiled_entry, load_verdicts, tmp_path, monkeypatch):
    # Not a library at all, its sha256 and digest recorded again: the test
    # process fails to load it (an error, no signal), and no environment
    # verdict is taken before a kernel has loaded.
    bogus = tmp_path / "bogus.so"
    bogus.write_bytes(b"not a shared library")
    replace_library(entry, bogus)
    stats, compiles = run_abs(tmp_path)
    assert (stats["cache_loads"], stats["hits"]) == (0, 0) and len(compiles) == 1, stats
    assert len(inventory.quarantined(tmp_path)) == 1
    assert load_probe.recorded_verdicts() == {}

    # Intact again (in place of the eager entry the failed compile left): the next process loads it.
    shutil.rmtree(entry)
    copy_entry(compiled_entry, tmp_path)
    stats, compiles = run_abs(tmp_path)
    assert (stats["cache_loads"], stats["hits"], stats["fallbacks"]) == (1, 2, 0), stats
    assert load_probe.recorded_verdicts() == {entry.parents[1].name: None}


def test_a_crash_loading_a_known_good_kernel_keeps_its_environment_eager_until_cache_clear(entry, load_verdicts, tmp_path, capsys):
    with pytest.MonkeyPatch.context() as crashing:
        crashing.setattr(load_probe, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
        stats, compiles = run_abs(tmp_path)
        assert (stats["cache_loads"], stats["hits"], stats["fallbacks"]) == (0, 0, 3), stats
        assert "crashed a test process loading a known-good cpu kernel (signal 11)" in stats["fallback_reason"]
        assert not compiles  # nothing compiled for an environment whose kernels crash the runtime
        assert entry.exists()  # the entry is not at fault

        assert cli.main(["--cache-dir", str(tmp_path), "doctor"]) == 1
        out = capsys.readouterr().out
        assert f"load probe {entry.parents[1].name}: crashes: AOTInductor's runtime crashed" in out, out

        assert cli.main(["--cache-dir", str(tmp_path), "cache", "clear"]) == 0
        assert load_probe.recorded_verdicts() == {}
    cli.main(["--cache-dir", str(tmp_path), "doctor"])
    assert "load probe none yet" in capsys.readouterr().out


def cut_library(entry, size):
    """Cuts the entry's library to ``size`` bytes, its sha256 and digest recorded again as someone who knew
    the format would: only the library's own headers tell (see load_probe.truncated)."""
    os.truncate(entry / LIBRARY_FILE, size)
    edit_entry_json(entry, redigest=True, sha256=sha256_of(entry / LIBRARY_FILE))


@pytest.mark.parametrize("loaded_before", [True, False], ids=["environment-known", "environment-new"])
def test_a_cut_library_whose_sha256_was_recorded_again_is_set_aside_unloaded(
        loaded_before, entry, compiled_entry, load_verdicts, tmp_path):
    # Loading it killed the process (SIGBUS) where the environment's kernels had loaded before, and else
    # crashed the probe's child, which kept every kernel of the environment eager.
    cut_library(entry, (entry / LIBRARY_FILE).stat().st_size // 2)
    environment = entry.parents[1].name
    if loaded_before:
        load_probe._remember(environment, compiled_entry / LIBRARY_FILE, None)
    stats, stderr = call_in_a_child("aten::abs.default", "abs", [X], tmp_path, tmp_path, verdicts=load_verdicts)
    assert "set aside" in stderr and "cut short" in stderr, stderr
    assert (stats["hits"], stats["cache_loads"]) == (0, 0), stats
    assert len(inventory.quarantined(tmp_path)) == 1
    assert load_probe.recorded_verdicts() == ({environment: None} if loaded_before else {})


@pytest.fixture(scope="module")
def compiled_region_entry(tmp_path_factory):
    """The entry of the region of helpers.Block for a call on a (4, 16) tensor, compiled once."""
    root = tmp_path_factory.mktemp("region-cache")
    compile_block(root, Block)
    [(op, key)] = cpu_cache(root).entries()
    return cpu_cache(root).entry_dir(op, key)


def call_regions_in_a_child(cache_dir, verdicts):
    """ROW_IN_A_CHILD (two fused Blocks called, each result compared with eager's, its type and
    structure too), its load probe's verdicts kept in ``verdicts``: its region's stats and what it printed."""
    argv = [str(cache_dir), str(ROOT), str(ROOT / "tests"), Block.__module__, Block.__name__, str(verdicts)]
    child = subprocess.run([sys.executable, "-c", VERDICTS_IN_LAST_ARGUMENT + ROW_IN_A_CHILD, *argv], capture_output=True,
                           text=True, timeout=600)
    assert child.returncode == 0, f"exit code {child.returncode}: {child.stderr[-3000:]}"
    return json.loads(child.stdout.strip().splitlines()[-1]), child.stderr


def test_a_cut_region_library_is_set_aside_unloaded(compiled_region_entry, load_verdicts, tmp_path):
    entry = copy_entry(compiled_region_entry, tmp_path)
    cut_library(entry, (entry / LIBRARY_FILE).stat().st_size // 2)
    # The environment's kernels loaded before: the child loads it itself, which killed it (SIGBUS).
    load_probe._remember(entry.parents[1].name, compiled_region_entry / LIBRARY_FILE, None)
    row, stderr = call_regions_in_a_child(tmp_path, load_verdicts)
    assert "set aside" in stderr and "cut short" in stderr, stderr
    assert len(inventory.quarantined(tmp_path)) == 1 and row["compiles"] == 1, row


def _result_spec(example):
    """The pytree spec of a result like ``example``, as an entry keeps it."""
    return pytree.treespec_dumps(pytree.tree_structure(example))


# Edits of a region entry of one tensor's result, its digest recorded again, and what the child says of them:
# only its library's answer, or eager's result, tells.
REGION_EDITS = {
    "output_counts-too-long": (lambda kept: dict(output_counts=[-1, -1]), "describes 2 outputs, its library returns 1"),
    "result_structure-a-tuple": (lambda kept: dict(result_structure={**kept, "spec": _result_spec((0,))}),
                                 "is not eager's"),
    "result_structure-of-two-tensors": (lambda kept: dict(result_structure={"spec": _result_spec((0, 0)),
                                                                            "leaves": kept["leaves"] * 2}),
                                        "does not fit a kernel of 1 outputs"),
}


@pytest.mark.parametrize("edit", REGION_EDITS)
def test_a_region_entry_whose_outputs_were_edited_and_redigested_is_set_aside(
        edit, compiled_region_entry, load_verdicts, tmp_path):
    # They made every call raise, or handed the caller a tuple for eager's tensor.
    entry = copy_entry(compiled_region_entry, tmp_path)
    change, problem = REGION_EDITS[edit]
    edit_entry_json(entry, redigest=True, **change(json.loads((entry / ENTRY_FILE).read_text())["result_structure"]))
    row, stderr = call_regions_in_a_child(tmp_path, load_verdicts)
    assert "set aside" in stderr and problem in stderr, stderr
    assert len(inventory.quarantined(tmp_path)) == 1
    # Found loading it: compiled again; found by eager's result: the later call runs eagerly.
    assert (row["compiles"], row["fallbacks"]) == ((1, 0) if edit.startswith("output_counts") else (0, 1)), row


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
def test_a_cache_that_cannot_be_written_serves_its_kernels_and_runs_misses_eagerly(block, entry, tmp_path, swap_compiler, caplog):
    block(tmp_path, entry)
    swap_compiler(compile=lambda *a, **k: pytest.fail("must not compile: the cache cannot be written"))
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


def planted_library(directory, marker):
    """A shared library whose constructor writes ``marker``: code that must never run."""
    source = directory / "planted.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                      f'{{ FILE* f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(directory / "planted.so"), str(source)], check=True)
    return directory / "planted.so"


def test_a_library_swapped_between_its_check_and_its_load_never_runs(entry, tmp_path, tmp_path_factory, monkeypatch):
    elsewhere = tmp_path_factory.mktemp("planted")
    marker = elsewhere / "planted-code-ran"
    planted = planted_library(elsewhere, marker)
    check_loads = _mechanism.check_loads

    def swap_then_check(*args, **kwargs):
        # The moment between the entry's check and its load: the cache's file is replaced.
        if planted.exists():
            os.replace(planted, entry / LIBRARY_FILE)
        return check_loads(*args, **kwargs)

    monkeypatch.setattr(_mechanism, "check_loads", swap_then_check)
    stats, compiles = run_abs(tmp_path)
    assert not planted.exists(), "the seam was not reached"
    assert not marker.exists(), "the swapped-in library ran"
    # What was loaded is what was verified: the kernel serves the calls.
    assert (stats["cache_loads"], stats["hits"], compiles) == (1, 2, []), stats


def _publish_as_another_member(compiled, root, key, monkeypatch):
    """The compiled entry published into the team cache at ``root`` signed
    with ``key`` (None: unsigned), then given to uid 65534 (nobody), as if
    that member had published it."""
    monkeypatch.setenv("AOTI_EAGER_CACHE_GROUP", str(os.getgid()))
    if key is not None:
        monkeypatch.setenv("AOTI_EAGER_SIGNING_KEY", str(key))
    entry = read_entry(compiled, compiled.parents[3])
    cache = KernelCache(root, compiled.parents[1].name)
    files = {name: compiled / name for name in (LIBRARY_FILE, "kernel.json") if (compiled / name).exists()}
    cache.publish(compiled.name, entry, files)
    monkeypatch.delenv("AOTI_EAGER_SIGNING_KEY", raising=False)
    directory = cache.entry_dir(entry.op, compiled.name)
    for path in [directory, *directory.iterdir()]:
        os.chown(path, 65534, -1)


@pytest.mark.skipif(os.getuid() != 0, reason="an entry written by another user is made with chown, which needs root")
@pytest.mark.parametrize("signed_by, trusted, loaded", [
    (None, "key", False), ("key", None, False), ("key", "other", False), ("key", "key", True),
])
def test_a_team_cache_loads_another_members_library_only_when_a_trusted_key_signed_it(
        compiled_entry, tmp_path, tmp_path_factory, monkeypatch, caplog, signed_by, trusted, loaded):
    keys = tmp_path_factory.mktemp("keys")
    for name in ("key", "other"):
        signing.generate_key_pair(keys / name)
    _publish_as_another_member(compiled_entry, tmp_path, signed_by and keys / signed_by, monkeypatch)
    if trusted is not None:
        monkeypatch.setenv("AOTI_EAGER_TRUSTED_KEYS", str(keys / f"{trusted}.pub"))
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        stats, compiles = run_abs(tmp_path)
    assert (stats["cache_loads"], stats["hits"]) == ((1, 2) if loaded else (0, 0)), stats
    assert compiles == []  # refused, not compiled again over another member's entry
    refused = [r.getMessage() for r in caplog.records if "another user" in r.getMessage()]
    assert len(refused) == (0 if loaded else 1), caplog.text
    if not loaded:
        assert "AOTI_EAGER_TRUSTED_KEYS" in refused[0]


def test_a_full_cache_disk_is_named_and_the_signature_compiles_once_space_is_freed(tmp_path, monkeypatch, caplog, swap_compiler):
    disk = {"full": True, "free": 4096}
    sources = []
    copyfile = shutil.copyfile

    def copy_onto_a_full_disk(source, target, **kwargs):
        if disk["full"] and str(target).startswith(str(tmp_path)):
            sources.append(str(source))
            error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            error.filename, error.filename2 = str(source), str(target)  # as sendfile reports it
            raise error
        return copyfile(source, target, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", copy_onto_a_full_disk)
    monkeypatch.setattr(_mechanism, "_free_bytes", lambda root: disk["free"])
    monkeypatch.setattr(_mechanism, "DISK_FULL_RETRY_SECONDS", 0.0)
    compiles = []
    swap_compiler(compile=counting(pipeline.compile_call, compiles))
    other = torch.linspace(-2, 2, 100)
    with caplog.at_level(logging.WARNING, logger="aoti_eager"), \
            aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
        results = [torch.abs(other), torch.abs(other)]  # the disk is full: eager, and not compiled again
        assert len(compiles) == 1 and sources
        disk.update(full=False, free=1 << 30)
        results += [torch.abs(other) for _ in range(3)]
        stats = aoti_eager.stats()["aten::abs"]
    for result in results:
        assert_same_as_eager(result, other.abs())
    assert len(compiles) == 2 and (stats["compiles"], stats["hits"]) == (1, 2), stats
    said = [r.getMessage() for r in caplog.records if "full" in r.getMessage()]
    assert len(said) == 1 and f"the cache at {tmp_path} is full" in said[0], caplog.text
    assert not any(source in said[0] for source in sources), said


def test_a_call_makes_nothing_in_a_cache_root_it_refuses(tmp_path, swap_compiler, caplog):
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o775)
    swap_compiler(compile=lambda *a, **k: pytest.fail("must not compile into a refused root"))
    with caplog.at_level(logging.WARNING, logger="aoti_eager"), \
            aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=root):
        results = [torch.abs(X) for _ in range(3)]
        stats = aoti_eager.stats()["aten::abs"]
    for result in results:
        assert_same_as_eager(result, X.abs())
    assert list(root.iterdir()) == [], "a refused root was written"
    assert stats["misses"] == 1 and "writable by group or others" in stats["fallback_reason"], stats
