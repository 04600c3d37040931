"""Loading a kernel first in a child process (aoti_eager.kernels.load_probe):
who is blamed for a crash, and what is remembered of it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from aoti_eager.kernels import load_probe
from aoti_eager.kernels.load_probe import VERDICT_FILE, LibraryDoesNotLoad, UnsafeToLoad


@pytest.fixture(autouse=True)
def _no_verdicts(monkeypatch):
    """This process has judged no environment yet."""
    monkeypatch.setattr(load_probe, "_verdicts", {})


@pytest.fixture
def environment(tmp_path):
    """An environment directory of the cache at ``tmp_path / "root"``."""
    directory = tmp_path / "root" / "v2" / "cpu-test-environment"
    directory.mkdir(parents=True)
    return directory


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
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("probed again"))


def forget_in_process():
    """As a new process: only what is on disk is known."""
    load_probe._verdicts.clear()


def test_a_crash_loading_a_known_good_kernel_keeps_the_environment_eager(environment, crashing_library, tmp_path, monkeypatch):
    with pytest.raises(UnsafeToLoad, match="crashed a test process loading a known-good cpu kernel \\(signal 11\\)"):
        load_probe.check_loads(environment, crashing_library, "cpu", [-1], known_good=True)
    assert json.loads((environment / VERDICT_FILE).read_text())["loads"] is False
    forget_in_process()
    no_probe(monkeypatch)
    with pytest.raises(UnsafeToLoad):
        load_probe.check_loads(environment, tmp_path / "any other kernel.so", "cpu", [-1], known_good=True)
    assert list(load_probe.recorded_verdicts(tmp_path / "root")) == [environment.name]

    load_probe.forget_verdicts(tmp_path / "root")
    assert load_probe.runtime_crashes(environment) is None and load_probe.recorded_verdicts(tmp_path / "root") == {}


def test_a_crash_loading_a_new_kernel_blames_that_kernel_alone(environment, crashing_library):
    with pytest.raises(LibraryDoesNotLoad, match="crashed a test process loading a new cpu kernel"):
        load_probe.check_loads(environment, crashing_library, "cpu", [-1], known_good=False)
    assert load_probe.runtime_crashes(environment) is None
    assert not (environment / VERDICT_FILE).exists()


def test_a_file_that_does_not_load_is_no_verdict_on_its_environment(environment, tmp_path):
    not_a_library = tmp_path / "kernel.so"
    not_a_library.write_bytes(b"not a shared library")
    with pytest.raises(LibraryDoesNotLoad, match="could not load it \\(exit code 1\\)"):
        load_probe.check_loads(environment, not_a_library, "cpu", [-1], known_good=True)
    assert load_probe.runtime_crashes(environment) is None
    assert not (environment / VERDICT_FILE).exists()


def test_once_a_kernel_has_loaded_the_environment_is_not_probed_again(environment, tmp_path, monkeypatch):
    monkeypatch.setattr(load_probe, "_CHILD", "pass")  # a load that succeeds, without a kernel to load
    load_probe.check_loads(environment, tmp_path / "kernel.so", "cpu", [-1], known_good=False)
    assert load_probe.recorded_verdicts(tmp_path / "root") == {environment.name: None}
    forget_in_process()
    no_probe(monkeypatch)
    load_probe.check_loads(environment, tmp_path / "another kernel.so", "cpu", [-1], known_good=False)


def test_a_verdict_that_cannot_be_kept_on_disk_is_kept_by_the_process(tmp_path, monkeypatch):
    missing = tmp_path / "not created"
    monkeypatch.setattr(load_probe, "_CHILD", "pass")
    load_probe.check_loads(missing, tmp_path / "kernel.so", "cpu", [-1], known_good=False)
    no_probe(monkeypatch)
    load_probe.check_loads(missing, tmp_path / "kernel.so", "cpu", [-1], known_good=False)


@pytest.mark.parametrize("record", ['{"crashed": true}', '{"loads": false, "reason": null}', "{not json"])
def test_a_verdict_of_another_form_is_judged_again(environment, tmp_path, record):
    (environment / VERDICT_FILE).write_text(record)
    assert load_probe.runtime_crashes(environment) is None
    assert load_probe.recorded_verdicts(tmp_path / "root") == {}
