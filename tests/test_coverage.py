"""A fixed, representative slice of the OpInfo coverage run (scripts/op_coverage.py,
run as a script), one sample per op: no wrong result, no crash, and every op
that compiled before still compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
