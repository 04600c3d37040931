"""Loading a kernel first in a child process (aoti_eager.kernels.inductor.load_probe):
who is blamed for a crash, and what is remembered of it, where."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

import aoti_eager
from aoti_eager import cli
from aoti_eager.kernels.inductor import load_probe
from aoti_eager.kernels.inductor.load_probe import LibraryDoesNotLoad, UnsafeToLoad
from helpers import assert_same_as_eager

ENVIRONMENT = "cpu-test-environment"


@pytest.fixture(autouse=True)
def _own_verdicts(load_verdicts):
    """No environment judged yet, on disk or in this process."""


@pytest.fixture(scope="module")
def crashing_library(tmp_path_factory):
    """A library whose constructor raises SIGSEGV: it crashes whatever loads it."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    directory = tmp_path_factory.mktemp("crash")
    (directory / "crash.cpp").write_text("#include <csignal>\n__attribute__((constructor)) static void crash() { std::raise(SIGSEGV); }\n")
    subprocess.run(["g++", "-shared", "-fPIC", str(directory / "crash.cpp"), "-o", str(directory / "crash.so")], check=True)
    return directory / "crash.so"


def no_probe(monkeypatch):
    """Fails the test if a child process is started."""
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("probed again"))


def forget_in_process():
    """As a new process: only what is on disk is known."""
    load_probe._verdicts.clear()


def test_a_crash_loading_a_known_good_kernel_keeps_the_environment_eager_until_cache_clear(
        crashing_library, load_verdicts, tmp_path, monkeypatch):
    with pytest.raises(UnsafeToLoad, match="crashed a test process loading a known-good cpu kernel \\(signal 11\\)"):
        load_probe.check_loads(ENVIRONMENT, crashing_library, "cpu", [-1], known_good=True)
    assert json.loads((load_verdicts / f"{ENVIRONMENT}.json").read_text())["loads"] is False
    forget_in_process()
    no_probe(monkeypatch)
    with pytest.raises(UnsafeToLoad):
        load_probe.check_loads(ENVIRONMENT, tmp_path / "any other kernel.so", "cpu", [-1], known_good=True)
    assert list(load_probe.recorded_verdicts()) == [ENVIRONMENT]

    # Whatever cache root is cleared: the verdict is the user's, not a root's.
    assert cli.main(["--cache-dir", str(tmp_path / "any root"), "cache", "clear"]) == 0
    assert load_probe.runtime_crashes(ENVIRONMENT) is None and load_probe.recorded_verdicts() == {}


def test_a_crash_loading_a_new_kernel_blames_that_kernel_alone(crashing_library, load_verdicts):
    with pytest.raises(LibraryDoesNotLoad, match="crashed a test process loading a new cpu kernel"):
        load_probe.check_loads(ENVIRONMENT, crashing_library, "cpu", [-1], known_good=False)
    assert load_probe.runtime_crashes(ENVIRONMENT) is None
    assert list(load_verdicts.iterdir()) == []


def test_a_file_that_does_not_load_is_no_verdict_on_its_environment(load_verdicts, tmp_path):
    not_a_library = tmp_path / "kernel.so"
    not_a_library.write_bytes(b"not a shared library")
    with pytest.raises(LibraryDoesNotLoad, match="could not load it \\(exit code 1\\)"):
        load_probe.check_loads(ENVIRONMENT, not_a_library, "cpu", [-1], known_good=True)
    assert load_probe.runtime_crashes(ENVIRONMENT) is None
    assert list(load_verdicts.iterdir()) == []


# Where a library is cut: in its ELF header, its program headers, half way, its section headers (its last bytes).
CUTS = {"header": lambda size: 40, "program-headers": lambda size: 100, "half": lambda size: size // 2,
        "section-headers": lambda size: size - 1}


@pytest.mark.parametrize("cut", CUTS)
def test_a_library_shorter_than_its_headers_say_is_refused_before_any_process_loads_it(
        crashing_library, load_verdicts, tmp_path, monkeypatch, cut):
    # The loader maps what the headers name whatever the file's size: a page past its end kills whoever
    # touches it (SIGBUS), the probe's child here, which would blame the environment's runtime for it.
    data = crashing_library.read_bytes()
    library = tmp_path / "kernel.so"
    library.write_bytes(data[:CUTS[cut](len(data))])
    no_probe(monkeypatch)
    with pytest.raises(LibraryDoesNotLoad, match="cut short"):
        load_probe.check_loads(ENVIRONMENT, library, "cpu", [-1], known_good=True)
    assert list(load_verdicts.iterdir()) == []
    assert load_probe.truncated(crashing_library) is None


def test_once_a_kernel_has_loaded_the_environment_is_not_probed_again(tmp_path, monkeypatch):
    monkeypatch.setattr(load_probe, "_CHILD", "pass")  # a load that succeeds, without a kernel to load
    load_probe.check_loads(ENVIRONMENT, tmp_path / "kernel.so", "cpu", [-1], known_good=False)
    assert load_probe.recorded_verdicts() == {ENVIRONMENT: None}
    forget_in_process()
    no_probe(monkeypatch)
    load_probe.check_loads(ENVIRONMENT, tmp_path / "another kernel.so", "cpu", [-1], known_good=False)


def test_a_probe_started_ahead_is_the_one_its_library_is_loaded_after(tmp_path, monkeypatch):
    monkeypatch.setattr(load_probe, "_CHILD", "pass")
    load_probe.probe_ahead(ENVIRONMENT, tmp_path / "kernel.so", "cpu", [-1])
    no_probe(monkeypatch)  # while a training kernel's backward compiles, say
    load_probe.check_loads(ENVIRONMENT, tmp_path / "kernel.so", "cpu", [-1], known_good=False)
    assert load_probe.recorded_verdicts() == {ENVIRONMENT: None}


def test_a_probe_ahead_that_fails_blames_no_other_library(crashing_library, tmp_path, monkeypatch):
    load_probe.probe_ahead(ENVIRONMENT, crashing_library, "cpu", [-1])
    monkeypatch.setattr(load_probe, "_CHILD", "pass")  # the library loaded next loads
    load_probe.check_loads(ENVIRONMENT, tmp_path / "kernel.so", "cpu", [-1], known_good=True)
    assert load_probe.runtime_crashes(ENVIRONMENT) is None
    assert load_probe.recorded_verdicts() == {ENVIRONMENT: None}


def test_a_second_cache_root_on_the_same_machine_is_not_probed_again(tmp_path, monkeypatch):
    x = torch.randn(32)
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path / "first"):
        torch.abs(x)  # compiled, then loaded in a child process first
    (environment,) = load_probe.recorded_verdicts()
    # The first root's entries in a new root (as `cache import` or the fleet cache put them), in a new process.
    shutil.copytree(tmp_path / "first", tmp_path / "second")
    forget_in_process()
    no_probe(monkeypatch)
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path / "second"):
        result = torch.abs(x)
        stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(result, x.abs())
    assert (stats["cache_loads"], stats["compiles"], stats["fallbacks"]) == (1, 0, 0), stats
    assert load_probe.recorded_verdicts() == {environment: None}


def test_a_verdict_is_kept_in_its_directory_whatever_the_environment_is_named(load_verdicts):
    for name in ("../../outside", "/absolute", "a b/c", ".."):
        assert load_probe.verdict_file(name).parent == load_verdicts


def test_a_verdict_that_cannot_be_kept_on_disk_is_kept_by_the_process(tmp_path, monkeypatch):
    monkeypatch.setattr(load_probe, "verdict_directory", lambda: tmp_path / "not created")
    monkeypatch.setattr(load_probe, "_CHILD", "pass")
    load_probe.check_loads(ENVIRONMENT, tmp_path / "kernel.so", "cpu", [-1], known_good=False)
    no_probe(monkeypatch)
    load_probe.check_loads(ENVIRONMENT, tmp_path / "kernel.so", "cpu", [-1], known_good=False)


@pytest.mark.parametrize("record", ['{"crashed": true}', '{"loads": false, "reason": null}', "{not json"])
def test_a_verdict_of_another_form_is_judged_again(load_verdicts, record):
    (load_verdicts / f"{ENVIRONMENT}.json").write_text(record)
    assert load_probe.runtime_crashes(ENVIRONMENT) is None
    assert load_probe.recorded_verdicts() == {}


def test_doctor_shows_only_the_running_torch_builds_verdicts(load_verdicts, tmp_path, monkeypatch):
    # The private directory is shared by every torch build a user runs.
    other = {"loads": True, "reason": None, "library": "kernel.so", "torch": "0.0.0+another"}
    (load_verdicts / "cpu-another-build.json").write_text(json.dumps(other))
    monkeypatch.setattr(load_probe, "_CHILD", "pass")
    load_probe.check_loads(ENVIRONMENT, tmp_path / "kernel.so", "cpu", [-1], known_good=False)
    assert load_probe.recorded_verdicts() == {ENVIRONMENT: None}
    assert cli._load_probe_report() == ({ENVIRONMENT: None}, [])
