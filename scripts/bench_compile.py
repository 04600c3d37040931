"""Compile time of one new signature, stage by stage, against another commit.

Each measurement is a fresh process on a warm machine (the compiler checks,
Inductor's precompiled headers and the shared wrapper half already exist) that
compiles new signatures of ``abs`` through ``aoti_eager.enable``: its first
compile pays for the process's own warm-up, the later ones are what every
further signature costs. Every size is new and compiles a static kernel of its
own (``AOTI_EAGER_DYNAMIC_SHAPES=0``: otherwise the second size would compile
a dynamic kernel that serves the rest).

With ``--baseline``, a checkout of another commit (``git worktree add DIR
COMMIT``) compiles in the same run, in alternating processes, so that both see
the same machine load: on a shared machine compile times scale with the load,
so only the two side by side count. The load average is printed with them.

Stages (medians, seconds): ``export``; ``lowering`` (Inductor in Python,
including its start-up on a first compile); ``header`` (Inductor hashing and
precompiling headers); ``kernel`` (the kernel file's compile, beside the
wrapper's); ``wrapper`` (what the wrapper took beyond that); ``constants``;
``link``; ``load``; ``other`` (everything else of the call: eager's reference
result, the check against eager, the timing against eager, publication).

    python scripts/bench_compile.py [--device cpu|cuda] [--rounds 3] [--signatures 3] [--baseline DIR] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, sys, time, torch, aoti_eager
from aoti_eager import _runtime
device, first_size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
outcomes = []
def recorded(*args, **kwargs):
    outcome = compile_signature(*args, **kwargs)
    outcomes.append(outcome)
    return outcome
# Where the miss path calls the pipeline: the runtime's mechanism, or (in older trees) the runtime.
caller = sys.modules.get("aoti_eager._mechanism", _runtime)
compile_signature, caller.compile_signature = caller.compile_signature, recorded
aoti_eager.enable(["aten::abs.default"], devices=[device])
rows = []
for size in range(first_size, first_size + count):
    x = torch.randn(size, device=device)
    start = time.perf_counter()
    torch.abs(x)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    stages = dict(getattr(outcomes[-1], "stages", {}) or {}) if outcomes else {}
    stages["other"] = seconds - sum(stages.values())
    rows.append({"seconds": seconds, "stages": stages})
print(json.dumps(rows))
"""


def package_overlay(checkout: Path, into: Path) -> Path:
    """A directory for PYTHONPATH in which ``checkout``'s package is laid out
    as installed (its kernels/, cache/ and csrc/ inside aoti_eager/): it comes
    before this tree's editable install."""
    package = into / "aoti_eager"
    shutil.copytree(checkout / "aoti_eager", package, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("kernels", "cache", "csrc"):
        shutil.copytree(checkout / part, package / part, ignore=shutil.ignore_patterns("__pycache__"))
    return into


def compile_in_new_process(root: Path, device: str, first_size: int, count: int, pythonpath: Path | None) -> list[dict]:
    env = {**os.environ, "AOTI_EAGER_CACHE_DIR": str(root), "AOTI_EAGER_DYNAMIC_SHAPES": "0"}
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, device, str(first_size), str(count)], env=env, capture_output=True, text=True,
        cwd=tempfile.gettempdir(),  # not this tree: its aoti_eager/ would come first on sys.path
    )
    if out.returncode != 0:
        raise RuntimeError(f"the compiling process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def medians(rows: list[dict]) -> dict:
    stages = sorted({stage for row in rows for stage in row["stages"]})
    return {
        "seconds": statistics.median(row["seconds"] for row in rows),
        "stages": {s: statistics.median(row["stages"].get(s, 0.0) for row in rows) for s in stages},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=3, help="processes per tree")
    parser.add_argument("--signatures", type=int, default=3, help="compiles per process")
    parser.add_argument("--baseline", type=Path, help="a checkout of the commit to compare with")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import torch

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as scratch:
        trees: dict[str, Path | None] = {"this tree": None}
        if args.baseline is not None:
            trees["baseline"] = package_overlay(args.baseline.resolve(), Path(scratch) / "baseline")
        size = 1000 + 1000 * (os.getpid() % 50)  # sizes no Inductor cache has seen
        first_ever, runs = {}, {name: [] for name in trees}
        for name, path in trees.items():  # each tree's shared pieces (headers, wrapper half) built once
            first_ever[name] = compile_in_new_process(Path(scratch, name), args.device, size, 1, path)[0]["seconds"]
            size += 1
        for _ in range(args.rounds):
            for name, path in trees.items():
                runs[name].append(compile_in_new_process(Path(scratch, name), args.device, size, args.signatures, path))
                size += args.signatures
    load_after = os.getloadavg()
    result = {
        "torch": torch.__version__, "device": args.device, "cores": os.cpu_count(),
        "load_average_1_5_15": {"before": load_before, "after": load_after},
        "trees": {
            name: {
                "first_ever_s": first_ever[name],
                "first_in_process": medians([r[0] for r in rs]),
                "further_signature": medians([row for r in rs for row in r[1:]]),
            }
            for name, rs in runs.items()
        },
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"torch {torch.__version__}, device {args.device}, {os.cpu_count()} cores; load average "
          f"{' '.join(f'{l:.2f}' for l in load_before)} before, {' '.join(f'{l:.2f}' for l in load_after)} after")
    for which in ("first_in_process", "further_signature"):
        print(f"\n{which.replace('_', ' ')}: medians of {args.rounds} processes, seconds")
        stages = sorted({s for tree in result["trees"].values() for s in tree[which]["stages"]})
        print(f"{'tree':<12}{'total':>8}" + "".join(f"{s:>11}" for s in stages))
        for name, tree in result["trees"].items():
            row = tree[which]
            print(f"{name:<12}{row['seconds']:>8.2f}" + "".join(f"{row['stages'].get(s, 0.0):>11.2f}" for s in stages))


if __name__ == "__main__":
    main()
