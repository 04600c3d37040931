"""The demo: a transformer block's ops in plain eager code, with aoti_eager.

Runs the workload in a fresh process against an empty cache (cold: every
signature compiles), then in another fresh process against the same cache
(warm: every signature loads), and prints per op: calls, hits, compiles,
cache loads, compile seconds, and steady-state time per call against eager.

    python scripts/demo.py [--cache-dir DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

import torch

OPS = [
    "aten::native_layer_norm",
    "aten::addmm",
    "aten::gelu",
    "aten::add.Tensor",
    "aten::_softmax",
    "aten::mul.Tensor",
]


def block(x, p):
    """Pre-norm MLP with a gated softmax mixing, in ordinary eager PyTorch."""
    import torch.nn.functional as F

    h = F.layer_norm(x, [x.shape[-1]], p["ln_w"], p["ln_b"])
    h = F.gelu(F.linear(h, p["w1"], p["b1"]), approximate="tanh")
    h = F.linear(h, p["w2"], p["b2"])
    gate = torch.softmax(h, dim=-1) * h.shape[-1]
    return x + h * gate


def run(cache_dir: str, steps: int) -> dict:
    """One process's run: the workload with aoti_eager, then per-op timings."""
    import aoti_eager
    from timing import compare
    from torch.utils._python_dispatch import TorchDispatchMode

    g = torch.Generator().manual_seed(0)
    d, hidden = 256, 1024
    p = {
        "ln_w": torch.ones(d), "ln_b": torch.zeros(d),
        "w1": torch.randn(hidden, d, generator=g) / d**0.5, "b1": torch.zeros(hidden),
        "w2": torch.randn(d, hidden, generator=g) / hidden**0.5, "b2": torch.zeros(d),
    }
    x = torch.randn(64, d, generator=g)
    expected = block(x, p)

    start = time.perf_counter()
    aoti_eager.enable(OPS, devices=["cpu"], cache_dir=cache_dir)
    enable_seconds = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        y = block(x, p)
    workload_seconds = time.perf_counter() - start
    stats = aoti_eager.stats()
    aoti_eager.disable()
    torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4)

    # One recorded call per overload, replayed alone to time it against eager.
    class Record(TorchDispatchMode):
        calls: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.setdefault(func, (args, kwargs or {}))
            return func(*args, **(kwargs or {}))

    with Record():
        block(x, p)
    timings = {}
    for func, (args, kwargs) in Record.calls.items():
        name = str(func._schema.name) + (f".{func._schema.overload_name}" if func._schema.overload_name else "")
        if name in stats and stats[name]["calls"]:
            compiled, eager = compare(lambda: func(*args, **kwargs), [func], calls=200, devices=["cpu"], cache_dir=cache_dir)
            timings[name] = (compiled, eager)
    step_compiled, step_eager = compare(lambda: block(x, p), OPS, calls=20, devices=["cpu"], cache_dir=cache_dir)
    return dict(stats=stats, timings=timings, enable_seconds=enable_seconds, workload_seconds=workload_seconds,
                step=(step_compiled, step_eager))


def report(title: str, result: dict) -> None:
    print(f"\n== {title}: enable() {result['enable_seconds'] * 1e3:.0f} ms, workload {result['workload_seconds']:.1f} s")
    header = f"{'op':<28}{'calls':>7}{'hits':>7}{'compiles':>10}{'loads':>7}{'compile s':>11}{'us/call':>10}{'eager us':>10}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    for name, row in result["stats"].items():
        if not row["calls"]:
            continue
        compiled, eager = result["timings"].get(name, (float("nan"), float("nan")))
        print(f"{name:<28}{row['calls']:>7}{row['hits']:>7}{row['compiles']:>10}{row['cache_loads']:>7}"
              f"{row['compile_seconds']:>11.1f}{compiled * 1e6:>10.1f}{eager * 1e6:>10.1f}{compiled / eager:>8.2f}")
        if row["fallback_reason"]:
            print(f"    eager for some calls: {row['fallback_reason']}")
    compiled, eager = result["step"]
    print(f"{'whole block (one step)':<28}{'':>52}{compiled * 1e6:>10.1f}{eager * 1e6:>10.1f}{compiled / eager:>8.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", help="cache to use (default: a new empty one, so the first run is cold)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.cache_dir, args.steps)))
        return
    with tempfile.TemporaryDirectory(prefix="aoti_eager-demo-") as scratch:
        cache_dir = args.cache_dir or scratch
        print(f"aoti_eager demo: ops {', '.join(OPS)}; cache {cache_dir}")
        for title in ("cold process (empty cache: compiles)", "warm process (same cache, new process: loads)"):
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--cache-dir", cache_dir, "--steps", str(args.steps)],
                capture_output=True, text=True,
            )
            if out.returncode != 0:
                sys.exit(f"demo run failed:\n{out.stderr}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            report(title, result)
            served = sum(row["compiles"] + row["cache_loads"] for row in result["stats"].values())
            if served == 0:
                reasons = sorted({row["fallback_reason"] for row in result["stats"].values() if row["fallback_reason"]})
                sys.exit(f"\ndemo FAILED: the {title.split(' (')[0]} compiled and loaded no kernel: "
                         + ("; ".join(reasons) or "no reason recorded") + "\n`aoti-eager doctor` checks the whole path.")


if __name__ == "__main__":
    main()
