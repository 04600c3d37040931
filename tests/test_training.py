"""A training loop's steady state: no misses once every step's signatures are
decided (an optimizer's moving numbers are kernel inputs), kernels that cannot
run are not tried again, disable()/enable() costs nothing, and a run prints
nothing but the runtime's own log records.

The loop (tests/training_loop.py) runs once per module in a process of its
own, cold, in a cache of the module's; the tests in this process reuse that
cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import aoti_eager
from aoti_eager import _overrides
from helpers import assert_same_as_eager
from training_loop import LOG_PREFIX, model_and_steps

A = torch.ops.aten
STEPS = 6


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory):
    """The loop in a new process, on an empty cache: its result and output."""
    root = tmp_path_factory.mktemp("training")
    result = root / "result.json"
    process = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "training_loop.py"), str(root / "cache"), str(result), str(STEPS)],
        capture_output=True, text=True, timeout=900,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return root / "cache", json.loads(result.read_text()), process.stdout, process.stderr


def test_a_training_loop_misses_nothing_after_its_third_step(cold_run):
    _, result, _, _ = cold_run
    steps = result["steps"]
    assert steps[0]["compiles"] > 0, steps  # it did start cold
    assert [s["misses"] for s in steps[3:]] == [0] * (STEPS - 3), steps
    assert all(s["compiles"] == 0 for s in steps[3:]), steps


def test_a_training_loops_losses_are_eagers(cold_run):
    _, result, _, _ = cold_run
    for s in result["steps"]:
        torch.testing.assert_close(torch.tensor(s["loss"]), torch.tensor(s["eager_loss"]))


def test_a_training_run_prints_only_the_runtimes_log_records(cold_run):
    _, result, stdout, stderr = cold_run
    assert result["steps"][0]["compiles"] > 0  # compiles happened in that process
    lines = [line for line in (stdout + stderr).splitlines() if line.strip()]
    assert [line for line in lines if not line.startswith(LOG_PREFIX)] == []


def test_an_op_whose_kernel_would_only_call_eager_is_left_out_before_any_compile(cold_run):
    # AOTInductor has no C shim for _foreach_norm (clip_grad_norm_'s): its
    # kernel would call eager through a proxy executor. ops_reached says so,
    # and the loop never enables it.
    _, result, _, _ = cold_run
    _, _, probe = model_and_steps()
    assert "no C shim for aten::_foreach_norm.Scalar" in aoti_eager.ops_reached(probe).refused["aten::_foreach_norm.Scalar"]
    assert str(A._foreach_norm.Scalar) not in result["ops"] and "aten::_foreach_norm.Scalar" not in result["stats"]


def test_enabling_again_reuses_every_decision_and_kernel(cold_run):
    cache, _, _, _ = cold_run
    step, eager_step, probe = model_and_steps()
    ops = aoti_eager.ops_reached(probe)
    aoti_eager.enable(ops, devices=["cpu"], cache_dir=cache)
    losses = [step() for _ in range(3)]
    kept = {(o.op, o.device): (o, dict(o.decisions)) for o in _overrides.installed()}
    aoti_eager.disable()
    aoti_eager.enable(ops, devices=["cpu"], cache_dir=cache)
    losses.append(step())
    stats = aoti_eager.stats()
    after = {(o.op, o.device): o for o in _overrides.installed()}
    aoti_eager.disable()
    for loss in losses:
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(eager_step()))
    assert sum(row["misses"] + row["compiles"] + row["cache_loads"] for row in stats.values()) == 0, stats
    assert sum(row["hits"] for row in stats.values()) > 0, stats
    for key, (override, decisions) in kept.items():
        assert after[key] is override
        assert all(override.decisions[k] is decision for k, decision in decisions.items())


def test_a_list_of_scalars_that_moves_is_one_kernel_for_every_value(cold_run):
    # More items than the C++ side keeps inline: every runtime number's tensor must stay where the kernel reads it.
    cache, _, _, _ = cold_run
    params = [torch.randn(4, 3) for _ in range(9)]
    expected = [p.clone() for p in params]
    numerators, denominators = [torch.randn(4, 3) for _ in range(9)], [torch.rand(4, 3) + 0.5 for _ in range(9)]
    with aoti_eager.enabled(["aten::_foreach_addcdiv_.ScalarList"], devices=["cpu"], cache_dir=cache):
        for step in range(1, 5):
            scalars = [-(0.1 * i + 1) / (1 - 0.9**step) for i in range(9)]
            torch._foreach_addcdiv_(params, numerators, denominators, scalars)
        stats = aoti_eager.stats()["aten::_foreach_addcdiv_.ScalarList"]
    for step in range(1, 5):
        scalars = [-(0.1 * i + 1) / (1 - 0.9**step) for i in range(9)]
        torch._foreach_addcdiv_(expected, numerators, denominators, scalars)
    for p, e in zip(params, expected):
        assert_same_as_eager(p, e)
    assert stats["compiles"] + stats["cache_loads"] == 1 and stats["misses"] == 1 and stats["hits"] == 3, stats
    assert stats["fallbacks"] == 0, stats
