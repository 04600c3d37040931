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

``--ops`` fuses with the one call ``fuse(model, ops=ops_reached(...))``: the
per-op kernels of what runs outside the regions too, enabled for the fused
side's rounds only (and its first forwards).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch
import transformers

import aoti_eager
from bench_models import max_difference, model_and_inputs
from timing import alternating, machine, timed, timed_enabled

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


COUNTS = ("calls", "hits", "fallbacks", "compiles", "cache_loads")


def region_rows(since: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """The regions' rows of stats(), their counts those since the rows ``since``
    (a region's counts are the process's, whatever model its class is in)."""
    gc.collect()  # the rows of models let go of (transformers' models hold cycles) leave stats()
    rows = {name: dict(row) for name, row in aoti_eager.stats().items() if name.startswith("region::")}
    for name, row in rows.items():
        row.update({k: row[k] - since.get(name, {}).get(k, 0) for k in COUNTS} if since else {})
    return rows


def steady(name: str, model: torch.nn.Module, inputs: dict[str, Any], device: str, rounds: int, cache_dir: str,
           ops: bool) -> dict[str, Any]:
    """Eager, ``fuse(model, ops=...)`` (the ops reached, with ``ops``) and
    ``torch.compile(model)`` in alternating rounds, with what the regions did."""
    eager = forward_of(model, inputs)
    expected = eager()
    compiled = forward_of(torch.compile(model), inputs)
    compiled_result = compiled()
    compiled()
    fused_model = copy.deepcopy(model)
    fused = forward_of(fused_model, inputs)
    reached = aoti_eager.ops_reached(fused) if ops else []
    aoti_eager.fuse(fused_model, ops=reached, compile="now", cache_dir=cache_dir)
    since = region_rows()
    got = fused()
    fused()
    aoti_eager.disable()  # the ops are enabled for the fused side's rounds only: the others run eager's kernels
    regions = region_rows(since)
    times = alternating({
        "eager": lambda: timed(eager, 3),
        "fused": lambda: timed_enabled(fused, reached, 3, devices=[device], cache_dir=cache_dir),
        "torch.compile": lambda: timed(compiled, 3),
    }, rounds)
    return dict(
        name=name, difference=max_difference([got], [expected]), rows=regions, ops=len(reached),
        compile_difference=max_difference([compiled_result], [expected]),
        compiles=sum(r["compiles"] for r in regions.values()), regions=len(regions),
        fallbacks=sum(r["fallbacks"] for r in regions.values()),
        reasons=sorted({r["fallback_reason"] for r in regions.values() if r["fallback_reason"]}),
        **times,
    )


def first_forward(model: torch.nn.Module, inputs: dict[str, Any], device: str, mode: str, cache_dir: str) -> float:
    """Seconds to the first result of ``mode`` in this (new) process: ``eager``,
    ``compile`` (``torch.compile``), ``fuse`` (on an empty cache) or ``warm``
    (a cache an earlier ``fuse`` filled), ``fuse+ops``/``warm+ops`` with the ops
    reached (the one call ``fuse(model, ops=ops_reached(...))``)."""
    forward = forward_of(model, inputs)
    if mode in ("compile", "fuse", "fuse+ops"):
        forward()  # the device's start, paid before timing
    synchronize(device)
    start = time.perf_counter()
    if mode == "compile":
        forward = forward_of(torch.compile(model), inputs)
    elif mode != "eager":
        import aoti_eager as runtime  # its import counts in a new process
        runtime.fuse(model, ops=runtime.ops_reached(forward) if mode.endswith("+ops") else None,
                     compile="now", cache_dir=cache_dir)
    forward()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def in_new_process(script: str, name: str, device: str, mode: str, cache_dir: str, inductor_dir: str,
                   timeout: float | None = None) -> float:
    """:func:`first_forward` of ``script --child`` in a new process, Inductor's
    and Triton's caches in ``inductor_dir``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": inductor_dir, "TRITON_CACHE_DIR": os.path.join(inductor_dir, "triton")}
    command = [sys.executable, script, "--child", json.dumps([name, device, mode, cache_dir])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=timeout)
    return float(done.stdout.strip().splitlines()[-1])


def first_forwards(script: str, name: str, device: str, scratch: str, ops: bool = False,
                   timeout: float | None = None) -> dict[str, float]:
    """First forwards of ``name`` in new processes, each run of ``script``:
    ``torch.compile`` and ``fuse`` on empty caches, then eager and ``fuse`` on
    the cache that filled."""
    cache_dir, inductor = os.path.join(scratch, f"{name}-cache"), os.path.join(scratch, f"{name}-inductor")
    suffix = "+ops" if ops else ""
    return {
        what: in_new_process(script, name, device, mode, cache_dir, inductor + ("-compile" if mode == "compile" else ""), timeout)
        for what, mode in (("compile", "compile"), ("fuse", "fuse" + suffix), ("eager, new process", "eager"),
                           ("fused, new process", "warm" + suffix))
    }


def child(argument: str, prepare: Callable[[str, str], tuple[torch.nn.Module, dict[str, Any]]]) -> None:
    """A ``--child`` process of :func:`in_new_process`: prints the seconds."""
    name, device, mode, cache_dir = json.loads(argument)
    print(first_forward(*prepare(name, device), device, mode, cache_dir))


def options(description: str, models: tuple[str, ...]) -> argparse.ArgumentParser:
    """The options of this script and of the zoo's: ``--device``, ``--models``, ``--rounds``, ``--first``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", default=",".join(models))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--first", action="store_true", help="first forwards in new processes on empty caches")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def started(args: argparse.Namespace, prepare: Callable[[str, str], tuple[torch.nn.Module, dict[str, Any]]]) -> bool:
    """False in a ``--child`` process, which has run its first forward;
    else True, the machine's line printed."""
    transformers.logging.set_verbosity_error()
    if args.child:
        child(args.child, prepare)
        return False
    print(machine(args.device) + f", transformers {transformers.__version__}, threads {torch.get_num_threads()}")
    return True


def main() -> None:
    parser = options(__doc__, MODELS)
    parser.add_argument("--ops", action="store_true", help="per-op kernels outside the regions too")
    parser.add_argument("--cache-dir", default=None, help="default: a new empty cache")
    args = parser.parse_args()
    if not started(args, prepared):
        return
    rows, firsts = [], {}
    with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as scratch:
        for name in args.models.split(","):
            if args.first:
                firsts[name] = first_forwards(__file__, name, args.device, scratch, args.ops)
                print(f"{name}: first forwards (s): " + ", ".join(f"{k} {v:.2f}" for k, v in firsts[name].items()), flush=True)
            rows.append(steady(name, *prepared(name, args.device), args.device, args.rounds,
                               args.cache_dir or os.path.join(scratch, f"{name}-cache"), args.ops))
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
