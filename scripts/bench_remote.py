"""The fleet cache: time from ``enable()`` to the first result in a new
process whose local cache is empty and whose fleet (a Redis server) holds
every kernel, against a new process whose local cache holds them.

A real ``redis-server`` is started on a free loopback port. One process
compiles and publishes (signed); then, for one kernel (``abs`` on 128 floats)
and for a model's worth (the demo's transformer block, scripts/demo.py), each
of ``--runs`` processes times ``enable()`` plus the first forward: "warm
local" on the publishing process's cache (no server), and "warm fleet" on a
new, empty cache with the server behind it; one more process, "cold local",
compiles the same signatures into a new cache with no server. The target:
warm fleet <= warm local + 150 ms, and <= 5% of cold local. Both run on a machine whose user
has loaded kernels of the environment before (the load probe's verdict,
kernels/inductor/load_probe.py, is the user's, not a cache's), as the publisher did.
Every result is checked against eager.

    python scripts/bench_remote.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent

CHILD = r"""
import json, sys, time, torch, aoti_eager
workload, cache_dir, scripts, url = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] or None
sys.path.insert(0, scripts)
from demo import OPS, block
g = torch.Generator().manual_seed(0)
if workload == "kernel":
    ops, x = ["aten::abs.default"], torch.randn(128, generator=g)
    forward = lambda: torch.abs(x)
else:
    d, hidden = 256, 1024
    p = {"ln_w": torch.ones(d), "ln_b": torch.zeros(d),
         "w1": torch.randn(hidden, d, generator=g) / d**0.5, "b1": torch.zeros(hidden),
         "w2": torch.randn(d, hidden, generator=g) / hidden**0.5, "b2": torch.zeros(d)}
    ops, x = OPS, torch.randn(64, d, generator=g)
    forward = lambda: block(x, p)
expected = forward()
start = time.perf_counter()
aoti_eager.enable(ops, devices=["cpu"], cache_dir=cache_dir, remote=url)
result = forward()
ms = (time.perf_counter() - start) * 1e3
torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-4)
stats = aoti_eager.stats().values()
print(json.dumps(dict(ms=ms, compiles=sum(s["compiles"] for s in stats), loads=sum(s["cache_loads"] for s in stats),
                      fallbacks=sum(s["fallbacks"] for s in stats))))
"""


def child(workload: str, cache_dir: Path, url: str | None) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, workload, str(cache_dir), str(SCRIPTS), url or ""],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_redis(directory: Path) -> tuple[subprocess.Popen, str]:
    server = shutil.which("redis-server")
    if server is None:
        sys.exit("redis-server is not installed (Debian: apt-get install -y redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                                "--dir", str(directory)], stdout=subprocess.DEVNULL)
    for _ in range(200):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return process, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.02)
    sys.exit("redis-server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from aoti_eager.cache import signing

    with tempfile.TemporaryDirectory(prefix="aoti_eager-fleet-") as tmp:
        tmp = Path(tmp)
        signing.generate_key_pair(tmp / "fleet-key")
        os.environ["AOTI_EAGER_SIGNING_KEY"] = str(tmp / "fleet-key")
        os.environ["AOTI_EAGER_TRUSTED_KEYS"] = str(tmp / "fleet-key.pub")
        redis, url = start_redis(tmp)
        try:
            rows = []
            for workload in ("kernel", "model"):
                published = child(workload, tmp / "publisher", url)
                print(f"{workload}: publishing process compiled {published['compiles']} kernels", file=sys.stderr)
                local = [child(workload, tmp / "publisher", None) for _ in range(args.runs)]
                fleet = [child(workload, tmp / f"machine-{workload}-{i}", url) for i in range(args.runs)]
                for name, runs in (("warm local", local), ("warm fleet", fleet)):
                    # Both run what the publisher decided: kernels, and eager where it kept eager.
                    assert all(r["compiles"] == 0 and r["fallbacks"] == local[0]["fallbacks"] for r in runs), runs
                    rows.append((workload, name, statistics.median(r["ms"] for r in runs),
                                 [round(r["ms"], 1) for r in runs], runs[0]["loads"]))
                cold = child(workload, tmp / f"cold-{workload}", None)
                rows.append((workload, "cold local", cold["ms"], [round(cold["ms"], 1)], cold["loads"]))
        finally:
            redis.kill()
    import torch

    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, loopback Redis")
    print(f"{'workload':<10}{'process':<12}{'median ms':>10}  {'runs ms':<24}{'loads':>6}")
    for workload, name, median, runs, loads in rows:
        print(f"{workload:<10}{name:<12}{median:>10.1f}  {str(runs):<24}{loads:>6}")
    for workload in ("kernel", "model"):
        local, fleet, cold = [r[2] for r in rows if r[0] == workload]
        print(f"{workload}: warm fleet - warm local = {fleet - local:+.1f} ms (target <= +150 ms); "
              f"warm fleet / cold local = {100 * fleet / cold:.1f}% (target <= 5%)")


if __name__ == "__main__":
    main()
