"""Fused regions (``aoti_eager.fuse``) against eager and ``torch.compile``, on
the transformers models of ``bench_models.py`` (built from configs, random
weights; the ``bench`` extra). Inference in eval mode under ``no_grad``; GPT-2
is a scoring forward (``use_cache=False``).

For each model, three questions, each side by side in one run:

- **Steady speed**: eager, the fused model and ``torch.compile(model)`` in
  alternating rounds (median seconds a forward), outputs against eager's, the
  compiles each region took and its calls that ran eagerly.
- **First forward** (``--first``): in new processes on empty caches (this
  project's, Inductor's and Triton's), the first call of ``fuse(model, compile="now")``
  against ``torch.compile(model)``'s first call; each process has run one
  eager forward before, so neither pays the device's start.
- **New process on a warm cache** (``--first``): the seconds from a new
  process's first eager forward to its result, against ``import aoti_eager``,
  ``fuse()`` and the first forward to its result, on the cache the first
  forward filled.

    python scripts/bench_regions.py [--device cpu|cuda] [--models gpt2,bert,vit] [--rounds 5] [--first]
        [--ops] [--cache-dir DIR]

``--ops`` also enables the per-op kernels of what runs outside the regions.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import transformers

import aoti_eager
from bench_models import max_difference, model_and_inputs
from timing import machine, per_call_seconds

MODELS = ("gpt2", "bert", "vit")


def forward_of(model: torch.nn.Module, inputs: dict[str, Any]) -> Callable[[], Any]:
    def forward() -> Any:
        with torch.no_grad():
            return model(**inputs)[0]
    return forward


def prepared(name: str, device: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    model, inputs = model_and_inputs(name, device)
    if name == "gpt2":
        inputs = {**inputs, "use_cache": False}
    return model.eval(), inputs


def region_rows() -> dict[str, dict[str, Any]]:
    return {name: row for name, row in aoti_eager.stats().items() if name.startswith("region::")}


def steady(name: str, device: str, rounds: int, cache_dir: str, ops: bool) -> dict[str, Any]:
    model, inputs = prepared(name, device)
    eager = forward_of(model, inputs)
    expected = eager()
    compiled = forward_of(torch.compile(model), inputs)
    compiled(), compiled()
    fused_model = copy.deepcopy(model)
    fused = forward_of(fused_model, inputs)
    if ops:
        aoti_eager.enable(aoti_eager.ops_reached(fused), devices=[device], cache_dir=cache_dir)
    aoti_eager.fuse(fused_model, compile="now", cache_dir=cache_dir)
    got = fused()
    fused()
    regions = region_rows()
    sides = {"eager": eager, "fused": fused, "torch.compile": compiled}
    times: dict[str, list[float]] = {side: [] for side in sides}
    for i in range(rounds):
        for side in list(sides)[i % 3:] + list(sides)[:i % 3]:  # each side goes first in turn
            times[side].append(per_call_seconds(sides[side], 3))
    aoti_eager.disable()
    return dict(
        name=name, difference=max_difference([got], [expected]),
        compiles=sum(r["compiles"] for r in regions.values()), regions=len(regions),
        fallbacks=sum(r["fallbacks"] for r in regions.values()),
        reasons=sorted({r["fallback_reason"] for r in regions.values() if r["fallback_reason"]}),
        **{side: statistics.median(t) for side, t in times.items()},
    )


def first_forward(name: str, device: str, mode: str, cache_dir: str) -> float:
    """Seconds to the first result of ``mode`` in this (new) process."""
    model, inputs = prepared(name, device)
    if mode in ("compile", "fuse"):
        forward_of(model, inputs)()  # the device's start, paid before timing
    synchronize(device)
    start = time.perf_counter()
    if mode == "compile":
        model = torch.compile(model)
    elif mode in ("fuse", "warm"):
        import aoti_eager as runtime  # its import counts in a new process
        runtime.fuse(model, compile="now", cache_dir=cache_dir)
    forward_of(model, inputs)()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def in_new_process(name: str, device: str, mode: str, cache_dir: str, inductor_dir: str) -> float:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir, "TRITON_CACHE_DIR": os.path.join(inductor_dir, "triton")}
    command = [sys.executable, __file__, "--child", json.dumps([name, device, mode, cache_dir])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def first_forwards(name: str, device: str, scratch: str) -> dict[str, float]:
    cache_dir, inductor = os.path.join(scratch, f"{name}-cache"), os.path.join(scratch, f"{name}-inductor")
    return {
        "compile": in_new_process(name, device, "compile", cache_dir, inductor + "-compile"),
        "fuse": in_new_process(name, device, "fuse", cache_dir, inductor),
        "eager, new process": in_new_process(name, device, "eager", cache_dir, inductor),
        "fused, new process": in_new_process(name, device, "warm", cache_dir, inductor),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--first", action="store_true", help="first forwards in new processes")
    parser.add_argument("--ops", action="store_true", help="per-op kernels outside the regions too")
    parser.add_argument("--cache-dir", default=None, help="default: a new empty cache")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    if args.child:
        print(first_forward(*json.loads(args.child)))
        return
    print(machine(args.device) + f", transformers {transformers.__version__}, threads {torch.get_num_threads()}")
    rows, firsts = [], {}
    with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as scratch:
        for name in args.models.split(","):
            if args.first:
                firsts[name] = first_forwards(name, args.device, scratch)
                print(f"{name}: first forwards (s): " + ", ".join(f"{k} {v:.2f}" for k, v in firsts[name].items()), flush=True)
            rows.append(steady(name, args.device, args.rounds, args.cache_dir or os.path.join(scratch, f"{name}-cache"), args.ops))
            print(table_row(rows[-1]), flush=True)
    print("\n| model | eager ms | fused ms | vs eager | torch.compile ms | vs eager | regions | compiles | eager calls | max diff vs eager (relative) |\n"
          + "| --- " * 10 + "|")
    for r in rows:
        print(table_row(r))
    for r in rows:
        for reason in r["reasons"]:
            print(f"{r['name']}: a region ran eagerly: {reason}")
    if firsts:
        print("\n| model | torch.compile first call s | fuse first call s | eager first forward, new process s | fuse() + first forward, warm cache, new process s | difference s |\n"
              + "| --- " * 6 + "|")
        for name, f in firsts.items():
            print(f"| {name} | {f['compile']:.2f} | {f['fuse']:.2f} | {f['eager, new process']:.2f} | {f['fused, new process']:.2f} | "
                  f"{f['fused, new process'] - f['eager, new process']:+.2f} |")


def table_row(r: dict[str, Any]) -> str:
    e = r["eager"]
    return (f"| {r['name']} | {e * 1e3:.2f} | {r['fused'] * 1e3:.2f} | {r['fused'] / e:.3f}x | {r['torch.compile'] * 1e3:.2f} | "
            f"{r['torch.compile'] / e:.3f}x | {r['regions']} | {r['compiles']} | {r['fallbacks']} | {r['difference']:.1e} |")


if __name__ == "__main__":
    main()
