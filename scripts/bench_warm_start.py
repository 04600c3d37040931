"""Warm start: enable() and the first call of a cached signature in a new process.

The first process compiles ``abs`` on 128 floats into a new cache; three more
processes then time ``enable()`` and their first call, which loads the kernel.

    python scripts/bench_warm_start.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch, aoti_eager
x = torch.randn(128)
t0 = time.perf_counter()
aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=sys.argv[1])
t1 = time.perf_counter()
torch.abs(x)
t2 = time.perf_counter()
print(json.dumps(dict(enable_ms=(t1 - t0) * 1e3, first_call_ms=(t2 - t1) * 1e3, **aoti_eager.stats()["aten::abs"])))
"""


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="aoti_eager-warm-") as cache_dir:
        runs = []
        for _ in range(4):
            out = subprocess.run([sys.executable, "-c", CHILD, cache_dir], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{'process':<10}{'enable ms':>11}{'first call ms':>15}{'compiles':>10}{'loads':>7}")
    for i, r in enumerate(runs):
        label = "cold" if i == 0 else f"warm {i}"
        print(f"{label:<10}{r['enable_ms']:>11.1f}{r['first_call_ms']:>15.1f}{r['compiles']:>10}{r['cache_loads']:>7}")


if __name__ == "__main__":
    main()
