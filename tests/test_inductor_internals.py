"""kernels/inductor/: each module's torch internals are in the installed
torch, as its docstring names them, and where one has moved the module steps
aside: Inductor's own code runs, and a compile still gives eager's result."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch._inductor import codecache, cpp_builder, cpu_vec_isa
from torch._inductor.codegen import cpp
from torch._inductor.runtime import cache_dir_utils

import aoti_eager
from aoti_eager.kernels.inductor import headers, internals, load_probe, parallel_grain, scratch, shims, vec_isa, wrapper_split
from helpers import assert_same_as_eager

MODULES = [headers, load_probe, parallel_grain, scratch, shims, vec_isa, wrapper_split]
ids = [module.__name__.rsplit(".", 1)[1] for module in MODULES]


@pytest.mark.parametrize("module", MODULES, ids=ids)
def test_every_internal_a_module_relies_on_is_in_the_installed_torch(module):
    moved = internals.missing(module.INTERNALS)
    assert not moved, f"{module.__name__} relies on torch {torch.__version__} internals that moved: {moved}"


@pytest.mark.parametrize("module", MODULES, ids=ids)
def test_a_modules_docstring_names_each_internal_it_touches_and_the_torch_versions(module):
    text = " ".join(module.__doc__.split())
    assert "checked with torch 2.11, 2.13 and 2.14.1" in text
    assert [name for name in map(internals.named, module.INTERNALS) if f"``{name}``" not in text] == []


def test_an_internal_that_moved_or_changed_shape_is_named(monkeypatch):
    assert internals.missing(headers.INTERNALS) == []
    monkeypatch.delattr(codecache, "_worker_compile_cpp")
    monkeypatch.setattr(codecache, "_precompile_header", lambda header, command: "")
    assert internals.missing(headers.INTERNALS) == [
        "torch._inductor.codecache._precompile_header: takes no parameter named hashable_cmd_line",
        "torch._inductor.codecache._worker_compile_cpp: not found",
    ]
    assert internals.missing(["torch._inductor.no_such_module.f()"]) == ["torch._inductor.no_such_module.f: not found"]
    with pytest.raises(internals.InternalMoved, match="torch._inductor.codecache._worker_compile_cpp: not found"):
        internals.resolve("torch._inductor.codecache._worker_compile_cpp")


@pytest.mark.parametrize("table", ["_SHIMS", "_DECOMPOSITIONS", "_LOWERINGS"])
def test_without_its_internals_no_op_is_said_to_be_proxy_only(table, monkeypatch):
    svd = torch.ops.aten._linalg_svd.default
    assert shims.proxy_only(svd)
    monkeypatch.setattr(shims, table, "torch._inductor.no_such_module.table")
    forget = lambda: (shims.proxy_only.cache_clear(), shims._inductor_tables.cache_clear())  # noqa: E731
    forget()
    try:
        assert not shims.proxy_only(svd)
    finally:
        forget()  # the answer without the patch, at the next call


def test_inductors_tables_are_read_once_per_torch_build(monkeypatch):
    svd, cos = torch.ops.aten._linalg_svd.default, torch.ops.aten.cos.default
    shims._inductor_tables.cache_clear()
    shims._inductor_tables()  # read, or remembered by an earlier process
    shims._inductor_tables.cache_clear()
    monkeypatch.setattr(shims, "resolve", lambda name: pytest.fail(f"read {name} again") if name != shims._SHIMS else internals.resolve(name))
    shims.proxy_only.cache_clear()
    try:
        assert shims.proxy_only(svd) and not shims.proxy_only(cos)
    finally:
        shims.proxy_only.cache_clear()


def test_an_op_whose_c_shim_the_headers_gate_on_a_later_torch_goes_to_the_proxy_executor(monkeypatch):
    from torchgen.aoti.fallback_ops import inductor_fallback_ops

    listed = dict(inductor_fallback_ops)
    with shims.declared_only("cpu", shims.declared_shims("cpu")):  # the installed headers: CUDA's attention has no CPU shim
        assert "aten._cdist_forward.default" in inductor_fallback_ops
        assert "aten._flash_attention_forward.default" not in inductor_fallback_ops
    assert inductor_fallback_ops == listed
    monkeypatch.setattr(torch, "__version__", "2.11.0")  # whose CUDA header gates _grouped_mm's shim on 2.12
    shims.declared_shims.cache_clear()
    try:
        with shims.declared_only("cuda", shims.declared_shims("cuda")):
            assert "aten._grouped_mm.default" not in inductor_fallback_ops
            assert "aten.bucketize.Tensor" in inductor_fallback_ops
    finally:
        shims.declared_shims.cache_clear()
    assert inductor_fallback_ops == listed


def test_without_its_internals_the_wrapper_is_built_as_inductor_builds_it(tmp_path, monkeypatch):
    monkeypatch.delattr(cpp_builder, "_BUILD_TEMP_DIR")
    build = cpp_builder.CppBuilder.build
    with wrapper_split.split_wrapper_builds(tmp_path, {}, "gold"):
        assert cpp_builder.CppBuilder.build is build


def test_without_its_internals_no_header_is_checked_ahead(tmp_path, monkeypatch, swap_toolchain):
    monkeypatch.delattr(codecache, "_worker_compile_cpp")
    monkeypatch.setattr(headers, "_started", {})
    key = headers._key("torch/csrc/inductor/cpp_prefix.h", "g++", {"aot_mode": True, "device_type": "cpu"})
    (tmp_path / "precompiled_headers.json").write_text(json.dumps([key]))
    check = codecache._precompile_header
    with headers.checked_ahead(tmp_path):
        assert codecache._precompile_header is check
    assert headers._started == {}
    swap_toolchain(remembered_vec_isas=lambda: pytest.fail("asked for the vector ISAs, to check headers with"))
    headers.check_recorded(lambda device_type: {})


def test_without_its_internals_parallel_regions_are_inductors(monkeypatch):
    monkeypatch.delattr(cpp, "sympy_product")
    parallel, loops = cpp.WorkSharing.parallel, cpp.CppKernelProxy.codegen_loops_impl
    with parallel_grain.parallel_above_grain():
        assert (cpp.WorkSharing.parallel, cpp.CppKernelProxy.codegen_loops_impl) == (parallel, loops)


def test_without_its_internals_inductors_caches_stay_where_inductor_puts_them(monkeypatch):
    monkeypatch.delattr(cache_dir_utils, "default_cache_dir")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    header_dir = codecache._HEADER_DIR
    with scratch.compiling():
        assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and codecache._HEADER_DIR == header_dir
        assert os.environ["TMPDIR"] == str(scratch.root() / "tmp")  # the compiler's files: still the scratch root's


def test_without_its_internals_the_vector_isas_are_left_to_inductors_probe(private_root, monkeypatch):
    probe = cpu_vec_isa.valid_vec_isa_list
    monkeypatch.delattr(cpu_vec_isa, "pick_vec_isa")
    assert (vec_isa.isa(), vec_isa.usable()) == (vec_isa.UNPROBED, {})
    assert not (private_root / "machine").exists() or not any((private_root / "machine").glob("vec-isas-*"))
    with vec_isa.known_vec_isas({"avx2": []}):
        assert cpu_vec_isa.valid_vec_isa_list is probe
    vec_isa.forget()


def _moved_everywhere(monkeypatch):
    """Every module of kernels/inductor/ finds an internal moved. (Removing
    one of Inductor's own would break Inductor itself, not only the patch.)"""
    for module in MODULES:
        monkeypatch.setattr(module, "INTERNALS", (*module.INTERNALS, "torch._inductor.no_such_internal"))


@pytest.mark.slow
def test_with_every_internal_moved_a_compile_still_gives_eagers_result(tmp_path, private_root, monkeypatch):
    _moved_everywhere(monkeypatch)
    x = torch.randn(29, 3)
    with aoti_eager.enabled(["aten::abs"], devices=["cpu"], cache_dir=tmp_path / "cache", record=None):
        result = torch.abs(x)
        stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(result, x.abs())
    assert stats["compiles"] == 1 and stats["fallbacks"] == 0, stats
    # Nothing split off the wrapper, no header check recorded, no ISAs remembered.
    assert [p.name for p in (private_root / "shared").rglob("*") if p.is_file()] == []
    assert list(private_root.glob("machine/vec-isas-*")) == []
