"""The miss path and the hit path: fallbacks, recursion, threads, autograd."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest
import torch
from torch._dispatch.python import enable_python_dispatcher

import aoti_eager
from aoti_eager import _overrides
from aoti_eager.cache import KernelCache, UntrustedEntry
from aoti_eager.kernels import CompileError, pipeline
from aoti_eager.kernels.inductor import load_probe
from aoti_eager.kernels.signature import CallSignature
from conftest import DEVICES
from helpers import assert_same_as_eager

A = torch.ops.aten


def test_failed_compile_falls_back_once_and_is_remembered(tmp_path, swap_compiler, caplog):
    attempts = []

    def failing_compile(signature, *args, **kwargs):
        attempts.append(signature.short())
        raise CompileError("AOTInductor failed: RuntimeError: injected")

    swap_compiler(compile=failing_compile)
    x = torch.randn(16)
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path)
        results = [torch.abs(x) for _ in range(3)]
    stats = aoti_eager.stats()["aten::abs"]
    aoti_eager.disable()
    for r in results:
        assert_same_as_eager(r, x.abs())
    assert len(attempts) == 1
    assert (stats["hits"], stats["fallbacks"], stats["compiles"]) == (0, 3, 0)
    assert "injected" in stats["fallback_reason"]
    assert sum("injected" in r.message for r in caplog.records) == 1

    # The decision is in the cache: a new enable (as a new process would) does
    # not try again.
    aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path)
    y = torch.abs(x)
    aoti_eager.disable()
    assert_same_as_eager(y, x.abs())
    assert len(attempts) == 1


def test_an_eager_call_does_not_compile_the_overloads_its_kernel_calls(tmp_path, swap_compiler):
    # abs.default's CPU kernel calls abs.out through the dispatcher: with the
    # whole packet enabled, that inner call is part of the eager call, not a
    # user call of abs.out to key and compile.
    compile_call = pipeline.compile_call

    def abs_default_fails(signature, *args, **kwargs):
        if signature.op == A.abs.default:
            raise CompileError("AOTInductor failed: RuntimeError: injected")
        return compile_call(signature, *args, **kwargs)

    swap_compiler(compile=abs_default_fails)
    x = torch.randn(16)
    aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=tmp_path)
    results = [torch.abs(x) for _ in range(2)]
    stats = aoti_eager.stats()
    aoti_eager.disable()
    for r in results:
        assert_same_as_eager(r, x.abs())
    assert (stats["aten::abs"]["calls"], stats["aten::abs"]["fallbacks"]) == (2, 2)
    assert stats["aten::abs.out"]["calls"] == 0
    assert stats["aten::abs.out"]["compiles"] == 0


def test_a_failed_cpp_compiler_is_not_recorded_in_the_cache(tmp_path, swap_compiler):
    attempts = []

    def compiler_fails(signature, *args, **kwargs):
        attempts.append(signature.short())
        raise CompileError("AOTInductor failed: the C++ compiler said: error: injected", compiler_error="error: injected")

    swap_compiler(compile=compiler_fails)
    x = torch.randn(16)
    for _ in range(2):  # two processes, as far as the cache can tell
        aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path)
        results = [torch.abs(x) for _ in range(2)]
        aoti_eager.disable()
        _overrides.forget()
        for r in results:
            assert_same_as_eager(r, x.abs())
    assert len(attempts) == 2  # once per process: the failure may have been the machine's


def test_a_runtime_that_crashes_on_load_leaves_kernels_eager(tmp_path, load_verdicts, monkeypatch):
    monkeypatch.setattr(load_probe, "_CHILD", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    x = torch.randn(32)
    aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path)
    results = [torch.abs(x) for _ in range(2)]
    stats = aoti_eager.stats()["aten::abs"]
    aoti_eager.disable()
    for r in results:
        assert_same_as_eager(r, x.abs())
    assert stats["hits"] == 0 and stats["fallbacks"] == 2
    assert "crashed a test process" in stats["fallback_reason"] and "signal 11" in stats["fallback_reason"]


def test_untrusted_cache_entry_runs_eagerly(tmp_path, monkeypatch, swap_compiler):
    def untrusted(self, op, key, copy_as=None):
        raise UntrustedEntry(f"{self.directory} is writable by group or others (mode 775)")

    monkeypatch.setattr(KernelCache, "lookup", untrusted)
    swap_compiler(compile=lambda *a, **k: pytest.fail("must not compile"))
    x = torch.randn(8)
    aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path)
    y = torch.abs(x)
    stats = aoti_eager.stats()["aten::abs"]
    aoti_eager.disable()
    assert_same_as_eager(y, x.abs())
    assert "refused an untrusted cache entry" in stats["fallback_reason"]


def test_waiting_on_another_process_compile_times_out_to_eager(tmp_path, monkeypatch, swap_compiler):
    monkeypatch.setenv("AOTI_EAGER_LOCK_TIMEOUT", "0.2")
    swap_compiler(compile=lambda *a, **k: pytest.fail("must not compile without the lock"))
    x = torch.randn(8)
    aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path)
    override = _overrides.installed()[0]
    key = CallSignature.of(torch.ops.aten.abs.default, "cpu", [x]).key
    with override.cache(torch.device("cpu")).signature_lock("aten::abs", key):  # as if another process were compiling it
        ys = [torch.abs(x) for _ in range(2)]
    stats = aoti_eager.stats()["aten::abs"]
    aoti_eager.disable()
    for y in ys:
        assert_same_as_eager(y, x.abs())
    # Not remembered as eager: each call asks again until the lock is free.
    assert (stats["misses"], stats["fallbacks"], stats["compiles"]) == (2, 2, 0), stats


def test_another_signature_of_the_op_compiles_while_one_is_compiling(tmp_path, monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_LOCK_TIMEOUT", "1")
    x, other = torch.randn(8), torch.randn(9)
    aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path)
    cache = _overrides.installed()[0].cache(torch.device("cpu"))
    with cache.lock_signature("aten::abs", CallSignature.of(torch.ops.aten.abs.default, "cpu", [x]).key):
        y = torch.abs(other)
    stats = aoti_eager.stats()["aten::abs"]
    aoti_eager.disable()
    assert_same_as_eager(y, other.abs())
    assert (stats["compiles"], stats["fallbacks"]) == (1, 0), stats


def test_new_scalar_values_stop_compiling_past_the_limit(tmp_path, monkeypatch, caplog, swap_compiler):
    attempts = []

    def failing_compile(signature, *args, **kwargs):
        attempts.append(signature.short())
        raise CompileError("AOTInductor failed: RuntimeError: injected")

    monkeypatch.setenv("AOTI_EAGER_MAX_VALUE_VARIANTS", "2")
    swap_compiler(compile=failing_compile)
    x = torch.randn(8)
    aoti_eager.enable(["aten::mul.Tensor"], devices=["cpu"], cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        # Integers: a kernel's integer math depends on them, so values are compiled in.
        results = [torch.mul(x, s) for s in (2, 3, 4, 5, 2)]
        torch.mul(x, x)  # another shape of signature: not limited by the numbers' variants
    stats = aoti_eager.stats()["aten::mul.Tensor"]
    aoti_eager.disable()
    for r, s in zip(results, (2, 3, 4, 5, 2)):
        assert_same_as_eager(r, x * s)
    assert len(attempts) == 3, attempts  # 2, 3, then x * x; 4 and 5 hit the limit
    assert stats["fallbacks"] == 6 and stats["hits"] == 0
    assert sum("AOTI_EAGER_MAX_VALUE_VARIANTS" in r.message for r in caplog.records) == 1


def _failing_compiles(swap_compiler) -> list[str]:
    """Makes every compile fail (at once); the signatures tried."""
    attempts = []

    def failing_compile(signature, *args, **kwargs):
        attempts.append(signature.short())
        raise CompileError("AOTInductor failed: RuntimeError: injected")

    swap_compiler(compile=failing_compile)
    return attempts


def test_a_compile_limit_on_numbers_is_recorded_for_a_new_process(tmp_path, monkeypatch, swap_compiler):
    monkeypatch.setenv("AOTI_EAGER_MAX_VALUE_VARIANTS", "2")
    attempts = _failing_compiles(swap_compiler)
    x = torch.randn(8)
    with aoti_eager.enabled(["aten::mul.Tensor"], devices=["cpu"], cache_dir=tmp_path):
        [torch.mul(x, s) for s in (2, 3, 4)]
    assert len(attempts) == 2
    _overrides.forget()  # a new process, as far as the cache can tell
    with aoti_eager.enabled(["aten::mul.Tensor"], devices=["cpu"], cache_dir=tmp_path):
        results = [torch.mul(x, s) for s in (5, 6)]
        stats = aoti_eager.stats()["aten::mul.Tensor"]
    for r, s in zip(results, (5, 6)):
        assert_same_as_eager(r, x * s)
    assert len(attempts) == 2, attempts
    assert stats["fallbacks"] == 2 and "AOTI_EAGER_MAX_VALUE_VARIANTS=2" in stats["fallback_reason"], stats


def test_a_compile_limit_on_shapes_is_recorded_for_a_new_process(tmp_path, monkeypatch, swap_compiler):
    monkeypatch.setenv("AOTI_EAGER_MAX_SHAPE_COMPILES", "1")
    monkeypatch.setenv("AOTI_EAGER_DYNAMIC_SHAPES", "0")
    attempts = _failing_compiles(swap_compiler)
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
        [torch.abs(torch.randn(n)) for n in (4, 6)]
    assert len(attempts) == 1
    _overrides.forget()
    xs = [torch.randn(n) for n in (8, 10)]
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
        results = [torch.abs(x) for x in xs]
        stats = aoti_eager.stats()["aten::abs"]
    for r, x in zip(results, xs):
        assert_same_as_eager(r, x.abs())
    assert len(attempts) == 1, attempts
    # The family is eager as a whole: 10 does not ask Python again.
    assert stats["misses"] == 1 and stats["fallbacks"] == 2, stats
    assert "AOTI_EAGER_MAX_SHAPE_COMPILES=1" in stats["fallback_reason"]


def test_an_op_enabled_again_says_why_its_calls_run_eagerly(tmp_path, swap_compiler):
    # The second block's call runs the first block's decision straight from C++, without a miss.
    _failing_compiles(swap_compiler)
    x = torch.randn(16)
    for _ in range(2):
        with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
            result = torch.abs(x)
            stats = aoti_eager.stats()["aten::abs"]
        assert_same_as_eager(result, x.abs())
        assert stats["fallbacks"] == 1 and "injected" in (stats["fallback_reason"] or ""), stats
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
        stats = aoti_eager.stats()["aten::abs"]
    assert stats["fallbacks"] == 0 and stats["fallback_reason"] is None, stats  # no call ran eagerly in this block


def test_numbers_decided_eager_for_every_value_say_why_in_a_later_block_and_process(tmp_path, swap_compiler):
    # An eager decision for every value of a runtime number: a new value is
    # served from C++ without a miss, in this block and the next; a new
    # process reads it in the cache and compiles nothing.
    attempts = []

    def proxy_only(signature, *args, **kwargs):
        attempts.append(signature.short())
        raise CompileError("AOTInductor leaves aten::mul.Tensor to its proxy executor (injected)", any_values=True)

    swap_compiler(compile=proxy_only)
    x = torch.randn(8)
    for s in (2.0, 3.0, 4.0):
        if s == 4.0:
            _overrides.forget()  # a new process, as far as the cache can tell
        with aoti_eager.enabled(["aten::mul.Tensor"], devices=["cpu"], cache_dir=tmp_path):
            result = torch.mul(x, s)
            stats = aoti_eager.stats()["aten::mul.Tensor"]
        assert_same_as_eager(result, x * s)
        assert stats["fallbacks"] == 1 and "proxy executor (injected)" in (stats["fallback_reason"] or ""), stats
    assert len(attempts) == 1, attempts


@pytest.mark.parametrize("device", DEVICES)
def test_float_arguments_are_kernel_inputs_not_recompiles(shared_cache, device):
    x, g = torch.randn(32, 32, device=device), torch.randn(32, 32, device=device)
    # Fractions on purpose: on CUDA a launch parameter typed as an int once made 3.7 a 3.
    scales = [(-1) ** i * (i + 0.37) / 3 for i in range(17)] + [1e6, -2.5e-7, 0.5]
    rates = [0.1 * 0.9**i for i in range(20)]
    p = x.clone()
    with aoti_eager.enabled(["aten::mul.Tensor", "aten::add_.Tensor"], devices=[device], cache_dir=shared_cache):
        products = [torch.mul(x, s) for s in scales]
        for lr in rates:
            p.add_(g, alpha=-lr)  # an optimizer step with a decaying learning rate
        stats = aoti_eager.stats()
    for product, s in zip(products, scales):
        assert_same_as_eager(product, x * s)
    expected = x.clone()
    for lr in rates:
        expected.add_(g, alpha=-lr)
    assert_same_as_eager(p, expected)
    for op, calls in (("aten::mul.Tensor", len(scales)), ("aten::add_.Tensor", len(rates))):
        assert stats[op]["compiles"] + stats[op]["cache_loads"] == 1, stats[op]
        assert stats[op]["fallbacks"] == 0 and stats[op]["fallback_reason"] is None, stats[op]
        assert stats[op]["calls"] == calls


def test_many_values_of_a_runtime_number_keep_the_call_table_bounded(shared_cache):
    x = torch.randn(32, 32)  # the signature of the test above: its kernel serves here
    scales = [1.0 + i / 5000 for i in range(5000)]
    with aoti_eager.enabled(["aten::mul.Tensor"], devices=["cpu"], cache_dir=shared_cache):
        products = [torch.mul(x, s) for s in scales]
        (override,) = [o for o in _overrides.installed() if o.op == A.mul.Tensor]
        entries = override.handle.num_entries
        stats = aoti_eager.stats()["aten::mul.Tensor"]
    for i in (0, 4095, 4096, 4999):
        assert_same_as_eager(products[i], x * scales[i])
    assert 0 < entries <= 4096
    assert stats["compiles"] + stats["cache_loads"] == 1 and stats["fallbacks"] == 0, stats


def test_a_cleared_override_misses_again_though_its_calls_were_hot(shared_cache):
    # A hit reads its decision from the override's hot entries, without the table's lock.
    x = torch.randn(16)
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=shared_cache):
        torch.abs(x), torch.abs(x)
        (override,) = [o for o in _overrides.installed() if o.op == A.abs.default]
        before = override.handle.counters()
        override.handle.clear()
        result = torch.abs(x)
        after = override.handle.counters()
    assert_same_as_eager(result, x.abs())
    assert before["hits"] >= 1 and after["misses"] == before["misses"] + 1, (before, after)
    assert after["calls"] == before["calls"] + 1


def test_eagers_own_error_reaches_the_caller(tmp_path, swap_compiler):
    swap_compiler(compile=lambda *a, **k: pytest.fail("must not compile a failing call"))
    a, b = torch.randn(3), torch.randn(4)
    with pytest.raises(RuntimeError) as eager_error:
        torch.add(a, b)
    aoti_eager.enable(["aten::add.Tensor"], devices=["cpu"], cache_dir=tmp_path)
    for _ in range(2):
        with pytest.raises(RuntimeError) as error:
            torch.add(a, b)
        assert str(error.value) == str(eager_error.value)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(4, 4).to_sparse(),
        lambda: torch.randn(4, 4, device="meta"),
        lambda: torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
    ],
    ids=["sparse", "meta", "quantized"],
)
def test_inputs_that_never_reach_the_override_run_eagerly(make, tmp_path, swap_compiler):
    swap_compiler(compile=lambda *a, **k: pytest.fail("must not compile"))
    x = make()
    expected = torch.abs(x) if not x.is_quantized else None
    aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=tmp_path)
    if x.is_quantized:
        with pytest.raises(NotImplementedError):
            torch.abs(x)
        return
    got = torch.abs(x)
    if x.is_meta:
        assert got.shape == expected.shape and got.is_meta
    else:
        assert_same_as_eager(got.to_dense(), expected.to_dense())


def test_tensor_subclass_keeps_its_type(shared_cache):
    class Tagged(torch.Tensor):
        pass

    x = torch.randn(128).as_subclass(Tagged)
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=shared_cache):
        y = torch.abs(x)
    assert type(y) is Tagged
    assert_same_as_eager(y.as_subclass(torch.Tensor), x.as_subclass(torch.Tensor).abs())


def test_compiling_never_recurses_into_overrides(tmp_path):
    # The compile pipeline itself calls these ops on real tensors (copies for
    # validation, constants, ...): those calls must reach the original kernels.
    aoti_eager.enable(["aten::clone", "aten::add", "aten::mul", "aten::abs"], devices=["cpu"], cache_dir=tmp_path)
    x = torch.randn(32)
    y = torch.abs(x)
    y = torch.abs(x)
    stats = aoti_eager.stats()
    aoti_eager.disable()
    assert_same_as_eager(y, x.abs())
    assert stats["aten::abs"]["compiles"] == 1 and stats["aten::abs"]["hits"] == 1
    assert all(row["calls"] == 0 for name, row in stats.items() if name != "aten::abs"), stats


# Calls traced under the Python dispatcher while argv[2] is overridden, then
# after disable(), as export traces its own torch.clone of the RNG state.
TRACED_CALLS_AFTER_DISABLE = """
import sys, torch, aoti_eager
from aoti_eager import _overrides
from torch._dispatch.python import enable_python_dispatcher
def traced_calls():
    with enable_python_dispatcher():
        torch.empty(4).copy_(torch.clone(torch.randn(4)))
with aoti_eager.enabled([sys.argv[2]], devices=["cpu"], cache_dir=sys.argv[1]), _overrides.misses_held_back():
    traced_calls()
traced_calls()
"""


@pytest.mark.parametrize("op", ["aten::clone", "aten::copy_"])
def test_a_traced_call_after_disable_reaches_the_original_kernel(op, tmp_path):
    # Neither op has a CPU kernel but the override: the Python dispatcher kept
    # the override's key for it, and after disable() called that key's kernel,
    # none (SIGSEGV in the next compile's export). In a child: it would kill pytest.
    child = subprocess.run([sys.executable, "-c", TRACED_CALLS_AFTER_DISABLE, str(tmp_path), op], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, f"exit code {child.returncode}: {child.stderr[-3000:]}"


def test_an_op_enabled_after_a_traced_call_is_overridden_there_too(tmp_path):
    x = torch.randn(4)
    with enable_python_dispatcher():
        torch.clone(x)  # resolves clone's CPU key to CompositeExplicitAutograd's kernel
    with aoti_eager.enabled(["aten::clone"], devices=["cpu"], cache_dir=tmp_path), _overrides.misses_held_back():
        with enable_python_dispatcher():
            torch.clone(x)
        stats = aoti_eager.stats()["aten::clone"]
    assert stats["calls"] == 1, stats


def test_concurrent_calls_from_threads(shared_cache):
    x = torch.randn(64, 64)
    y = torch.randn(64, 64)
    expected = torch.add(x, y, alpha=2)
    results, errors = [], []

    def work():
        try:
            for _ in range(50):
                results.append(torch.add(x, y, alpha=2))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=shared_cache):
        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = aoti_eager.stats()["aten::add.Tensor"]
    assert not errors
    assert len(results) == 400
    for r in results:
        assert_same_as_eager(r, expected)
    assert stats["compiles"] + stats["cache_loads"] == 1
    assert stats["hits"] >= 399 - 7  # every thread may miss once before the decision lands


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, w, b: torch.nn.functional.gelu(x, approximate="tanh").sum(),
        lambda x, w, b: torch.nn.functional.layer_norm(x, [16], w, b).pow(2).sum(),
        lambda x, w, b: (x * w).sum(),
    ],
    ids=["gelu", "layer_norm", "mul"],
)
def test_autograd_matches_eager(fn, shared_cache):
    def run():
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).requires_grad_()
        w = torch.randn(16, generator=torch.Generator().manual_seed(1)).requires_grad_()
        b = torch.randn(16, generator=torch.Generator().manual_seed(2)).requires_grad_()
        out = fn(x, w, b)
        out.backward()
        return out.detach(), x.grad, w.grad, b.grad

    expected = run()
    with aoti_eager.enabled(["aten::gelu", "aten::native_layer_norm", "aten::mul.Tensor"], devices=["cpu"], cache_dir=shared_cache):
        run()
        got = run()
        stats = aoti_eager.stats()
    for g, e in zip(got, expected):
        if e is None:
            assert g is None
        else:
            assert_same_as_eager(g, e)
    assert sum(row["hits"] for row in stats.values()) >= 1


def test_an_override_of_the_op_that_makes_runtime_numbers_does_not_call_itself(shared_cache):
    # The C++ hit path passes a float to the kernel as a 0-d tensor, which it
    # makes with aten::scalar_tensor: that call must reach the original kernel.
    values = (0.5, 0.5, 0.25)
    with aoti_eager.enabled(["aten::scalar_tensor"], devices=["cpu"], cache_dir=shared_cache):
        results = [torch.scalar_tensor(v) for v in values]
        stats = aoti_eager.stats()["aten::scalar_tensor"]
    for result, value in zip(results, values):
        assert_same_as_eager(result, torch.scalar_tensor(value))
    # 0.25 is a hit too: the kernel's key leaves its runtime number's value out.
    assert (stats["compiles"] + stats["cache_loads"], stats["hits"], stats["fallbacks"]) == (1, 2, 0), stats


# Ops of the C++ signatures that get an unboxed override (csrc/op_override.cpp:
# register_override), called as the dispatcher passes them unboxed (torch.*,
# Tensor methods) and boxed (torch.ops). A float alpha is a runtime number.
UNBOXED_CALLS = {
    "abs": ("aten::abs.default", lambda x, y, out: torch.abs(x)),
    "mul": ("aten::mul.Tensor", lambda x, y, out: torch.mul(x, y)),
    "mul, boxed": ("aten::mul.Tensor", lambda x, y, out: A.mul.Tensor(x, y)),
    "mul scalar": ("aten::mul.Scalar", lambda x, y, out: A.mul.Scalar(x, 3)),
    "add alpha=2": ("aten::add.Tensor", lambda x, y, out: torch.add(x, y, alpha=2)),
    "add alpha=0.5": ("aten::add.Tensor", lambda x, y, out: torch.add(x, y, alpha=0.5)),
    "abs_": ("aten::abs_", lambda x, y, out: x.abs_()),
    "mul_": ("aten::mul_.Tensor", lambda x, y, out: x.mul_(y)),
    "mul_ scalar": ("aten::mul_.Scalar", lambda x, y, out: A.mul_.Scalar(x, 3)),
    "add_ alpha=-0.1": ("aten::add_.Tensor", lambda x, y, out: x.add_(y, alpha=-0.1)),
    "abs out": ("aten::abs.out", lambda x, y, out: torch.abs(x, out=out)),
    "mul out": ("aten::mul.out", lambda x, y, out: torch.mul(x, y, out=out)),
    "add out": ("aten::add.out", lambda x, y, out: torch.add(x, y, alpha=3, out=out)),
}


@pytest.mark.parametrize("case", list(UNBOXED_CALLS))
def test_unboxed_overrides_match_eager_and_return_the_written_argument(case, shared_cache):
    op, fn = UNBOXED_CALLS[case]
    x, y = torch.randn(16, 8), torch.randn(16, 8)

    def call():
        arguments = (x.clone(), y, torch.empty(16, 8))
        result = fn(*arguments)
        return result, [result is a for a in arguments]

    expected, expected_identity = call()
    with aoti_eager.enabled([op], devices=["cpu"], cache_dir=shared_cache):
        calls = [call() for _ in range(3)]  # compile (or load), then hits
        (stats,) = aoti_eager.stats().values()
    # Compared once disabled: assert_close's own abs calls abs.out.
    for got, identity in calls:
        assert_same_as_eager(got, expected)
        assert identity == expected_identity
    assert stats["hits"] >= 2 and stats["fallbacks"] == 0, stats


def test_a_signature_decided_eager_runs_the_original_kernel_unboxed(tmp_path, swap_compiler):
    swap_compiler(compile=lambda *a, **k: (_ for _ in ()).throw(CompileError("no kernel")))
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=tmp_path):
        results = [torch.add(a, b, alpha=2) for _ in range(3)]
        stats = aoti_eager.stats()["aten::add.Tensor"]
    for r in results:
        assert_same_as_eager(r, torch.add(a, b, alpha=2))
    assert stats["calls"] == 3 and stats["hits"] == 0 and stats["fallbacks"] == 3, stats
