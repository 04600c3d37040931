"""Kernel time of composite ops: eager against aoti_eager, side by side.

Each op is called through its public torch function. The aten overloads that
call reaches at the device's dispatch key are found by running it once under a
TorchDispatchMode; those that aoti_eager can override are enabled, compiled by
a first call, then the call is timed with aoti_eager enabled and disabled in
alternating rounds (median of --repeat rounds). ratio = aoti_eager / eager.

Each kernel is timed against eager when it is compiled, and its signature
kept eager where eager is clearly faster (AOTI_EAGER_KEEP_FASTER, on by
default); the report names those signatures, and the ops that still end up
slower than eager by more than 5% (the target: none).

    python scripts/bench_composite.py [--device cpu|cuda] [--dtype float32]
        [--ops softmax,layer_norm] [--repeat 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import aoti_eager
from aoti_eager._ops import qualified_name, refusal
from timing import compare, per_call_seconds


def suite(device: str, dtype: torch.dtype) -> dict[str, tuple[str, Callable[[], object]]]:
    """Op name -> (input shape, call)."""
    rows, cols = (8192, 1024) if device == "cuda" else (256, 1024)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device, dtype=dtype)

    x, y, z = randn(rows, cols), randn(rows, cols), randn(rows, cols)
    weight, bias = randn(cols), randn(cols)
    target = torch.rand(rows, cols, device=device, dtype=dtype)
    images, channel_weight = randn(rows // 64, 64, cols), randn(64)  # N, C, L: 8 groups of 8 channels
    shape = f"{rows}x{cols}"
    return {
        "softmax": (shape, lambda: torch.softmax(x, dim=-1)),
        "log_softmax": (shape, lambda: torch.log_softmax(x, dim=-1)),
        "logsumexp": (shape, lambda: torch.logsumexp(x, dim=-1)),
        "layer_norm": (shape, lambda: F.layer_norm(x, [cols], weight, bias)),
        "rms_norm": (shape, lambda: F.rms_norm(x, [cols], weight)),
        "group_norm": ("x".join(map(str, images.shape)), lambda: F.group_norm(images, 8, channel_weight)),
        "gelu_tanh": (shape, lambda: F.gelu(x, approximate="tanh")),
        "silu": (shape, lambda: F.silu(x)),
        "mish": (shape, lambda: F.mish(x)),
        "hardswish": (shape, lambda: F.hardswish(x)),
        "addcmul": (shape, lambda: torch.addcmul(x, y, z, value=0.5)),
        "lerp": (shape, lambda: torch.lerp(x, y, 0.3)),
        "bce_with_logits": (shape, lambda: F.binary_cross_entropy_with_logits(x, target)),
        "smooth_l1_loss": (shape, lambda: F.smooth_l1_loss(x, y)),
        "mse_loss": (shape, lambda: F.mse_loss(x, y)),
    }


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[torch._ops.OpOverload] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in self.ops:
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def reached_ops(fn: Callable[[], object]) -> list[torch._ops.OpOverload]:
    """The aten overloads a call reaches below autograd, in call order."""
    with _Recorder() as recorder:
        fn()
    return recorder.ops


def calls_per_round(fn: Callable[[], object], seconds: float = 0.05) -> int:
    fn()
    return max(3, int(seconds / per_call_seconds(fn, 3)))


# Slower than eager by more than this is a miss of the target.
TOLERANCE = 1.05
# How the runtime words a signature kept eager because eager was faster.
KEPT_EAGER = "eager is faster: "


def kept_eager(stats: dict | None) -> bool:
    return bool(stats) and (stats["fallback_reason"] or "").startswith(KEPT_EAGER)


def outcome(stats: dict | None) -> str:
    """What the calls of one aten op did: compiled kernel, eager, or both."""
    if stats is None:
        return "not overridden at this device"
    if not stats["fallbacks"]:
        return "compiled"
    if kept_eager(stats) and not stats["hits"]:
        return f"kept eager ({stats['fallback_reason'].removeprefix(KEPT_EAGER)})"
    eager = f"eager ({stats['fallback_reason']})"
    return eager if not stats["hits"] else f"compiled for {stats['hits']} of {stats['calls']} calls, else {eager}"


def bench(name: str, shape: str, fn: Callable[[], object], device: str, repeat: int, cache_dir: str) -> dict:
    reached = reached_ops(fn)
    eligible = [op for op in reached if refusal(op) is None]
    if not eligible:
        return dict(op=name, shape=shape, aten_ops={qualified_name(op): "not overridable" for op in reached})
    enable = dict(devices=[device], cache_dir=cache_dir)
    compiled, eager = compare(fn, eligible, calls=calls_per_round(fn), rounds=repeat, **enable)
    with aoti_eager.enabled(eligible, **enable):
        fn(), fn()  # the first call of each op loads its decision, the second uses it
        stats = aoti_eager.stats()
    aten_ops = {
        qualified_name(op): outcome(stats.get(qualified_name(op))) if op in eligible else "not overridable" for op in reached
    }
    faster = [qualified_name(op) for op in eligible if kept_eager(stats.get(qualified_name(op)))]
    return dict(op=name, shape=shape, eager_us=eager * 1e6, aoti_us=compiled * 1e6, ratio=compiled / eager,
                aten_ops=aten_ops, kept_eager=faster)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--ops", default=None, help="comma-separated names from the suite (default: all)")
    parser.add_argument("--repeat", type=int, default=7, help="alternating rounds; the median is reported")
    parser.add_argument("--cache-dir", default=None, help="default: a new empty cache")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    cases = suite(args.device, getattr(torch, args.dtype))
    names = args.ops.split(",") if args.ops else list(cases)
    unknown = sorted(set(names) - set(cases))
    if unknown:
        parser.error(f"unknown ops {unknown}; the suite has {', '.join(cases)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as scratch:
        for name in names:
            start = time.perf_counter()
            rows.append(bench(name, *cases[name], args.device, args.repeat, args.cache_dir or scratch))
            if not args.json:
                print(f"  {name}: {time.perf_counter() - start:.0f} s (compiles included)", flush=True)
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    geomean = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    slower = [r for r in rows if r.get("ratio", 0) > TOLERANCE]
    faster = [(r["op"], op) for r in rows for op in r.get("kept_eager", [])]
    if args.json:
        print(json.dumps(dict(device=args.device, dtype=args.dtype, torch=torch.__version__, rows=rows, geomean_ratio=geomean,
                              max_ratio=max(ratios, default=None), slower_than_eager=[r["op"] for r in slower],
                              tolerance=TOLERANCE)))
        return

    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "") + f", {args.dtype}")
    print(f"{'op':<17}{'shape':>14}{'eager us':>11}{'aoti_eager us':>15}{'ratio':>7}  aten ops reached")
    for r in rows:
        times = f"{r['eager_us']:>11.1f}{r['aoti_us']:>15.1f}{r['ratio']:>7.2f}" if "ratio" in r else f"{'-':>11}{'-':>15}{'-':>7}"
        reached = "; ".join(f"{op}: {what}" for op, what in r["aten_ops"].items())
        print(f"{r['op']:<17}{r['shape']:>14}{times}  {reached}")
    if geomean is not None:
        print(f"geometric mean of ratios: {geomean:.2f} over {len(ratios)} ops; highest {max(ratios):.2f}")
    print("kept eager, measured faster than their kernel at compile: "
          + (", ".join(f"{op} ({name})" for name, op in faster) if faster else "none"))
    within = f"{(TOLERANCE - 1) * 100:.0f}%"
    if slower:
        print(f"slower than eager by more than {within}: {len(slower)} of {len(ratios)} ops: "
              + ", ".join(f"{r['op']} {r['ratio']:.2f}" for r in slower))
    else:
        print(f"no op slower than eager by more than {within} ({len(ratios)} ops)")


if __name__ == "__main__":
    main()
