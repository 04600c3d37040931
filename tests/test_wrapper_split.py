"""The wrapper built in two parts: same kernels, the shared part built once,
and Inductor's own build whenever the split cannot be made."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import aoti_eager
from aoti_eager import _overrides
from aoti_eager.cache import layout
from aoti_eager.kernels.inductor import wrapper_split
from conftest import DEVICES
from helpers import assert_same_as_eager


@pytest.fixture(autouse=True)
def _starts_without_a_shared_part(private_root):
    pass


def shared_objects(root):
    return sorted((root / "private" / "shared").glob("*/wrapper-interface-*.o"))


def compile_abs(root, *sizes):
    """Compiles ``abs`` for each size; returns results, expected and stats."""
    xs = [torch.randn(n) for n in sizes]
    aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=root)
    results = [torch.abs(x) for x in xs]
    stats = aoti_eager.stats()["aten::abs"]
    aoti_eager.disable()
    _overrides.forget()  # the next call starts as a new process
    return results, [x.abs() for x in xs], stats


def test_split_kernels_match_eager_and_share_one_interface(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_DYNAMIC_SHAPES", "0")  # each size its own compile, each sharing the interface
    results, expected, stats = compile_abs(tmp_path, 33, 34)
    assert (stats["compiles"], stats["fallbacks"]) == (2, 0)
    for r, e in zip(results, expected):
        assert_same_as_eager(r, e)
    [shared] = shared_objects(tmp_path)
    built = shared.stat().st_mtime_ns
    results, expected, stats = compile_abs(tmp_path, 35)
    assert stats["compiles"] == 1
    assert_same_as_eager(results[0], expected[0])
    assert shared_objects(tmp_path) == [shared] and shared.stat().st_mtime_ns == built


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs binutils' nm")
def test_libraries_export_only_the_interface(shared_cache):
    compile_abs(shared_cache, 42)
    library = next(shared_cache.glob(f"{layout.LAYOUT_VERSION}/*/aten.abs/*/kernel.so"))
    listing = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True, text=True, check=True)
    symbols = [line.split()[-2:] for line in listing.stdout.splitlines()]
    names = [name for _, name in symbols]
    assert {"AOTInductorModelContainerRunSingleThreaded", "aoti_eager_run", "aoti_eager_empty_strided_hook"} <= set(names)
    # gold keeps exporting a weak instance of a libstdc++ template that
    # libstdc++.so also defines (std::string::_M_create): harmless in a library
    # loaded RTLD_LOCAL. Nothing else of the C++ code may be exported.
    others = [(kind, name) for kind, name in symbols if not name.startswith(("AOTInductor", "aoti_eager_"))]
    assert all(kind in "Ww" and name.startswith(("_ZNSt", "_ZNKSt")) for kind, name in others), others


def test_a_broken_shared_part_falls_back_to_inductors_build(tmp_path):
    compile_abs(tmp_path, 36)
    [shared] = shared_objects(tmp_path)
    shared.write_bytes(b"not an object file")
    results, expected, stats = compile_abs(tmp_path, 37)
    assert (stats["compiles"], stats["fallbacks"], stats["hits"]) == (1, 0, 0)
    assert_same_as_eager(results[0], expected[0])
    assert not shared.exists()  # removed, so that the next compile builds it again
    compile_abs(tmp_path, 38)
    assert shared_objects(tmp_path) == [shared]


@pytest.mark.parametrize("how", ["unexpected wrapper", "switched off"])
def test_without_the_split_inductor_builds_the_wrapper(tmp_path, monkeypatch, how):
    if how == "switched off":
        monkeypatch.setenv("AOTI_EAGER_SPLIT_WRAPPER", "0")
    else:
        monkeypatch.setattr(wrapper_split, "_INTERFACE_END", "\n// a marker no wrapper has\n")
    results, expected, stats = compile_abs(tmp_path, 40)
    assert (stats["compiles"], stats["fallbacks"]) == (1, 0)
    assert_same_as_eager(results[0], expected[0])
    assert shared_objects(tmp_path) == []


def test_compile_stages_are_timed(tmp_path, caplog):
    with caplog.at_level("INFO", logger="aoti_eager"):
        compile_abs(tmp_path, 39)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("aoti_eager: compiled")]
    for stage in ("export", "wrapper", "kernel", "link", "lowering", "load"):
        assert f"{stage} " in line, line


def loaded_kernels() -> set[str]:
    """The kernel libraries loaded in this process: each from its private copy,
    removed once loaded (see aoti_eager.cache.store)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split(maxsplit=5)[-1].strip().removesuffix(" (deleted)") for line in maps if "/" in line}
    copies = layout.process_prefix("load")
    return {path for path in paths if Path(path).parent.name.startswith(copies) and path.endswith(".so")}


def allocation_hooks(libraries):
    """The allocation hook of each of ``libraries`` (loaded in this process)."""
    hooks = []
    for library in libraries:
        handle = ctypes.CDLL(library, mode=os.RTLD_NOW | os.RTLD_NOLOAD)
        hooks.append(ctypes.c_void_p.in_dll(handle, "aoti_eager_empty_strided_hook").value)
    return hooks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_split_kernels_allocate_through_the_runtimes_hook(shared_cache, tmp_path, device, deterministic):
    """On CUDA the hook allocates from the caching allocator, except in
    deterministic mode (which fills new memory); elsewhere it is the shim."""
    x, y = torch.randn(8, 9, device=device), torch.randn(8, 9, device=device)
    with aoti_eager.enabled(["aten::mul.Tensor"], devices=[device], cache_dir=shared_cache):
        torch.mul(x, y)  # compiled once in the session
    # mul's entries alone in a new root: its kernel is loaded again, from a private copy of its own.
    for op_folder in shared_cache.glob(f"{layout.LAYOUT_VERSION}/*/aten.mul.Tensor"):
        shutil.copytree(op_folder, tmp_path / op_folder.relative_to(shared_cache))
    loaded_before = loaded_kernels()
    aoti_eager.enable(["aten::mul.Tensor"], devices=[device], cache_dir=tmp_path)
    try:
        torch.use_deterministic_algorithms(deterministic)
        results = [torch.mul(x, y) for _ in range(2)]
        hooks = allocation_hooks(loaded_kernels() - loaded_before)
        stats = aoti_eager.stats()["aten::mul.Tensor"]
    finally:
        torch.use_deterministic_algorithms(False)
    assert hooks and all(hooks) and stats["hits"] >= 1
    for result in results:
        assert_same_as_eager(result, x * y)
    assert results[0].data_ptr() != results[1].data_ptr()


_RUN_IMPL = """CACHE_TORCH_DEVICE({device});
void AOTInductorModel::run_impl(AtenTensorHandle* input_handles, AtenTensorHandle* output_handles) {{
    auto inputs = steal_from_raw_handles_to_raii_handles(input_handles, 2);
    auto arg0_1 = std::move(inputs[0]);
    auto arg1_1 = std::move(inputs[1]);
    inputs.clear();
    if (_check_aoti_runtime_check_inputs_env()) {{ assert_size_stride(arg0_1, {{4L}}, {{1L}}, "input"); }}
    {use}
    arg0_1.reset();
}} // AOTInductorModel::run_impl
"""


@pytest.mark.parametrize(
    "device, use, borrows",
    [
        ("cpu", "cpp_fused_add_0((const float*)(arg0_1.data_ptr()), (float*)(arg1_1.data_ptr()));", True),
        ("cpu", "AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_item_float64(arg1_1, &zuf0_raw));", True),
        ("cpu", "AOTI_TORCH_ERROR_CODE_CHECK(aoti_eager_item_float64(arg1_1, &zuf0_raw));", True),
        ("cpu", "output_handles[0] = arg1_1.release();", False),
        ("cpu", "RAIIAtenTensorHandle buf0(std::move(arg1_1));", False),
        ("cpu", "output_handles[0] = wrap_with_raii_handle_if_needed(arg1_1).release();", False),
        ("cuda", "launch((const float*)(arg0_1.data_ptr()), (float*)(arg1_1.data_ptr()));", False),
    ],
    ids=["data pointers", "shim call", "helper call", "handed back", "moved into an owner", "wrapped in an owner", "cuda"],
)
def test_a_cpu_wrapper_borrows_its_inputs_only_where_it_only_reads_them(device, use, borrows):
    text = _RUN_IMPL.format(device=device, use=use)
    borrowed = wrapper_split._borrow_inputs(text)
    assert (borrowed != text) == borrows
    assert ("aoti_eager_borrows_inputs" in borrowed) == borrows


def test_a_kernel_that_borrows_its_inputs_neither_keeps_nor_frees_them(shared_cache):
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=shared_cache):
        torch.add(a, b)
        counts = a._use_count(), b._use_count()
        results = [torch.add(a, b) for _ in range(3)]
        assert (a._use_count(), b._use_count()) == counts
        assert aoti_eager.stats()["aten::add.Tensor"]["hits"] >= 3
    libraries = shared_cache.glob(f"{layout.LAYOUT_VERSION}/*/aten.add.Tensor/*/kernel.so")
    symbols = [subprocess.run(["nm", "-D", "--defined-only", str(p)], capture_output=True, text=True, check=True).stdout for p in libraries]
    assert any("aoti_eager_borrows_inputs" in s for s in symbols)
    for r in results:
        assert_same_as_eager(r, a + b)


def test_a_kernel_that_hands_an_input_to_an_extern_call_borrows_it(shared_cache, caplog):
    """A convolution's wrapper passes its inputs to the shim as
    ``temporary_reference(arg.get())``: the own part builds, and borrows them."""
    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(4, 3, 2, 2), torch.randn(4)
    with aoti_eager.enabled(["aten::convolution"], devices=["cpu"], cache_dir=shared_cache):
        results = [torch.nn.functional.conv2d(x, w, b, stride=2) for _ in range(2)]
        assert aoti_eager.stats()["aten::convolution"]["hits"] >= 1
    assert "building the wrapper whole" not in caplog.text
    libraries = shared_cache.glob(f"{layout.LAYOUT_VERSION}/*/aten.convolution/*/kernel.so")
    symbols = [subprocess.run(["nm", "-D", "--defined-only", str(p)], capture_output=True, text=True, check=True).stdout for p in libraries]
    assert any("aoti_eager_borrows_inputs" in s for s in symbols)
    for r in results:
        assert_same_as_eager(r, torch.nn.functional.conv2d(x, w, b, stride=2))


@pytest.mark.parametrize("grad_mode", [True, False])
def test_a_call_leaves_grad_mode_as_it_found_it(shared_cache, grad_mode):
    """The runtime's entry point turns grad mode off for the kernel only."""
    a, b = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8)
    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=shared_cache), torch.set_grad_enabled(grad_mode):
        results = [torch.add(a, b, alpha=2.5) for _ in range(2)]
        assert torch.is_grad_enabled() == grad_mode
        assert aoti_eager.stats()["aten::add.Tensor"]["hits"] >= 1
    for r in results:
        assert r.requires_grad == grad_mode
        assert_same_as_eager(r.detach(), torch.add(a, b, alpha=2.5).detach())
    if grad_mode:
        results[1].sum().backward()
        torch.testing.assert_close(a.grad, torch.ones(8, 8))


# The model's constructor as AOTInductor writes it (torch 2.13, CPU).
_CONSTRUCTOR = """AOTInductorModel::AOTInductorModel(std::shared_ptr<ConstantMap> constants_map,
                                   std::shared_ptr<std::vector<ConstantHandle>> constants_array,
                                   const std::string& device_str,
                                   std::optional<std::string> cubin_dir)
    : AOTInductorModelBase(2,
                           1,
                           0,
                           device_str,
                           std::move(cubin_dir),
                           true) {{
    inputs_info_[0].name = "arg0_1";
    {use}
}}
"""


def test_the_op_part_of_a_constructor_leaves_the_base_to_the_shared_part():
    split = wrapper_split._split_constructor(_CONSTRUCTOR.format(use="update_constants_map(std::move(constants_map));"))
    assert "aoti_eager_model_parts = {2, 1, 0, true};" in split and "AOTInductorModelBase(" not in split
    assert 'inputs_info_[0].name = "arg0_1";' in split and "update_constants_map(std::move(constants_map));" in split
    # What only the base's arguments may use, and text of another shape, keep the constructor whole.
    assert wrapper_split._split_constructor(_CONSTRUCTOR.format(use="log(device_str);")) is None
    assert wrapper_split._split_constructor(_CONSTRUCTOR.replace("true)", "load_weights())")) is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_generated_constructor_is_split(tmp_path, monkeypatch, device):
    """Inductor's own text, not only the sample above: a change in it would
    quietly keep the slower build."""
    splits = []
    real = wrapper_split._split_constructor
    monkeypatch.setattr(wrapper_split, "_split_constructor", lambda body: splits.append(real(body)) or splits[-1])
    x = torch.randn(41, device=device)
    with aoti_eager.enabled(["aten::neg"], devices=[device], cache_dir=tmp_path):
        result = torch.neg(x)
        assert aoti_eager.stats()["aten::neg"]["compiles"] == 1
    assert_same_as_eager(result, -x)
    assert splits and all(split is not None for split in splits)


# A launch helper as AOTInductor writes it (torch 2.11, CUDA), its kernel's
# Triton source in a comment: ``ks0`` is a float read at run time, ``ks1`` an int.
_LAUNCH_HELPER = """template <typename in_ptr0_type_, typename kernels_type_>
static inline void call_triton_poi_fused_mul_0(
    const in_ptr0_type_& in_ptr0,
    int64_t ks0,
    int64_t ks1,
    int32_t device_idx_,
    kernels_type_& kernels_,
    const std::optional<std::string>& cubin_dir_ = std::nullopt
){
    /*
    triton_meta={'signature': {'in_ptr0': '*fp32', 'ks0': 'fp64', 'ks1': 'i32'}}
    */
    CUdeviceptr var_0 = reinterpret_cast<CUdeviceptr>(in_ptr0.data_ptr());
    double var_1 = ks0;
    int32_t var_2 = ks1;
    void* kernel_args_[] = {&var_0, &var_1, &var_2};
}
"""


def test_a_launch_helper_takes_a_float_it_hands_its_kernel_as_a_double():
    fixed = wrapper_split._float_parameters_as_double(_LAUNCH_HELPER + _LAUNCH_HELPER.replace("mul_0", "mul_1").replace("double var_1", "int64_t var_1"))
    first, second = fixed.split("template", 2)[1:]
    assert "    double ks0,\n    int64_t ks1," in first
    assert "    int64_t ks0,\n    int64_t ks1," in second  # each helper by itself
    assert wrapper_split._float_parameters_as_double(fixed) == fixed


def test_the_shared_part_keeps_only_the_first_device_header():
    head = (
        "\n#include <torch/csrc/inductor/aoti_include/cuda.h>\n#include <torch/csrc/inductor/aoti_include/cpu.h>\n"
        "#include <torch/csrc/inductor/aoti_runtime/interface.h>\n#include <iostream>\nint x;\n"
    )
    assert wrapper_split._shared_head(head) == head.replace("#include <torch/csrc/inductor/aoti_include/cpu.h>\n", "")
    alone = "#include <torch/csrc/inductor/aoti_include/cpu.h>\nint x;\n"
    assert wrapper_split._shared_head(alone) == alone


@pytest.mark.parametrize("device", DEVICES)
def test_one_shared_part_serves_kernels_with_and_without_runtime_numbers(tmp_path, device):
    """A CUDA wrapper that reads a runtime float also includes the CPU header;
    the interface it shares is the same."""
    x = torch.randn(2, 37, device=device)
    with aoti_eager.enabled(["aten::neg", "aten::mul.Tensor"], devices=[device], cache_dir=tmp_path):
        results = [torch.neg(x), torch.mul(x, 0.5), torch.mul(x, 1.5)]
        compiled = sum(aoti_eager.stats()[op]["compiles"] for op in ("aten::neg", "aten::mul.Tensor"))
    for result, expected in zip(results, [-x, x * 0.5, x * 1.5]):
        assert_same_as_eager(result, expected)
    assert compiled == 2
    assert len(shared_objects(tmp_path)) == 1


def op_part_headers(root, suffix=".h.gch"):
    return sorted((root / "private" / "shared").glob(f"*/op-part-*{suffix}"))


def test_the_op_part_has_a_precompiled_header_of_its_own(tmp_path, monkeypatch):
    """Built beside the first compile's parts, then taken by every op's part:
    what the model's header instantiates for parse_device_str is declared
    ahead of it, so each op's part no longer instantiates it."""
    monkeypatch.setenv("AOTI_EAGER_DYNAMIC_SHAPES", "0")
    commands = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda argv, **kw: commands.append(argv) or real_popen(argv, **kw))
    results, expected, stats = compile_abs(tmp_path, 33, 34)
    assert (stats["compiles"], stats["fallbacks"]) == (2, 0)
    for r, e in zip(results, expected):
        assert_same_as_eager(r, e)
    [header] = op_part_headers(tmp_path)
    own = [argv for argv in commands if any(str(t).endswith(".own.cpp") for t in argv)]
    assert len(own) == 2 and str(header)[: -len(".gch")] not in own[0] and str(header)[: -len(".gch")] in own[1]
    assert "extern template class std::__cxx11::basic_regex<char>;" in header.with_suffix("").read_text()
    nm = shutil.which("nm")
    if nm is not None:  # the op's part leaves regex to the shared part, which the library holds
        for library in tmp_path.glob(f"{layout.LAYOUT_VERSION}/*/aten.abs/*/kernel.so"):
            undefined = subprocess.run([nm, "-D", "-u", "-C", str(library)], capture_output=True, text=True, check=True)
            # libstdc++'s own (versioned, e.g. regex_error@GLIBCXX_3.4.15) are found when it loads.
            unresolved = [line for line in undefined.stdout.splitlines() if "@" not in line]
            assert not [line for line in unresolved if "regex" in line or "sub_match" in line], unresolved


def test_an_op_part_header_that_fails_to_build_is_not_tried_again(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_DYNAMIC_SHAPES", "0")
    monkeypatch.setattr(wrapper_split, "_ELSEWHERE", "extern template class std::no_such_template<char>;\n")
    results, expected, stats = compile_abs(tmp_path, 33)
    assert_same_as_eager(results[0], expected[0])
    [failed] = op_part_headers(tmp_path, ".failed")
    assert "no_such_template" in failed.read_text()
    recorded = failed.stat().st_mtime_ns
    results, expected, stats = compile_abs(tmp_path, 34)
    assert_same_as_eager(results[0], expected[0])
    assert op_part_headers(tmp_path) == [] and failed.stat().st_mtime_ns == recorded


def test_one_process_at_a_time_builds_the_op_part_header(tmp_path):
    from filelock import FileLock

    tokens = ["g++", "x.own.cpp", "-include", "/inductor/pch.h", "-O1", "-c", "-o", "x.own.o"]
    header = wrapper_split._OpPartHeader(tokens, "#include <torch/csrc/inductor/aoti_include/cpu.h>", tmp_path)
    assert header.own_command() == tokens  # not built yet: Inductor's header
    killed = tmp_path / f".{header.header.name}.gch.12345.tmp"  # what a killed build left
    killed.write_text("")
    with FileLock(f"{header.header}.lock"):
        header.start(tmp_path)  # another process builds it: this one does not wait
        assert header._build is None and not header.header.exists() and killed.exists()
    header.finish()
    header._build_command = ["sh", "-c", "echo 'cannot write PCH file: No space left on device'; exit 1"]
    header.start(tmp_path)
    header.finish()
    assert not header.header.with_suffix(".failed").exists()  # a full disk may have room next time
    header._build_command = ["false"]  # a build under the lock clears what a killed one left
    header.start(tmp_path)
    assert not killed.exists()
    header.finish()
    assert header.header.with_suffix(".failed").exists()
    # Where it has been built, the next compile's op's part includes it instead of Inductor's.
    header.header.write_text("")
    Path(f"{header.header}.gch").write_text("")
    header = wrapper_split._OpPartHeader(tokens, "#include <torch/csrc/inductor/aoti_include/cpu.h>", tmp_path)
    assert header.own_command() == ["g++", "x.own.cpp", "-include", str(header.header), "-O1", "-c", "-o", "x.own.o"]
