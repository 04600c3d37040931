"""From an op call to an AOTInductor library (aoti_eager.kernels.compile): the
call as the module that is exported, the kernel's inputs, what a failed
compile says, and one real compile, loaded and run against eager."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import CppCompileError

from aoti_eager import _extension
from aoti_eager.cache import KernelCache
from aoti_eager.kernels.inductor import load_probe
from aoti_eager.kernels.compile import (
    CompileError,
    _OpCall,
    call_op,
    compile_call,
    compile_options,
    compiler_error,
    flat_tensor_inputs,
    mutated_arguments,
    return_alias_indices,
    sidecar_files,
    split_arguments,
)
from aoti_eager.kernels.signature import CallSignature, clone_args
from aoti_eager.kernels.toolchain import environment_name, usable_vec_isas
from aoti_eager.kernels.validate import check_matches_eager
from conftest import DEVICES
from helpers import FakeKernel, assert_same_as_eager, xfail_if_kernels_cannot_load

A = torch.ops.aten
CPU = torch.device("cpu")


def test_call_op_passes_keyword_only_arguments_by_name():
    x, y = torch.randn(4), torch.randn(4)
    positional, keywords = split_arguments(A.add.Tensor, [x, y, 2])
    assert len(positional) == 2 and positional[0] is x and positional[1] is y and keywords == {"alpha": 2}
    torch.testing.assert_close(call_op(A.add.Tensor, [x, y, 2]), torch.add(x, y, alpha=2))
    out = torch.empty(4)
    assert call_op(A.abs.out, [x, out]) is out
    torch.testing.assert_close(out, x.abs())


def test_the_kernels_inputs_are_the_calls_tensors_in_schema_order():
    a, b = torch.randn(2, 3), torch.randn(4, 3)
    assert all(t is u for t, u in zip(flat_tensor_inputs(CallSignature.of(A.cat.default, "cpu", [[a, b], 0])), [a, b], strict=True))
    add = CallSignature.of(A.add.Tensor, "cpu", [b, a.sum(0), 0.5])
    inputs = flat_tensor_inputs(add)
    assert inputs[0] is add.args[0] and inputs[1] is add.args[1]
    # A runtime number as the kernel reads it, on the host.
    assert (inputs[2].dtype, inputs[2].device, inputs[2].dim(), inputs[2].item()) == (torch.float64, CPU, 0, 0.5)
    # An int as an int64: the kernel traced it as an integer.
    (end,) = flat_tensor_inputs(CallSignature.of(A.arange.default, "cpu", [7, None, None, CPU, None]).with_runtime_ints([0]))
    assert (end.dtype, end.device, end.dim(), end.item()) == (torch.int64, CPU, 0, 7)
    # An item of an int list in its place: after what comes before the list, before what comes after it.
    pad = CallSignature.of(A.constant_pad_nd.default, "cpu", [a, [0, 5], 0.5]).with_runtime_ints([(1, 1)])
    x, n, value = flat_tensor_inputs(pad)
    assert x is a and (n.dtype, n.item(), value.dtype, value.item()) == (torch.int64, 5, torch.float64, 0.5)
    copies = clone_args(add.args)
    assert flat_tensor_inputs(add, copies)[0] is copies[0]


@pytest.mark.parametrize("op, written, handed_back", [
    (A.abs.default, [], [None]),
    (A.add_.Tensor, ["self"], ["self"]),
    (A.abs.out, ["out"], ["out"]),
    (A.max.dim_max, ["max", "max_values"], ["max", "max_values"]),
    (A._foreach_add_.Scalar, ["self"], []),
])
def test_written_arguments_and_the_returns_that_hand_them_back(op, written, handed_back):
    names = [argument.name for argument in op._schema.arguments]
    assert [names[i] for i in mutated_arguments(op)] == written
    assert [None if i is None else names[i] for i in return_alias_indices(op)] == handed_back


X = torch.linspace(-3, 3, 12).view(4, 3)
CALLS = {
    "abs": (A.abs.default, lambda: [X.t()]),
    "runtime alpha": (A.add.Tensor, lambda: [X, X.t().contiguous().t(), 0.5]),
    "list": (A.cat.default, lambda: [[X, X[:1]], 0]),
    "two returns": (A.max.dim, lambda: [X, 1, True]),
    "list return": (A._foreach_abs.default, lambda: [[X, X.t()]]),
    "out=": (A.abs.out, lambda: [X, torch.zeros(4, 3)]),
    "no return": (A._foreach_add_.Scalar, lambda: [[X.clone(), X.clone()], 2]),
}


@pytest.mark.parametrize("call", CALLS)
def test_the_module_that_is_exported_does_what_eager_does(call):
    op, args = CALLS[call]
    signature = CallSignature.of(op, "cpu", args())
    module = _OpCall(signature)
    for version in (signature, signature.with_other_numbers()):
        reference_args = clone_args(version.args)
        expected = call_op(op, reference_args)
        kernel = FakeKernel(lambda inputs: list(module(*inputs)), module.output_counts(expected))
        check_matches_eager(kernel, version, op, reference_args, expected)


def cpp_compile_error(output: str) -> CppCompileError:
    return CppCompileError(["g++", "kernel.cpp"], output)


def test_compiler_error_is_what_the_compiler_said_errors_first():
    output = "In file included from kernel.h:1,\nkernel.cpp:3:1: error: 'f' was not declared\nkernel.cpp:9: warning: unused\nkernel.cpp:12:5: error: expected ';'\n"
    said = "kernel.cpp:3:1: error: 'f' was not declared | kernel.cpp:12:5: error: expected ';'"
    assert compiler_error(cpp_compile_error(output)) == said
    # However Inductor wraps it.
    wrapped = RuntimeError("lowering failed")
    wrapped.__cause__ = cpp_compile_error(output)
    assert compiler_error(wrapped) == said
    assert compiler_error(BackendCompilerFailed(None, cpp_compile_error(output), None)) == said
    assert compiler_error(cpp_compile_error("line 1\nline 2\n" + "x" * 1000 + "\nline 4")) == "line 1 | line 2 | " + "x" * 240
    assert compiler_error(cpp_compile_error("")) == "no output"
    assert compiler_error(RuntimeError("no compiler involved")) is None


def fail_in(monkeypatch, module, name: str, error: Exception) -> None:
    def fails(*args, **kwargs):
        raise error

    monkeypatch.setattr(module, name, fails)


@pytest.mark.parametrize("stage", ["torch.export", "AOTInductor"])
def test_a_failed_compile_says_where_and_whether_it_may_pass_later(stage, monkeypatch):
    if stage == "torch.export":
        fail_in(monkeypatch, torch.export, "export", RuntimeError("data-dependent control flow"))
        said, lasting = "torch.export failed: RuntimeError: data-dependent control flow", True
    else:
        # The compiler can fail for the machine's reasons (a full disk): a later process tries again.
        fail_in(monkeypatch, torch._inductor, "aot_compile", cpp_compile_error("kernel.cpp:1:1: error: injected"))
        said, lasting = "AOTInductor failed: the C++ compiler said: kernel.cpp:1:1: error: injected", False
    signature = CallSignature.of(A.abs.default, "cpu", [X])
    workdir = tempfile.TemporaryDirectory()
    with pytest.raises(CompileError) as failed:
        compile_call(signature, X.abs(), compile_options("cpu"), workdir=workdir)
    assert str(failed.value) == said and failed.value.lasting == lasting
    assert not Path(workdir.name).exists()


@pytest.fixture(scope="module")
def compiled_add(shared_cache, tmp_path_factory):
    """add.Tensor with a runtime alpha and a transposed operand, compiled as the
    runtime compiles it, and loaded (the one compile of this file)."""
    signature = CallSignature.of(A.add.Tensor, "cpu", [torch.randn(8, 5), torch.randn(5, 8).t(), 0.5])
    options = compile_options("cpu")
    artifact = compile_call(
        signature, call_op(A.add.Tensor, clone_args(signature.args)), options,
        shared_dir=KernelCache(shared_cache, environment_name(CPU, options)).shared_directory(), vec_isas=usable_vec_isas(),
    )
    yield signature, artifact, tmp_path_factory.mktemp("environment")
    artifact.workdir.cleanup()


def test_a_compile_does_not_build_inductors_whole_graph_pattern_tables(shared_cache, monkeypatch):
    """Building them was 0.5 s of a process's first compile; they are Inductor's
    again after it, for a torch.compile."""
    from torch._inductor.fx_passes import joint_graph, post_grad

    built = []
    for module in (joint_graph, post_grad):
        monkeypatch.setattr(module, "lazy_init", lambda *args, name=module.__name__: built.append(name))
    recorders = (joint_graph.lazy_init, post_grad.lazy_init)
    signature = CallSignature.of(A.abs.default, "cpu", [torch.randn(43)])
    options = compile_options("cpu")
    artifact = compile_call(
        signature, signature.args[0].abs(), options,
        shared_dir=KernelCache(shared_cache, environment_name(CPU, options)).shared_directory(), vec_isas=usable_vec_isas(),
    )
    artifact.workdir.cleanup()
    assert built == []
    assert (joint_graph.lazy_init, post_grad.lazy_init) == recorders


def test_where_the_faster_linker_fails_the_library_is_linked_as_inductor_links_it(shared_cache, swap_toolchain):
    signature = CallSignature.of(A.abs.default, "cpu", [torch.randn(37)])
    options = compile_options("cpu")
    shared_dir = KernelCache(shared_cache, environment_name(CPU, options)).shared_directory()
    swap_toolchain(linker=lambda: "no-such-linker")  # the environment's own linker fails
    artifact = compile_call(signature, signature.args[0].abs(), options, shared_dir=shared_dir, vec_isas=usable_vec_isas())
    try:
        assert artifact.library.exists() and "link" in artifact.seconds
    finally:
        artifact.workdir.cleanup()


def test_a_compiled_kernel_does_what_eager_does_for_any_runtime_number(compiled_add):
    signature, artifact, environment = compiled_add
    assert artifact.output_counts == [-1] and sidecar_files(artifact)["kernel.so"] == artifact.library
    assert {"export", "lowering"} <= artifact.seconds.keys()
    try:
        load_probe.check_loads(environment.name, artifact.library, "cpu", artifact.output_counts, known_good=False)
    except load_probe.LibraryDoesNotLoad as e:
        xfail_if_kernels_cannot_load({"fallback_reason": str(e)})
        raise
    kernel = _extension.load().CompiledKernel(str(artifact.library), "cpu", artifact.output_counts, signature.runtime_arguments)
    for call in (signature, signature.with_other_numbers()):
        (result,) = kernel.run(flat_tensor_inputs(call))
        assert_same_as_eager(result, call_op(A.add.Tensor, call.args))


# Calls whose outputs Inductor's own decompositions lay out otherwise than
# eager: a KV cache's first keys (``cat`` of one non-empty tensor is its
# ``clone``, in the input's layout), ``stack`` and batch norm of transposed
# inputs (eager returns them contiguous).
EAGER_LAYOUTS = {
    "cat of a KV cache": (A.cat.default, lambda d: [[torch.tensor([], device=d), torch.randn(1, 6, 3, 4, device=d).transpose(1, 2)], -2]),
    "stack of transposed": (A.stack.default, lambda d: [[torch.randn(6, 5, device=d).t(), torch.randn(6, 5, device=d).t()]]),
    "batch norm of transposed": (
        A.native_batch_norm.default,
        lambda d: [torch.randn(4, 6, 5, device=d).transpose(1, 2), torch.randn(5, device=d), None, None, None, True, 0.1, 1e-5],
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("call", EAGER_LAYOUTS)
def test_a_kernels_outputs_have_eagers_strides(call, device, shared_cache):
    op, args = EAGER_LAYOUTS[call]
    signature = CallSignature.of(op, device, args(device)).with_constant_numbers()  # batch norm's momentum cannot be traced
    reference_args = clone_args(signature.args)
    expected = call_op(op, reference_args)
    options = compile_options(device)
    environment = environment_name(torch.device(device), options)
    artifact = compile_call(
        signature, expected, options, shared_dir=KernelCache(shared_cache, environment).shared_directory(), vec_isas=usable_vec_isas(),
    )
    try:
        load_probe.check_loads(environment, artifact.library, device, artifact.output_counts, known_good=False)
        kernel = _extension.load().CompiledKernel(str(artifact.library), device, artifact.output_counts, signature.runtime_arguments)
        check_matches_eager(kernel, signature, op, reference_args, expected)  # strides included
        results = kernel.run(flat_tensor_inputs(signature))
        assert_same_as_eager(results if isinstance(expected, tuple) else results[0], expected)
    except load_probe.LibraryDoesNotLoad as e:
        xfail_if_kernels_cannot_load({"fallback_reason": str(e)})
        raise
    finally:
        artifact.workdir.cleanup()


class _Branching(torch.nn.Module):
    def __init__(self, k: float):
        super().__init__()
        self.k = k

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x * self.k, lambda x: x - self.k, (x,))


def test_a_programs_digest_holds_its_subgraphs_and_constants():
    """Two programs of one digest share a library: they differ nowhere, not in a cond's branch either."""
    from aoti_eager.kernels.compile import graph_digest

    x = torch.randn(4)

    def digest(k):
        return graph_digest(torch.export.export(_Branching(k), (x,), strict=False), (x,), {})

    assert digest(2.0) == digest(2.0) != digest(3.0)
    assert graph_digest(torch.export.export(_Branching(2.0), (x,), strict=False), (x.double(),), {}) != digest(2.0)
