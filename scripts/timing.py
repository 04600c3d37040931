"""Side-by-side timing of a callable with aoti_eager enabled and disabled."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

import aoti_eager


def machine(device: str) -> str:
    """A benchmark's first line: the torch version and the device (the GPU's name on CUDA)."""
    return f"torch {torch.__version__}, device {device}" + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else "")


def per_call_seconds(fn: Callable[[], object], calls: int) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def alternating(sides: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median seconds of each side over ``rounds``, each side going first in
    turn so that all see the same machine load; a side returns its round's seconds."""
    names = list(sides)
    times: dict[str, list[float]] = {side: [] for side in names}
    for i in range(rounds):
        for side in names[i % len(names):] + names[:i % len(names)]:
            times[side].append(sides[side]())
    return {side: statistics.median(t) for side, t in times.items()}


def timed(fn: Callable[[], object], calls: int) -> float:
    """Per-call seconds of ``fn`` after one untimed call, which warms what
    the other sides' rounds left cold (and loads decisions)."""
    fn()
    return per_call_seconds(fn, calls)


def timed_enabled(fn: Callable[[], object], ops: list, calls: int, **enable_kwargs) -> float:
    """:func:`timed` with ``ops`` enabled for the round only: the other sides run eager's kernels."""
    aoti_eager.enable(ops, **enable_kwargs)
    try:
        return timed(fn, calls)
    finally:
        aoti_eager.disable()


def compare(fn: Callable[[], object], ops: list, calls: int, rounds: int = 7, **enable_kwargs) -> tuple[float, float]:
    """Median per-call seconds of ``fn`` with ``ops`` enabled and with eager.

    Rounds alternate between the two so that both see the same machine load.
    """
    aoti_eager.enable(ops, **enable_kwargs)
    fn(), fn()  # decide every signature (compile or load) before timing
    aoti_eager.disable()
    compiled, eager = [], []
    for _ in range(rounds):
        aoti_eager.enable(ops, **enable_kwargs)
        fn()  # reload the decisions from the cache
        compiled.append(per_call_seconds(fn, calls))
        aoti_eager.disable()
        eager.append(per_call_seconds(fn, calls))
    return statistics.median(compiled), statistics.median(eager)


def total_compiles() -> int:
    """Kernels compiled since the ops were enabled, over every enabled op."""
    return sum(s["compiles"] for s in aoti_eager.stats().values())


def warm_rounds(fn: Callable[[], object], ops: list, rounds: int, **enable_kwargs) -> dict:
    """Median seconds of ``fn`` with ``ops`` enabled and of eager's, in
    alternating rounds, for a workload whose signatures were decided by an
    earlier (cold) run on the same cache.

    Each round enables the ops again, so its first call of ``fn`` loads the
    decisions from the cache (and compiles what the earlier process kept only
    in memory); the second is timed, and should compile nothing.
    """
    enabled, eager, reloads, timed_compiles = [], [], [], 0
    for _ in range(rounds):
        aoti_eager.enable(ops, **enable_kwargs)
        fn()
        reloads.append(total_compiles())  # counted from this enable()
        enabled.append(per_call_seconds(fn, 1))
        timed_compiles += total_compiles() - reloads[-1]
        aoti_eager.disable()
        eager.append(per_call_seconds(fn, 1))
    return dict(
        warm_s=statistics.median(enabled), eager_s=statistics.median(eager),
        warm_ratio=statistics.median(enabled) / statistics.median(eager),
        reload_compiles=sum(reloads), reload_compiles_per_round=reloads, timed_compiles=timed_compiles,
    )
