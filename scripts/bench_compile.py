"""Compile time of one new signature, with the wrapper split and without.

Each measurement is a fresh process on a warm machine (the cache root, the
compiler checks and Inductor's precompiled headers already exist) that compiles
new signatures of ``abs`` through ``aoti_eager.enable``: its first compile pays
for the process's own warm-up, the later ones are what every further signature
costs. Processes with ``AOTI_EAGER_SPLIT_WRAPPER=0`` (AOTInductor's own build
of the wrapper) and with the split alternate, so both see the same machine load.

    python scripts/bench_compile.py [--device cpu|cuda] [--rounds 2] [--signatures 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, logging, sys, time, torch, aoti_eager
device, first_size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
records = []
class Stages(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("aoti_eager: compiled"):
            records.append(record.args[-1])
logging.getLogger("aoti_eager").addHandler(Stages())
logging.getLogger("aoti_eager").setLevel(logging.INFO)
aoti_eager.enable(["aten::abs.default"], devices=[device])
rows = []
for size in range(first_size, first_size + count):
    x = torch.randn(size, device=device)
    start = time.perf_counter()
    torch.abs(x)
    rows.append({"seconds": time.perf_counter() - start, "stages": records[-1] if records else ""})
print(json.dumps(rows))
"""


def compile_in_new_process(root: str, device: str, first_size: int, count: int, split: bool) -> list[dict]:
    env = {**os.environ, "AOTI_EAGER_CACHE_DIR": root, "AOTI_EAGER_SPLIT_WRAPPER": "1" if split else "0"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, device, str(first_size), str(count)], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--signatures", type=int, default=3, help="compiles per process")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as root:
        size = 1000
        warm_up = compile_in_new_process(root, args.device, size, 1, split=True)  # the shared part, built once
        size += 1
        runs: dict[str, list[list[dict]]] = {"inductor": [], "split": []}
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode].append(compile_in_new_process(root, args.device, size, args.signatures, split=mode == "split"))
                size += args.signatures
    summary = {
        mode: {
            "first_in_process_s": statistics.median(r[0]["seconds"] for r in rs),
            "further_signature_s": statistics.median(row["seconds"] for r in rs for row in r[1:]),
            "example_stages": rs[-1][-1]["stages"],
        }
        for mode, rs in runs.items()
    }
    result = {"torch": torch.__version__, "device": args.device, "first_ever_s": warm_up[0]["seconds"], **summary}
    if args.json:
        print(json.dumps(result))
        return
    print(f"torch {torch.__version__}, device {args.device}, {os.cpu_count()} cores; "
          f"the very first compile (shared part built): {warm_up[0]['seconds']:.1f} s")
    print(f"{'build':<10}{'first in process s':>20}{'further signature s':>21}  stages of the last compile")
    for mode, s in summary.items():
        print(f"{mode:<10}{s['first_in_process_s']:>20.1f}{s['further_signature_s']:>21.1f}  {s['example_stages']}")
    for key in ("first_in_process_s", "further_signature_s"):
        print(f"speed-up, {key[:-2].replace('_', ' ')}: {summary['inductor'][key] / summary['split'][key]:.2f}x")


if __name__ == "__main__":
    main()
