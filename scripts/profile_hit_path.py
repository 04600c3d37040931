"""Where a steady-state call of a tiny overridden op spends its time.

For each case of bench_dispatch.py, all in C++ (no Python in the loops), ns
per call of: keying the arguments, the compiled kernel alone (AOTInductor's
entry point: input handles, the generated wrapper, its output allocation, the
loop), the whole boxed call through the dispatcher with the override, and the
same call with the original kernel. "rest" is call - key - kernel: the
dispatcher, the lookup, building inputs and pushing results. Rounds alternate
between the override and eager; medians of 7.

    python scripts/profile_hit_path.py [--device cpu|cuda] [--calls N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import torch

import aoti_eager
from aoti_eager import _extension, _overrides
from aoti_eager.kernels import CallSignature
from aoti_eager.kernels.compile import call_op, flat_tensor_inputs


def cases(device: str):
    x = torch.randn(128, device=device)
    a, b = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
    A = torch.ops.aten
    return [
        ("abs, 128 floats", A.abs.default, [x]),
        ("add 64x64", A.add.Tensor, [a, b, 1]),
        ("add 64x64, alpha=2", A.add.Tensor, [a, b, 2]),
        ("add 64x64, alpha=2.5", A.add.Tensor, [a, b, 2.5]),
        ("mul 64x64", A.mul.Tensor, [a, b]),
    ]


def profile(op, args, device: str, calls: int, cache_dir: str) -> dict[str, float]:
    C = _extension.load()
    name, overload = op._schema.name, op._schema.overload_name
    aoti_eager.enable([op], devices=[device], cache_dir=cache_dir)
    call_op(op, args)  # decide the signature: compile or load
    override = next(o for o in _overrides.installed() if o.op == op)
    signature = CallSignature.of(op, device, args)
    kernel = getattr(override.decisions.get(signature.decision_key), "kernel", None)
    if kernel is None:
        raise SystemExit(f"{name}.{overload}: no compiled kernel for {signature.short()} (decided eager)")
    inputs = flat_tensor_inputs(signature, args)
    aoti_eager.disable()
    rounds: dict[str, list[float]] = {"key": [], "kernel": [], "call": [], "eager": []}
    for _ in range(7):
        aoti_eager.enable([op], devices=[device], cache_dir=cache_dir)
        call_op(op, args)  # reload the decision
        for stage, ns in C.time_stages(name, overload, list(args), kernel, inputs, calls).items():
            rounds[stage].append(ns)
        aoti_eager.disable()
        rounds["eager"].append(C.time_stages(name, overload, list(args), kernel, inputs, calls)["call"])
    result = {stage: statistics.median(v) for stage, v in rounds.items()}
    result["rest"] = result["call"] - result["key"] - result["kernel"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--cache-dir", default=None, help="default: a new empty cache")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, device {args.device}; ns per call, C++ loops")
    print(f"{'case':<22}{'key':>7}{'kernel':>8}{'rest':>7}{'call':>8}{'eager':>8}{'ratio':>7}")
    with tempfile.TemporaryDirectory(prefix="aoti_eager-profile-") as scratch:
        for label, op, op_args in cases(args.device):
            r = profile(op, op_args, args.device, args.calls, args.cache_dir or scratch)
            print(f"{label:<22}{r['key']:>7.0f}{r['kernel']:>8.0f}{r['rest']:>7.0f}{r['call']:>8.0f}{r['eager']:>8.0f}"
                  f"{r['call'] / r['eager']:>7.2f}")


if __name__ == "__main__":
    main()
