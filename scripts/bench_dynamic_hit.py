"""Hit time of a dynamic-shape kernel against a static kernel compiled for the
call's exact shape, for add, softmax and layer_norm at three row counts.

Each kind of kernel gets its own cache. The static cache is filled with
``AOTI_EAGER_DYNAMIC_SHAPES=0``: each measured shape compiles its own kernel.
The dynamic cache is filled by calls at two other row counts: the second
compiles the op's dynamic kernel, whose row dim is symbolic; the measured
shapes must then be served by it with no further compile or miss, which the
script checks (it stops where they are not: the timing would mean nothing).

Then each shape is timed served by the static kernel, by the dynamic kernel
and by eager, one right after the other, in rounds in one process: times are
medians of the rounds, ratios medians of each round's ratio (the pair is
timed within a second, so load that comes and goes weighs on both alike),
with their interquartile range. Each measurement enables the op again on its
variant's cache: within one process the C++ override tries a call's exact
key before the dynamic kernels, so one cache per variant is the only way to
be sure which kernel runs. The dynamic variant first calls the second seed
shape, which loads the dynamic kernel, so the measured shape never misses:
each call goes through the exact lookup, finds nothing, and is served by the
dynamic kernel's guards, as a shape the process has not seen is.

Kernels are not timed against eager when they are compiled
(``AOTI_EAGER_KEEP_FASTER=0``, set by the script): a signature kept eager as
faster would leave no kernel to time. A CPU kernel's threads are fixed when it
is compiled, from the shape it is compiled at (a dynamic kernel's: the second
seed's), and the cache does not key on the thread count: caches filled with
one ``OMP_NUM_THREADS`` are not for timing another. On a CPU shared with other
work, ``OMP_NUM_THREADS=1`` gives steadier ratios: an OpenMP region waits for
threads that the other work holds.

    python scripts/bench_dynamic_hit.py [--device cpu|cuda] [--rounds 7] [--min-time 0.1]
        [--seed-rows 24 40] [--cache-dir DIR] [--json]

Target: the dynamic kernel's time at most 1.1x the static kernel's for every
op and size. Cases above it are flagged, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ["AOTI_EAGER_KEEP_FASTER"] = "0"  # read at each compile; set before any

import torch
import torch.nn.functional as F

import aoti_eager
from aoti_eager import settings
from timing import machine, per_call_seconds

TARGET = 1.1
WIDTH = 1024  # the last dim, fixed: only the row count moves
ROWS = (8, 512, 8192)  # measured: launch-bound, cache-sized and bandwidth-bound calls
OPS = {"add": "aten::add.Tensor", "softmax": "aten::_softmax.default", "layer_norm": "aten::native_layer_norm.default"}
# As stats() and the cache name them: a default overload without ".default".
NAMES = {op: overload.removesuffix(".default") for op, overload in OPS.items()}
VARIANTS = ("static", "dynamic", "eager")


def make_call(op: str, rows: int, device: str) -> Callable[[], torch.Tensor]:
    x = torch.randn(rows, WIDTH, device=device)
    if op == "add":
        y = torch.randn(rows, WIDTH, device=device)
        return lambda: torch.add(x, y)
    if op == "softmax":
        return lambda: torch.softmax(x, -1)
    weight, bias = torch.randn(WIDTH, device=device), torch.randn(WIDTH, device=device)
    return lambda: F.layer_norm(x, (WIDTH,), weight, bias)


@dataclass
class Case:
    op: str
    rows: int
    fn: Callable[[], torch.Tensor]
    calls: int = 1  # per measurement, so that one takes about --min-time

    @property
    def name(self) -> str:
        return f"{self.op} {self.rows}x{WIDTH}"


def counts(op: str) -> dict[str, int]:
    """The counters of ``stats()`` for ``op`` (zeros where it is not enabled)."""
    row = aoti_eager.stats().get(NAMES[op], {})
    return {k: row.get(k, 0) for k in ("compiles", "cache_loads", "misses", "hits", "fallbacks")}


def did(op: str, fn: Callable[[], object]) -> dict[str, int]:
    """What ``fn`` added to ``op``'s counters."""
    before = counts(op)
    fn()
    return {k: v - before[k] for k, v in counts(op).items()}


def require(ok: bool, message: str) -> None:
    if not ok:
        reasons = {name: s["fallback_reason"] for name, s in aoti_eager.stats().items() if s["fallback_reason"]}
        raise SystemExit(f"bench_dynamic_hit: {message}" + (f"; eager because: {reasons}" if reasons else ""))


def kernel_from(op: str, fn: Callable[[], object], what: str) -> None:
    """Requires that ``fn``'s first call gets a kernel (compiled, or loaded
    from the cache of an earlier run) and its second runs it."""
    first = did(op, fn)
    require(first["compiles"] + first["cache_loads"] == 1 and not first["fallbacks"],
            f"{what}: no kernel was compiled or loaded ({first})")
    require(did(op, fn)["hits"] == 1, f"{what}: the second call did not run the kernel")


def listed(root: Path) -> list[dict]:
    """The cache's entries, as ``aoti-eager cache list --json`` gives them."""
    command = [sys.executable, "-m", "aoti_eager", "--cache-dir", str(root), "cache", "list", "--json"]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


def fill_static(cases: list[Case], enable_kwargs: dict) -> None:
    with settings.dynamic_shapes.set_to("0"):
        aoti_eager.enable(list(OPS.values()), **enable_kwargs)
        for case in cases:
            kernel_from(case.op, case.fn, f"static {case.name}")
        aoti_eager.disable()
    dynamic = [e["signature"] for e in listed(enable_kwargs["cache_dir"]) if e["dynamic"]]
    require(not dynamic, f"the static cache holds dynamic kernels: {dynamic}")


def fill_dynamic(cases: list[Case], seeds: list[Case], enable_kwargs: dict) -> dict[str, str]:
    """Compiles (or loads) each op's dynamic kernel from its two seed shapes
    (the first compiles a static kernel) and requires that it serves every
    measured shape; its signature by op."""
    aoti_eager.enable(list(OPS.values()), **enable_kwargs)
    for seed in seeds:
        kernel_from(seed.op, seed.fn, f"dynamic cache, {seed.name}")
    for case in cases:
        served = did(case.op, case.fn)
        require(served == dict(compiles=0, cache_loads=0, misses=0, hits=1, fallbacks=0),
                f"{case.name} is not served by the dynamic kernel ({served})")
    aoti_eager.disable()
    kernels = {e["op"]: e["signature"] for e in listed(enable_kwargs["cache_dir"]) if e["dynamic"]}
    require(sorted(kernels) == sorted(NAMES.values()), f"dynamic kernels in the cache: {kernels}, expected one per op")
    return kernels


def timed(case: Case, variant: str, warm: Callable[[], object], enable_kwargs: dict | None) -> float:
    """Per-call seconds of ``case`` with its op enabled on a cache (eager where
    ``enable_kwargs`` is None). ``warm`` is called first: its miss loads the
    kernel; every call of the case must then be a hit. For the dynamic
    variant that is the dynamic kernel: the case's shape has no exact entry
    in an override that it never missed."""
    if enable_kwargs is None:
        warm()
        return per_call_seconds(case.fn, case.calls)
    aoti_eager.enable(OPS[case.op], **enable_kwargs)
    warm()
    before = counts(case.op)
    case.fn()  # untimed, as eager's warm call is
    seconds = per_call_seconds(case.fn, case.calls)
    after = counts(case.op)
    aoti_eager.disable()
    require(after["compiles"] == 0 and after["misses"] == before["misses"] and after["hits"] - before["hits"] == case.calls + 1,
            f"{variant}, {case.name}: not every timed call was a hit ({before} -> {after})")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed-rows", type=int, nargs=2, default=[24, 40],
                        help="the row counts whose calls make the dynamic kernel (it is compiled at the second)")
    parser.add_argument("--min-time", type=float, default=0.1, help="seconds a measurement takes, about")
    parser.add_argument("--cache-dir", default=None, help="holds the two caches, static/ and dynamic/ (default: new empty ones)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    cases = [Case(op, rows, make_call(op, rows, args.device)) for op in OPS for rows in ROWS]
    seeds = [Case(op, rows, make_call(op, rows, args.device)) for op in OPS for rows in args.seed_rows]
    require(len(set(args.seed_rows)) == 2 and not set(args.seed_rows) & set(ROWS),
            f"the two seed rows must differ from each other and from the measured {ROWS}")
    for case in cases:
        case.calls = max(3, round(args.min_time / per_call_seconds(case.fn, 3)))

    with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as scratch:
        root = Path(args.cache_dir or scratch)
        on = {variant: dict(devices=[args.device], cache_dir=root / variant) for variant in ("static", "dynamic")}
        fill_static(cases, on["static"])
        kernels = fill_dynamic(cases, seeds, on["dynamic"])
        loads_dynamic = {seed.op: seed.fn for seed in seeds[1::2]}  # each op's second seed
        times = {variant: [[] for _ in cases] for variant in VARIANTS}
        for r in range(args.rounds):
            for i, case in enumerate(cases):
                # Each variant takes each place in turn: load that drifts weighs on all alike.
                for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                    warm = loads_dynamic[case.op] if variant == "dynamic" else case.fn
                    times[variant][i].append(timed(case, variant, warm, on.get(variant)))

    rows = []
    for i, case in enumerate(cases):
        us = {variant: statistics.median(times[variant][i]) * 1e6 for variant in VARIANTS}
        ratios = [d / s for d, s in zip(times["dynamic"][i], times["static"][i])]
        ratio = statistics.median(ratios)
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratio] * 3
        rows.append(dict(
            op=NAMES[case.op], case=case.name, rows=case.rows, width=WIDTH, calls=case.calls,
            static_us=us["static"], dynamic_us=us["dynamic"], eager_us=us["eager"],
            dynamic_over_static=ratio, dynamic_over_static_iqr=[quartiles[0], quartiles[2]],
            static_over_eager=statistics.median(s / e for s, e in zip(times["static"][i], times["eager"][i])),
            above_target=ratio > TARGET,
            rounds_us={variant: [t * 1e6 for t in times[variant][i]] for variant in VARIANTS},
        ))
    if args.json:
        print(json.dumps(dict(device=args.device, torch=torch.__version__, threads=torch.get_num_threads(), rounds=args.rounds,
                              seed_rows=args.seed_rows, target=TARGET, dynamic_kernels=kernels, cases=rows)))
        return
    print(f"{machine(args.device)}, threads {torch.get_num_threads()}")
    for op, signature in kernels.items():
        print(f"dynamic kernel: {op} ({signature})")
    print(f"seed rows {args.seed_rows[0]}, {args.seed_rows[1]}; median of {args.rounds} rounds")
    print(f"{'case':<20}{'static us':>11}{'dynamic us':>12}{'eager us':>10}{'dyn/static':>12}{'(IQR)':>12}{'static/eager':>14}")
    for r in rows:
        flag = f"  above {TARGET}x" if r["above_target"] else ""
        iqr = "{:.2f}-{:.2f}".format(*r["dynamic_over_static_iqr"])
        print(f"{r['case']:<20}{r['static_us']:>11.2f}{r['dynamic_us']:>12.2f}{r['eager_us']:>10.2f}"
              f"{r['dynamic_over_static']:>12.2f}{iqr:>12}{r['static_over_eager']:>14.2f}{flag}")
    above = [r["case"] for r in rows if r["above_target"]]
    print(f"dynamic above {TARGET}x the static kernel: {', '.join(above) or 'none'}")


if __name__ == "__main__":
    main()
