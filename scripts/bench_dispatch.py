"""Steady-state call latency of tiny overridden ops against eager.

Both are timed in the same process, in alternating rounds, on the same inputs:
the ratio is what counts on a shared, noisy machine.

    python scripts/bench_dispatch.py [--device cpu|cuda] [--calls N] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch

import aoti_eager
from timing import compare, machine


def cases(device: str):
    x = torch.randn(128, device=device)
    a, b = torch.randn(64, 64, device=device), torch.randn(64, 64, device=device)
    return [
        ("abs, 128 floats", "aten::abs.default", lambda: torch.abs(x)),
        ("add 64x64", "aten::add.Tensor", lambda: torch.add(a, b)),
        ("add 64x64, alpha=2", "aten::add.Tensor", lambda: torch.add(a, b, alpha=2)),
        ("mul 64x64", "aten::mul.Tensor", lambda: torch.mul(a, b)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--cache-dir", default=None, help="default: a new empty cache")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as scratch:
        for name, op, fn in cases(args.device):
            # Each case as in a process of its own: add with alpha=2 after alpha=1 would take alpha at run time.
            aoti_eager._overrides.forget()
            compiled, eager = compare(fn, [op], calls=args.calls, devices=[args.device], cache_dir=args.cache_dir or scratch)
            rows.append(dict(case=name, device=args.device, aoti_us=compiled * 1e6, eager_us=eager * 1e6, ratio=compiled / eager))
    if args.json:
        print(json.dumps(rows))
        return
    print(machine(args.device))
    print(f"{'case':<22}{'aoti_eager us':>15}{'eager us':>10}{'ratio':>8}")
    for r in rows:
        print(f"{r['case']:<22}{r['aoti_us']:>15.2f}{r['eager_us']:>10.2f}{r['ratio']:>8.2f}")


if __name__ == "__main__":
    main()
