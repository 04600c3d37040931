"""Choosing a C++ compiler whose libraries work beside torch, and the vector ISA it targets."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch._inductor import cpu_vec_isa

import aoti_eager
from aoti_eager.kernels import toolchain
from helpers import assert_same_as_eager

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


def test_a_compiler_whose_libraries_crash_beside_torch_is_passed_over(tmp_path, private_root, monkeypatch, caplog):
    bad = _compiler_whose_libraries_crash(tmp_path)
    monkeypatch.setenv("CXX", bad)
    assert toolchain.candidates()[0] == bad
    assert "signal 11" in toolchain.why_unusable(bad)

    chosen = toolchain.cpp_compiler()
    assert chosen != bad and toolchain.why_unusable(chosen) is None
    assert any(bad in r.getMessage() for r in caplog.records)
    # The verdict is kept: the next process reads it instead of probing.
    (record,) = (private_root / "machine").glob("compiler-choice-*.json")
    assert json.loads(record.read_text())["compiler"] == chosen


def test_a_recorded_compiler_is_believed_only_if_it_is_a_candidate(tmp_path, private_root, monkeypatch):
    monkeypatch.setenv("CXX", shutil.which("g++"))
    chosen = toolchain.cpp_compiler()
    (record,) = (private_root / "machine").glob("compiler-choice-*.json")
    planted = tmp_path / "not-a-compiler"
    record.write_text(json.dumps({"compiler": str(planted)}))
    toolchain.cpp_compiler.cache_clear()
    assert toolchain.cpp_compiler() == chosen


def test_the_users_compiler_comes_first_when_it_works(private_root, monkeypatch):
    monkeypatch.setenv("CXX", shutil.which("g++"))
    assert toolchain.cpp_compiler() == shutil.which("g++")


def test_a_compiler_that_is_not_installed_is_not_a_candidate(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-9")
    assert "no-such-compiler-9" not in toolchain.candidates()
    assert toolchain.candidates(), "g++ is on PATH"


def test_known_vec_isas_stand_in_for_inductors_probe():
    usable = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    with toolchain.known_vec_isas(usable[1:]):
        assert [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == usable[1:]
        assert cpu_vec_isa.pick_vec_isa() == (cpu_vec_isa.valid_vec_isa_list()[0] if len(usable) > 1 else cpu_vec_isa.invalid_vec_isa)
    with toolchain.known_vec_isas(["an ISA of another torch"]):
        assert [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == usable
    assert [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == usable


def test_a_compile_does_not_probe_the_vec_isa_again(shared_cache, monkeypatch):
    toolchain.usable_vec_isas()  # the one probe per machine, if no earlier test made it
    probes = []
    original = cpu_vec_isa.valid_vec_isa_list
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: probes.append(1) or original())
    x = torch.randn(43)
    with aoti_eager.enabled(["aten::abs"], devices=["cpu"], cache_dir=shared_cache, record=None):
        result = torch.abs(x)
        stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(result, x.abs())
    assert stats["compiles"] + stats["cache_loads"] == 1, stats
    assert probes == []
