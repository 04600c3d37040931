"""A fixed, representative slice of the OpInfo coverage run (scripts/op_coverage.py,
run as a script), one sample per op: no wrong result, no crash, and every op
that compiled before still compiles."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import DEVICES

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "op_coverage.py"

# OpInfos that compile on CPU float32, one op or a few of each family: unary,
# activations, binary and ternary with Python numbers, reductions, softmax and
# norms, matrix products and convolution, shape and indexing, factories,
# losses, pooling and upsampling.
COMPILED = (
    "neg", "exp", "log", "sin", "sqrt", "sigmoid", "tanh", "erf",
    "nn.functional.gelu", "nn.functional.silu", "nn.functional.relu", "nn.functional.hardswish", "nn.functional.softplus",
    "add", "div.floor_rounding", "pow", "maximum", "eq", "where", "clamp", "lerp", "masked_fill",
    "sum", "mean", "amax", "argmax", "var", "logsumexp", "cumsum", "max.reduction_with_dim", "topk",
    "softmax", "log_softmax", "nn.functional.layer_norm",
    "mm", "nn.functional.linear", "nn.functional.conv2d",
    "cat", "flip", "tril", "constant_pad_nd", "index_select", "gather", "scatter_add", "index_put", "zeros_like",
    "nn.functional.cross_entropy", "nn.functional.embedding", "nn.functional.max_pool2d", "nn.functional.interpolate.bilinear",
)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_opinfo_subset(device: str, shared_cache, tmp_path):
    results = tmp_path / "results.jsonl"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--ops", ",".join(COMPILED), "--dtypes", "float32", "--devices", device,
         "--samples", "1", "--jobs", str(os.cpu_count() or 1), "--timeout", "600",
         "--results", str(results), "--cache-dir", str(shared_cache)],
        capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # One row per unit, as the script appends them (a fresh file: no unit twice).
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    failed = [f"{r['op']}: {r['outcome']}: {r['reason']}" for r in rows if r["outcome"] in ("wrong", "crash", "timeout")]
    assert not failed, "\n".join(failed)
    if device != "cpu":
        return  # COMPILED is what CPU compiles
    regressed = [f"{r['op']}: {r['outcome']}: {r['reason']}" for r in rows if r["outcome"] != "compiled"]
    regressed += [f"{op}: not run" for op in COMPILED if op not in {r["op"] for r in rows}]
    assert not regressed, "compiled before, not now:\n" + "\n".join(regressed)


def _script():
    """The script as a module (registered, so that its units pickle)."""
    if "op_coverage" not in sys.modules:
        spec = importlib.util.spec_from_file_location("op_coverage", SCRIPT)
        sys.modules["op_coverage"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["op_coverage"])
    return sys.modules["op_coverage"]


def _fake_run_unit(unit, samples, layouts):
    """Stands in for op_coverage.run_unit: the unit's op says how it ends."""
    os.write(1, f"running {unit.op}\n".encode())  # fd 1: the worker's log, whatever sys.stdout is
    if unit.op == "abort":
        # faulthandler lists this idle thread first (newest first); the tail shows the one that faulted.
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
        os.abort()
    if unit.op == "hang":
        time.sleep(60)
    return {"outcome": unit.op, "reason": None, "pid": os.getpid()}


def test_worker_runs_units_in_turn_and_starts_anew_after_a_crash_a_timeout_or_a_wrong_result(monkeypatch):
    coverage = _script()
    monkeypatch.setattr(coverage, "run_unit", _fake_run_unit)  # a forked worker sees it
    worker = coverage.Worker(multiprocessing.get_context("fork"), units_per_worker=3)

    def run(op, timeout=30):
        return worker.run(coverage.Unit(op, "float32", "cpu"), 1, ["given"], timeout)

    try:
        first, second = run("compiled"), run("eager")
        assert second["pid"] == first["pid"], "a worker runs unit after unit"
        third, fourth = run("ineligible"), run("compiled")
        assert third["pid"] == first["pid"] and fourth["pid"] != first["pid"], "a new worker after units_per_worker"

        crash = run("abort")
        assert crash["outcome"] == "crash" and "SIGABRT" in crash["reason"], crash
        assert "Fatal Python error: Aborted" in crash["reason"] and "_fake_run_unit" in crash["reason"], crash
        assert run("compiled")["outcome"] == "compiled"

        timeout = run("hang", timeout=2)
        assert timeout["outcome"] == "timeout", timeout
        assert "running hang" in timeout["reason"] and "running compiled" not in timeout["reason"], "the log holds one unit's output"

        wrong, after = run("wrong"), run("compiled")
        assert after["pid"] != wrong["pid"], "a new worker after a unit that did not end clean"
    finally:
        worker.close()
