"""Choosing a C++ compiler whose libraries work beside torch."""

from __future__ import annotations

import json
import shutil

import pytest

from aoti_eager.kernels import toolchain

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _compiler_whose_libraries_crash(tmp_path):
    """A g++ that adds a constructor raising SIGSEGV to every library: what a
    library with its own static libstdc++ does beside torch, made certain."""
    crash = tmp_path / "crash.cpp"
    crash.write_text("#include <csignal>\n__attribute__((constructor)) static void crash() { std::raise(SIGSEGV); }\n")
    compiler = tmp_path / "crashing-g++"
    compiler.write_text(f'#!/bin/sh\nexec g++ "$@" -x c++ {crash}\n')
    compiler.chmod(0o755)
    return str(compiler)


def test_a_compiler_whose_libraries_crash_beside_torch_is_passed_over(tmp_path, monkeypatch, caplog):
    bad = _compiler_whose_libraries_crash(tmp_path)
    monkeypatch.setenv("CXX", bad)
    assert toolchain.candidates()[0] == bad
    assert "signal 11" in toolchain.why_unusable(bad)

    chosen = toolchain.cpp_compiler(tmp_path / "cache")
    assert chosen != bad and toolchain.why_unusable(chosen) is None
    assert any(bad in r.getMessage() for r in caplog.records)
    # The verdict is kept: the next process reads it instead of probing.
    (record,) = (tmp_path / "cache" / "machine").glob("compiler-choice-*.json")
    assert json.loads(record.read_text())["compiler"] == chosen


def test_the_users_compiler_comes_first_when_it_works(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", shutil.which("g++"))
    assert toolchain.cpp_compiler(tmp_path) == shutil.which("g++")


def test_a_compiler_that_is_not_installed_is_not_a_candidate(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-9")
    assert "no-such-compiler-9" not in toolchain.candidates()
    assert toolchain.candidates(), "g++ is on PATH"
