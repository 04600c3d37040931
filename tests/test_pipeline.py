"""kernels/pipeline.py: one signature from eager's reference result to a
published entry, and each way it ends without a kernel."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from aoti_eager import _extension
from aoti_eager.cache import KernelCache
from aoti_eager.cache.store import LIBRARY_FILE
from aoti_eager.kernels import CallSignature, CompileError, pipeline
from aoti_eager.kernels.compile import Artifact, compile_call, compile_options, flat_tensor_inputs
from aoti_eager.kernels.signature import qualified_name
from aoti_eager.kernels.speed import Timing
from aoti_eager.kernels.toolchain import environment_name
from helpers import fake_artifact

A = torch.ops.aten
NAME = "aten::abs"


@pytest.fixture
def store(tmp_path) -> KernelCache:
    return KernelCache(tmp_path, environment_name(torch.device("cpu"), compile_options("cpu")))


def load(signature: CallSignature):
    def loader(library: Path, output_counts: list[int]):
        return _extension.load().CompiledKernel(str(library), "cpu", output_counts, signature.runtime_arguments)
    return loader


def abs_signature(size: int = 16) -> CallSignature:
    return CallSignature.of(A.abs.default, "cpu", [torch.randn(size)])


class Negated:
    """A kernel that runs, but not as eager does."""

    output_counts = [-1]

    def run(self, inputs):
        return [-inputs[0].abs()]


def test_a_kernel_is_validated_and_published(store):
    signature = abs_signature()
    outcome = pipeline.compile_signature(A.abs.default, signature, store, load(signature))
    assert isinstance(outcome, pipeline.Published)
    assert outcome.seconds > 0 and {"export", "load"} <= set(outcome.stages)
    entry = store.lookup(NAME, signature.key)
    assert entry.library is not None and entry.output_counts == [-1] and entry.reason is None
    kernel = load(signature)(entry.library, entry.output_counts)
    (x,) = flat_tensor_inputs(signature)
    torch.testing.assert_close(kernel.run([x])[0], x.abs(), atol=0, rtol=0)


def test_eagers_own_error_is_not_recorded(store, swap_compiler):
    swap_compiler(compile=lambda *a, **k: pytest.fail("must not compile a call eager rejects"))
    signature = CallSignature.of(A.mm.default, "cpu", [torch.randn(2, 3), torch.randn(4, 5)])
    outcome = pipeline.compile_signature(A.mm.default, signature, store, load(signature))
    assert outcome == pipeline.NotCompiled("eager raised RuntimeError", eager_raised=True)
    assert list(store.entries()) == []


def test_a_kernel_that_disagrees_with_eager_is_recorded_eager(store, tmp_path, swap_compiler):
    swap_compiler(compile=fake_artifact(tmp_path))
    signature = abs_signature()
    outcome = pipeline.compile_signature(A.abs.default, signature, store, lambda library, counts: Negated())
    assert isinstance(outcome, pipeline.NotCompiled) and outcome.recorded
    assert outcome.reason.startswith("compiled kernel disagrees with eager: return 0")
    entry = store.lookup(NAME, signature.key)
    assert entry.library is None and entry.reason == outcome.reason


def test_a_kernel_that_fails_to_load_is_recorded_eager(store, tmp_path, swap_compiler):
    swap_compiler(compile=fake_artifact(tmp_path))
    signature = abs_signature()

    def does_not_load(library, counts):
        raise RuntimeError("undefined symbol")

    outcome = pipeline.compile_signature(A.abs.default, signature, store, does_not_load)
    assert outcome == pipeline.NotCompiled("compiled kernel failed to run: RuntimeError: undefined symbol", recorded=True)
    assert store.lookup(NAME, signature.key).library is None


def test_a_lasting_compile_error_is_recorded_and_a_compilers_is_not(store, swap_compiler):
    signature = abs_signature()
    swap_compiler(compile=lambda *a, **k: (_ for _ in ()).throw(CompileError("torch.export failed: X")))
    assert pipeline.compile_signature(A.abs.default, signature, store, load(signature)) == pipeline.NotCompiled(
        "torch.export failed: X", recorded=True
    )
    assert store.remove(NAME, signature.key)

    said = "kernel.cpp:1: error: no space left"
    swap_compiler(compile=lambda *a, **k: (_ for _ in ()).throw(CompileError("AOTInductor failed", said)))
    outcome = pipeline.compile_signature(A.abs.default, signature, store, load(signature))
    assert outcome.compiler_error == said and not outcome.recorded
    assert list(store.entries()) == []


@pytest.mark.parametrize("timings, kept", [
    ([Timing(0.5e-6, 1e-6)], False),
    ([Timing(1e-3, 2e-3), Timing(1e-3, 2e-3)], True),
    ([Timing(1e-3, 2e-3), Timing(1.95e-3, 2e-3)], False),
], ids=["faster by microseconds", "clearly faster twice", "clearly faster once"])
def test_a_kernel_that_only_calls_eagers_kernels_is_kept_where_clearly_faster_twice(store, monkeypatch, timings, kept):
    # mm's library calls eager's matmul: only its outputs' memory (the CPU pool's) can make it faster.
    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "1")
    measured = iter(timings)
    signature = CallSignature.of(A.mm.default, "cpu", [torch.randn(4, 8), torch.randn(8, 3)])
    outcome = pipeline.compile_signature(A.mm.default, signature, store, load(signature), timer=lambda *a: next(measured))
    assert isinstance(outcome, pipeline.Published)
    assert next(measured, None) is None  # each timing was taken
    entry = store.lookup("aten::mm", signature.key)
    assert (entry.library is not None) == kept, entry.reason
    if not kept:
        assert entry.reason.startswith("eager is faster: Inductor generated no kernel of its own"), entry.reason


def test_on_cuda_a_kernel_that_only_calls_eagers_kernels_keeps_eager_however_fast():
    # The caching allocator serves eager's outputs as it does the kernel's: the runner only adds.
    extern_only = Artifact(Path("kernel.so"), [1], generated_kernels=0)
    clearly = Timing(1e-3, 2e-3)
    assert pipeline.speed_verdict(clearly, extern_only, torch.device("cpu")) is None
    assert pipeline.speed_verdict(clearly, extern_only, torch.device("cuda")).startswith("eager is faster: Inductor generated no kernel")


@pytest.mark.parametrize("second, kept", [(1.5e-6, False), (0.99e-6, True)], ids=["slower twice", "slower once"])
def test_eager_is_kept_only_where_the_kernel_is_slower_twice(store, tmp_path, monkeypatch, second, kept, swap_compiler):
    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "1")
    swap_compiler(compile=fake_artifact(tmp_path))
    measured = iter([Timing(2e-6, 1e-6), Timing(second, 1e-6)])
    swap_compiler(timer=lambda *a: next(measured))
    swap_compiler(check=lambda *a: None)
    signature = abs_signature()
    outcome = pipeline.compile_signature(A.abs.default, signature, store, lambda library, counts: Negated())
    assert isinstance(outcome, pipeline.Published)
    entry = store.lookup(NAME, signature.key)
    assert entry.timing["ratio"] == round(second / 1e-6, 3)  # the kernel's better showing
    assert (entry.library is not None) == kept
    if not kept:
        assert entry.reason == "eager is faster: kernel 1.50x eager's time (measured at compile)"
        assert not any(tmp_path.rglob(LIBRARY_FILE))  # the workdir is gone, and no library was published


def test_a_compiler_given_to_one_compile_serves_that_compile_alone(store):
    signature = abs_signature()
    refused = pipeline.Compiler(compile=lambda *a, **k: (_ for _ in ()).throw(CompileError("torch.export failed: X")))
    outcome = pipeline.compile_signature(A.abs.default, signature, store, load(signature), compiler=refused)
    assert outcome == pipeline.NotCompiled("torch.export failed: X", recorded=True)
    assert pipeline.current() == pipeline.Compiler() and pipeline.current().compile is compile_call


def test_a_scope_holds_in_every_thread_and_ends_with_its_block():
    seen = []
    with pytest.raises(RuntimeError), pipeline.scope(timer=len):
        thread = threading.Thread(target=lambda: seen.append(pipeline.current().timer))
        thread.start()
        thread.join()
        raise RuntimeError("the block fails")
    assert seen == [len] and pipeline.current() == pipeline.Compiler()


def test_a_dynamic_kernels_checks_resize_symbols_of_one_size_together():
    """A KV cache's keys and values have one length in every call: a check
    at size 1 of one is at size 1 of both (eager's flash attention reads
    past keys shorter than their values); a batch that moved apart stays apart."""
    seen = [{0: 8, 1: 8, 2: 3}, {0: 9, 1: 9, 2: 3}, {0: 12, 1: 12, 2: 5}]
    assert pipeline._tied(seen) == {0: [0, 1], 1: [0, 1], 2: [2]}
    assert pipeline._tied([{0: 8, 1: 8}, {0: 9, 1: 10}]) == {0: [0], 1: [1]}
