"""What kernels are built with (aoti_eager.kernels.toolchain): a C++ compiler
whose libraries work beside torch, the vector ISA it targets, and the
environment's name, which says all of it in the cache."""

from __future__ import annotations

import json
import platform
import shutil
import threading

import pytest
import torch
from torch._inductor import cpu_vec_isa

import aoti_eager
from aoti_eager.cache import KernelCache, layout
from aoti_eager.kernels import toolchain
from aoti_eager.kernels.inductor import vec_isa
from aoti_eager.kernels.toolchain import environment_name
from helpers import assert_same_as_eager, publish_kernel

CPU = torch.device("cpu")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _compiler_whose_libraries_crash(tmp_path):
    """A g++ that adds a constructor raising SIGSEGV to every library: what a
    library with its own static libstdc++ does beside torch, made certain."""
    crash = tmp_path / "crash.cpp"
    crash.write_text("#include <csignal>\n__attribute__((constructor)) static void crash() { std::raise(SIGSEGV); }\n")
    compiler = tmp_path / "crashing-g++"
    compiler.write_text(f'#!/bin/sh\nexec g++ "$@" -x c++ {crash}\n')
    compiler.chmod(0o755)
    return str(compiler)


@needs_gxx
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


@needs_gxx
def test_a_recorded_compiler_is_believed_only_if_it_is_a_candidate(tmp_path, private_root, monkeypatch):
    monkeypatch.setenv("CXX", shutil.which("g++"))
    chosen = toolchain.cpp_compiler()
    (record,) = (private_root / "machine").glob("compiler-choice-*.json")
    planted = tmp_path / "not-a-compiler"
    record.write_text(json.dumps({"compiler": str(planted)}))
    toolchain.forget()
    assert toolchain.cpp_compiler() == chosen


@needs_gxx
def test_the_users_compiler_comes_first_when_it_works(private_root, monkeypatch):
    monkeypatch.setenv("CXX", shutil.which("g++"))
    assert toolchain.cpp_compiler() == shutil.which("g++")


@needs_gxx
def test_a_compiler_that_is_not_installed_is_not_a_candidate(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-9")
    assert "no-such-compiler-9" not in toolchain.candidates()
    assert toolchain.candidates(), "g++ is on PATH"


@needs_gxx
def test_known_vec_isas_stand_in_for_inductors_probe():
    usable = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    with vec_isa.known_vec_isas({name: [] for name in usable[1:]}):
        assert [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == usable[1:]
        assert cpu_vec_isa.pick_vec_isa() == (cpu_vec_isa.valid_vec_isa_list()[0] if len(usable) > 1 else cpu_vec_isa.invalid_vec_isa)
    with vec_isa.known_vec_isas({"an ISA of another torch": []}):
        assert [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == usable
    assert [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == usable


def test_known_vec_isas_stand_in_for_an_isas_own_check(monkeypatch):
    """AMX's check builds and runs a test program in a new process, once per
    process: an ISA the probe found usable is taken as usable."""
    amx = next(isa for isa in cpu_vec_isa.supported_vec_isa_list if isinstance(isa, cpu_vec_isa.VecAMX))
    own_check = cpu_vec_isa.VecAMX.__bool__
    checks = []
    monkeypatch.setattr(cpu_vec_isa.VecAMX, "check_build", lambda isa, code: checks.append(code) or False)
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda isa, code: checks.append(code) or False)
    with vec_isa.known_vec_isas({str(amx): []}):
        assert bool(amx) and checks == []
    assert cpu_vec_isa.VecAMX.__bool__ is own_check


@needs_gxx
def test_a_compile_does_not_probe_the_vec_isa_again(shared_cache, monkeypatch):
    toolchain.usable_vec_isas()  # the one probe per machine, if no earlier test made it
    probes = []
    original = cpu_vec_isa.valid_vec_isa_list
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: probes.append(1) or original())
    # Nor the chosen ISA's own build-and-load check, which Inductor remembers per process.
    cpu_vec_isa.VecISA._VecISA__bool__impl.cache_clear()
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda isa, code: probes.append(str(isa)) or True)
    x = torch.randn(43)
    with aoti_eager.enabled(["aten::abs"], devices=["cpu"], cache_dir=shared_cache, record=None):
        result = torch.abs(x)
        stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(result, x.abs())
    assert stats["compiles"] + stats["cache_loads"] == 1, stats
    assert probes == []


@pytest.mark.parametrize("recorded", ["torch-version", "isa"])
def test_an_entry_of_another_torch_or_isa_is_never_found(tmp_path, monkeypatch, recorded, swap_toolchain):
    swap_toolchain(cpu_isa=lambda: "avx512")
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    publish_kernel(KernelCache(tmp_path, environment_name(CPU)), tmp_path)
    assert KernelCache(tmp_path, environment_name(CPU)).lookup("aten::abs", "sig") is not None
    if recorded == "isa":
        swap_toolchain(cpu_isa=lambda: "avx2")
    else:
        monkeypatch.setattr(torch, "__version__", "2.98.0")
    assert KernelCache(tmp_path, environment_name(CPU)).lookup("aten::abs", "sig") is None


def test_environment_name_names_the_compiler_the_linker_and_the_inductor_options(tmp_path, swap_toolchain):
    swap_toolchain(cpu_isa=lambda: "avx2")
    base = toolchain.environment_name(CPU, {"cpp.min_chunk_size": 32768})
    assert toolchain.environment_name(CPU, {"cpp.min_chunk_size": 1}) != base
    swap_toolchain(compiler_identity=lambda compiler=None: "g++: g++ 99.0")
    assert toolchain.environment_name(CPU, {"cpp.min_chunk_size": 32768}) != base
    compiler = toolchain.environment_name(CPU, {"cpp.min_chunk_size": 32768})
    other_linker = None if toolchain.linker() else "gold"
    swap_toolchain(linker=lambda: other_linker)
    assert toolchain.environment_name(CPU, {"cpp.min_chunk_size": 32768}) not in (base, compiler)


def test_environment_names_are_those_of_cache_layout_v2(monkeypatch, swap_toolchain):
    """Directory names of existing caches: the same inputs must keep naming
    the same environment (these were computed before the names' code moved,
    then again when CPU libraries began to borrow their inputs, which a
    runtime that hands inputs over must not load)."""
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(torch.version, "git_version", "0123abc")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(toolchain, "__version__", "0.9.0")
    swap_toolchain(cpu_isa=lambda: "avx512 avx512_vnni")
    swap_toolchain(cpu_identity=lambda: "cpu0123456789abc")
    swap_toolchain(compiler_identity=lambda compiler=None: f"{compiler}: g++ (GCC) 13.2.0")
    swap_toolchain(linker=lambda: None)
    options = {"cpp.min_chunk_size": 32768, "cpp.cxx": (None, "/usr/bin/g++")}
    assert environment_name(CPU) == "cpu-avx512_avx512_vnni-torch2.13.0+cpu-5260a4c335ff"
    assert environment_name(CPU, options) == "cpu-avx512_avx512_vnni-torch2.13.0+cpu-2454b86dba1a"


def test_device_index_is_not_in_the_key(tmp_path, swap_toolchain):
    swap_toolchain(cpu_isa=lambda: "avx2")
    assert toolchain.environment_name(torch.device("cpu")) == toolchain.environment_name(torch.device("cpu", 0))


def test_isa_probe_is_remembered_on_disk(private_root, monkeypatch):
    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    class ProbedISA:
        def __init__(self, name, **found):
            self.name = name
            self.__dict__.update(found)

        def __str__(self):
            return self.name

    calls = []
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: calls.append(1) or "avx512")
    isas = [ProbedISA("avx512", _is_avx512_bf16_supported=True, _is_amx_fp16_supported=False), ProbedISA("avx2")]
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", lambda: isas)
    assert toolchain.cpu_isa() == "avx512"
    vec_isa.forget()
    usable = {"avx512": ["_is_avx512_bf16_supported"], "avx2": []}
    assert (toolchain.cpu_isa(), toolchain.usable_vec_isas()) == ("avx512", usable)
    assert calls == [1]

    # A record of another shape is probed again.
    record = next(layout.machine_record("x").parent.glob("vec-isas-*-torch*.json"))
    record.write_text(json.dumps({"isa": "avx512", "usable": ["avx512", "avx2"]}))
    vec_isa.forget()
    assert toolchain.usable_vec_isas() == usable
    assert calls == [1, 1]


def test_known_vec_isas_set_the_extensions_the_probe_found():
    """A process that did not probe compiles with the probe's flags (-mavx512bf16
    where the CPU has AVX-512 BF16), as the process that probed did."""
    avx512 = vec_isa.vec_isa_named("avx512")
    if avx512 is None or not hasattr(type(avx512), "_is_avx512_bf16_supported"):
        pytest.skip("this torch has no AVX-512 BF16 extension")
    saved = dict(vars(avx512))
    try:
        vars(avx512).pop("_is_avx512_bf16_supported", None)
        assert "-mavx512bf16" not in avx512.build_arch_flags()
        # Names that are not an extension of the ISA's class are no one's to set.
        with vec_isa.known_vec_isas({"avx512": ["_is_avx512_bf16_supported", "_is_made_up_supported", "__class__"]}):
            assert "-mavx512bf16" in avx512.build_arch_flags()
            assert not hasattr(avx512, "_is_made_up_supported") and type(avx512).__name__ == "VecAVX512"
    finally:
        vars(avx512).clear()
        vars(avx512).update(saved)



def test_a_toolchain_scope_names_the_environment_and_ends_with_its_block():
    names = []
    with toolchain.scope(cpu_isa=lambda: "an-isa", cpu_identity=lambda: "a-cpu"):
        thread = threading.Thread(target=lambda: names.append(environment_name(CPU)))
        thread.start()
        thread.join()
    assert names[0].startswith("cpu-an-isa-") and toolchain.current() == toolchain.Toolchain()
    assert environment_name(CPU) != names[0]
