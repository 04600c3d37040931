"""Keeping eager where it is faster: a new kernel is timed against eager once,
when it is compiled, and the verdict is kept in the cache."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import pytest
import torch

import aoti_eager
from aoti_eager import _overrides
from aoti_eager.cache import KernelCache
from aoti_eager.kernels import pipeline, speed
from aoti_eager.kernels.compile import compile_options
from aoti_eager.kernels.signature import CallSignature, qualified_name
from aoti_eager.kernels.speed import Timing
from aoti_eager.kernels.toolchain import environment_name
from helpers import assert_same_as_eager

A = torch.ops.aten


@pytest.fixture(autouse=True)
def _keep_faster_on(monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "1")  # tests/conftest.py turns it off for the others


class FixedTimings:
    """Stands in for time_against_eager: returns the given (kernel, eager)
    seconds in turn, the last one from then on, and counts its calls."""

    def __init__(self, *timings: tuple[float, float]):
        self.timings = list(timings)
        self.calls = 0

    def __call__(self, kernel, signature, op, budget=speed.BUDGET_SECONDS) -> Timing:
        timing = self.timings[min(self.calls, len(self.timings) - 1)]
        self.calls += 1
        return Timing(*timing)


def published(tmp_path, op, device: str, args) -> dict:
    """The cache entry of ``op``'s call with ``args``, as entry.json holds it."""
    signature = CallSignature.of(op, device, list(args))
    cache = KernelCache(tmp_path, environment_name(torch.device(device), compile_options(device)))
    return json.loads((cache.entry_dir(qualified_name(op), signature.key) / "entry.json").read_text())


def test_a_kernel_slower_than_eager_keeps_eager_once_per_machine(tmp_path, swap_compiler, caplog):
    timings = FixedTimings((1.3e-6, 1.0e-6))
    swap_compiler(timer=timings)
    x = torch.randn(64)
    with caplog.at_level(logging.INFO, logger="aoti_eager"):
        with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
            results = [torch.abs(x) for _ in range(3)]
            stats = aoti_eager.stats()["aten::abs"]
    for r in results:
        assert_same_as_eager(r, x.abs(), atol=0, rtol=0)  # eager ran: its exact result
    assert timings.calls == 2  # measured, then again before deciding
    assert (stats["compiles"], stats["hits"], stats["fallbacks"]) == (1, 0, 3), stats
    assert stats["fallback_reason"] == "eager is faster: kernel 1.30x eager's time (measured at compile)"
    assert sum("keeps eager" in r.message for r in caplog.records) == 1

    entry = published(tmp_path, A.abs.default, "cpu", [x])
    assert entry["library"] is None and entry["reason"] == stats["fallback_reason"]
    assert entry["timing"] == {"kernel_us": 1.3, "eager_us": 1.0, "ratio": 1.3}
    assert list(tmp_path.rglob("kernel.so")) == []  # an eager entry keeps no library

    # A fresh enable, as a new process would, finds the verdict: no compile, no timing.
    _overrides.forget()
    swap_compiler(compile=lambda *a, **k: pytest.fail("must not compile again"))
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
        y = torch.abs(x)
        stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(y, x.abs(), atol=0, rtol=0)
    assert timings.calls == 2
    assert (stats["compiles"], stats["hits"], stats["fallbacks"]) == (0, 0, 1), stats
    assert stats["fallback_reason"].startswith("eager is faster")

    # A new process, with the timing on: it reads the verdict, compiles nothing.
    child = subprocess.run([sys.executable, "-c", """
import sys, json, torch, aoti_eager
x = torch.randn(64)
expected = x.abs()
aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=sys.argv[1])
y = torch.abs(x)
stats = aoti_eager.stats()["aten::abs"]
aoti_eager.disable()
torch.testing.assert_close(y, expected, atol=0, rtol=0)
assert y.dtype == expected.dtype and y.shape == expected.shape
print(json.dumps(stats))
""", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr
    stats = json.loads(child.stdout.strip().splitlines()[-1])
    assert (stats["compiles"], stats["hits"], stats["fallbacks"]) == (0, 0, 1), stats
    assert stats["fallback_reason"].startswith("eager is faster")


def test_a_kernel_measured_slower_once_only_is_kept(tmp_path, swap_compiler):
    # Noise: slower on the first measurement, not on the repeat.
    timings = FixedTimings((1.3e-6, 1.0e-6), (0.98e-6, 1.0e-6))
    swap_compiler(timer=timings)
    x = torch.randn(48)
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
        results = [torch.abs(x) for _ in range(3)]
        stats = aoti_eager.stats()["aten::abs"]
    for r in results:
        assert_same_as_eager(r, x.abs())
    assert timings.calls == 2
    assert (stats["compiles"], stats["hits"], stats["fallbacks"]) == (1, 2, 0), stats
    entry = published(tmp_path, A.abs.default, "cpu", [x])
    assert entry["library"] == "kernel.so" and entry["reason"] is None
    assert entry["timing"]["ratio"] == 0.98  # the kernel's better showing is recorded


def test_an_in_place_call_with_runtime_numbers_kept_eager_never_compiles_again(tmp_path, swap_compiler):
    timings = FixedTimings((2.0e-6, 1.0e-6))
    swap_compiler(timer=timings)
    compiles = []
    compile_call = pipeline.compile_call
    swap_compiler(compile=lambda signature, *a, **k: compiles.append(signature) or compile_call(signature, *a, **k))
    p, g = torch.randn(16, 16), torch.randn(16, 16)
    expected = p.clone()
    rates = [0.1, 0.05, 0.025]
    with aoti_eager.enabled(["aten::add_.Tensor"], devices=["cpu"], cache_dir=tmp_path):
        for lr in rates:
            p.add_(g, alpha=-lr)
        stats = aoti_eager.stats()["aten::add_.Tensor"]
    for lr in rates:
        expected.add_(g, alpha=-lr)
    # Each step wrote into the caller's tensor once (the timing ran on copies).
    assert_same_as_eager(p, expected, atol=0, rtol=0)
    # One compile, with the learning rate an input: kept eager for every rate,
    # not compiled again with a rate compiled in.
    assert len(compiles) == 1 and compiles[0].runtime_arguments, compiles
    assert (stats["compiles"], stats["hits"], stats["fallbacks"]) == (1, 0, len(rates)), stats
    assert stats["fallback_reason"].startswith("eager is faster: kernel 2.00x")


def test_timing_is_on_by_default_and_runs_a_real_op_end_to_end(tmp_path, monkeypatch, swap_compiler):
    monkeypatch.delenv("AOTI_EAGER_KEEP_FASTER")
    measured = []
    real = pipeline.time_against_eager

    def timed(*args, **kwargs):
        measured.append(real(*args, **kwargs))
        return measured[-1]

    swap_compiler(timer=timed)
    p, g = torch.randn(128, 128), torch.randn(128, 128)
    before = p.clone()
    with aoti_eager.enabled(["aten::add_.Tensor"], devices=["cpu"], cache_dir=tmp_path):
        results = [p.add_(g, alpha=-lr) for lr in (0.5, 0.5, 0.25)]
        stats = aoti_eager.stats()["aten::add_.Tensor"]
    expected = before.add_(g, alpha=-0.5).add_(g, alpha=-0.5).add_(g, alpha=-0.25)
    assert all(r is p for r in results)
    assert_same_as_eager(p, expected)
    assert measured and all(t.kernel_seconds > 0 and t.eager_seconds > 0 for t in measured)
    entry = published(tmp_path, A.add_.Tensor, "cpu", [before, g, -0.5])
    assert entry["timing"]["kernel_us"] > 0 and entry["timing"]["eager_us"] > 0
    assert stats["compiles"] == 1
    if entry["library"] is None:  # eager was faster on this machine
        assert entry["timing"]["ratio"] > speed.SLOWER_THAN_EAGER
        assert stats["hits"] == 0 and stats["fallback_reason"].startswith("eager is faster")
    else:
        assert stats["hits"] >= 1 and stats["fallback_reason"] is None, stats


def test_off_switch_times_nothing(tmp_path, monkeypatch, swap_compiler):
    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "0")
    swap_compiler(timer=lambda *a, **k: pytest.fail("must not time"))
    x = torch.randn(64)  # the signature of the first test: compiled into this new cache
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
        results = [torch.abs(x) for _ in range(2)]
        stats = aoti_eager.stats()["aten::abs"]
    for r in results:
        assert_same_as_eager(r, x.abs())
    assert (stats["compiles"], stats["hits"]) == (1, 1), stats
    assert published(tmp_path, A.abs.default, "cpu", [x])["timing"] is None


def test_with_the_timing_off_a_signature_kept_eager_for_speed_gets_its_kernel(tmp_path, monkeypatch, swap_compiler):
    swap_compiler(timer=FixedTimings((1.3e-6, 1.0e-6)))
    x = torch.randn(72)
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
        torch.abs(x)
    assert published(tmp_path, A.abs.default, "cpu", [x])["library"] is None

    monkeypatch.setenv("AOTI_EAGER_KEEP_FASTER", "0")
    _overrides.forget()  # a new process, with the timing off
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
        results = [torch.abs(x) for _ in range(2)]
        stats = aoti_eager.stats()["aten::abs"]
    for r in results:
        assert_same_as_eager(r, x.abs())
    assert (stats["compiles"], stats["hits"], stats["fallbacks"]) == (1, 1, 0), stats
    assert published(tmp_path, A.abs.default, "cpu", [x])["library"] == "kernel.so"


def test_time_against_eager_leaves_the_callers_tensors_alone():
    p, g = torch.randn(32), torch.randn(32)
    before = p.clone()
    signature = CallSignature.of(A.add_.Tensor, "cpu", [p, g, 2])

    class Kernel:  # runs eager's op as the "kernel", on the inputs it is given
        def run(self, inputs):
            return [inputs[0].add_(inputs[1], alpha=2)]

    timing = speed.time_against_eager(Kernel(), signature, A.add_.Tensor, budget=0.01)
    assert timing.kernel_seconds > 0 and timing.eager_seconds > 0
    assert_same_as_eager(p, before, atol=0, rtol=0)


class SlowerFrom:
    """A timer (kernels/speed.py's Timer) that finds the kernel twice eager's
    time from ``rows`` rows of the first tensor up, and half below; it keeps
    the rows of each call it timed."""

    def __init__(self, rows: int):
        self.rows, self.timed = rows, []

    def __call__(self, kernel, signature, op) -> Timing:
        rows = signature.described[0].sizes[0]
        self.timed.append(rows)
        return Timing(2.0e-6 if rows >= self.rows else 0.5e-6, 1.0e-6)


def abs_calls(timer: SlowerFrom, cache_dir, rows: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """abs of a rows x 16 tensor at each of ``rows``, ``timer`` timing its
    kernels: the results, the inputs, and the op's stats."""
    inputs = [torch.randn(n, 16) for n in rows]
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=cache_dir):
        for override in _overrides.installed():
            override.timer = timer
        results = [torch.abs(x) for x in inputs]
        stats = aoti_eager.stats()["aten::abs"]
    return results, inputs, stats


def test_a_dynamic_kernel_slower_in_a_new_range_of_sizes_keeps_eager_there_only(tmp_path):
    timer = SlowerFrom(rows=64)
    # 8 rows compile a static kernel, 12 a dynamic one (rows a symbol, timed at 12:
    # range 8-15); 13 and 14 are in its range, 100 and 120 in 64-127, where it loses.
    rows = [8, 12, 13, 100, 120, 14, 100]
    results, inputs, stats = abs_calls(timer, tmp_path, rows)
    for r, x in zip(results, inputs):
        assert_same_as_eager(r, x.abs(), atol=0, rtol=0)
    # Each kernel timed at the call that compiled it; the dynamic one again at 100
    # (twice: eager wins only on two measurements), and nowhere else.
    assert timer.timed == [8, 12, 100, 100]
    # Misses at 8, 12 (compiles) and 100 (a new range); the dynamic kernel ran at
    # 13 and 14, eager at 100, 120 and 100 again: the C++ side keeps the range's
    # verdict after its one miss.
    assert (stats["compiles"], stats["hits"], stats["fallbacks"], stats["misses"]) == (2, 2, 3, 3), stats
    assert stats["fallback_reason"] == "eager is faster at these sizes: kernel 2.00x eager's time"

    # Enabled again in the process: every range's verdict stands, nothing is timed or missed.
    timer = SlowerFrom(rows=64)
    results, inputs, stats = abs_calls(timer, tmp_path, [13, 100, 9])
    for r, x in zip(results, inputs):
        assert_same_as_eager(r, x.abs(), atol=0, rtol=0)
    assert timer.timed == []
    assert (stats["compiles"], stats["hits"], stats["fallbacks"], stats["misses"]) == (0, 2, 1, 0), stats

    # A new process: the kernel's own range was judged when it was compiled
    # (the cache entry's timing); the range of 100 rows is judged again.
    _overrides.forget()
    timer = SlowerFrom(rows=64)
    results, inputs, stats = abs_calls(timer, tmp_path, [13, 100, 9])
    for r, x in zip(results, inputs):
        assert_same_as_eager(r, x.abs(), atol=0, rtol=0)
    assert timer.timed == [100, 100]
    # 13 loads the kernel (a miss), 100 misses, 9 is a hit in the kernel's range.
    assert (stats["compiles"], stats["hits"], stats["fallbacks"], stats["misses"]) == (0, 1, 1, 2), stats


def test_a_range_kept_eager_compiles_no_kernel_with_its_numbers_compiled_in(tmp_path):
    timer = SlowerFrom(rows=64)
    calls = [(torch.randn(n, 16), torch.randn(n, 16)) for n in (8, 12, 100, 100)]
    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=tmp_path):
        for override in _overrides.installed():
            override.timer = timer
        results = [torch.add(x, y, alpha=0.5) for x, y in calls]
        stats = aoti_eager.stats()["aten::add.Tensor"]
    for r, (x, y) in zip(results, calls):
        assert_same_as_eager(r, torch.add(x, y, alpha=0.5), atol=0, rtol=0)
    # alpha is a kernel input: eager's verdict at 100 rows holds for every value,
    # and no kernel with 0.5 compiled in is tried instead.
    assert (stats["compiles"], stats["fallbacks"]) == (2, 2), stats
    assert timer.timed == [8, 12, 100, 100]


def test_a_range_verdict_holds_for_new_values_of_the_kernels_runtime_numbers(tmp_path):
    timer = SlowerFrom(rows=64)
    # alpha is a kernel input: 8 compiles a static kernel, 12 a dynamic one, 100
    # is judged (eager there); 120 and 13 bring new alphas to the judged ranges.
    calls = [(torch.randn(n, 16), torch.randn(n, 16), alpha) for n, alpha in
             ((8, 0.5), (12, 0.5), (100, 0.5), (120, 0.25), (13, 0.75), (100, 2.0))]
    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=tmp_path):
        for override in _overrides.installed():
            override.timer = timer
        results = [torch.add(x, y, alpha=alpha) for x, y, alpha in calls]
        stats = aoti_eager.stats()["aten::add.Tensor"]
    for r, (x, y, alpha) in zip(results, calls):
        assert_same_as_eager(r, torch.add(x, y, alpha=alpha))
    assert timer.timed == [8, 12, 100, 100]
    # One family entry keeps both: its runtime numbers' values are left out of
    # its key, and each range keeps its verdict. Only 8, 12 and 100 miss.
    assert (stats["compiles"], stats["misses"], stats["hits"], stats["fallbacks"]) == (2, 3, 1, 3), stats


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_a_kernel_slowed_by_other_work_in_most_rounds_is_not_judged_slower():
    """Other work on the machine only ever adds time: each side's fastest round
    is its time, so a faster kernel preempted in all but one round still wins."""
    kernel_calls = iter(range(1000))

    def kernel():
        _busy(3e-3 if next(kernel_calls) < 5 else 0.8e-3)  # 3 warm-up calls and 2 of 3 rounds slowed

    timing = speed.time_both(kernel, lambda: _busy(1e-3), torch.device("cpu"), budget=6e-3)
    assert not timing.eager_faster, timing
