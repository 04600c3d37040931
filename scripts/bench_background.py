"""Calls with compile="background" against eager, before their kernel is ready.

- The first call of a new signature: each round calls gelu on a shape no
  process has seen, with aoti_eager in background mode (the miss builds the
  signature, looks in the cache, queues the compile and runs the original
  kernel), then eagerly on another new shape. A compile="now" first call
  would include the compile itself (seconds).
- The calls after it, while the kernel compiles: abs of 128 floats, in rounds
  of calls timed while the compile runs (the script checks that none was
  served by the kernel), against eager's rounds before enabling and after.

    python scripts/bench_background.py [--device cpu|cuda] [--rounds 5] [--calls 2000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import aoti_eager
from timing import machine, per_call_seconds


def first_call_ms(x: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.nn.functional.gelu(x)
    return (time.perf_counter() - start) * 1e3


def first_calls(device: str, rounds: int) -> None:
    new = lambda n: torch.randn(64, n, device=device)  # noqa: E731
    torch.nn.functional.gelu(new(8))  # eager's own first-call costs, once
    with tempfile.TemporaryDirectory(prefix="aoti_eager-background-") as cache_dir:
        aoti_eager.enable(["aten::gelu"], devices=[device], cache_dir=cache_dir, compile="background")
        torch.nn.functional.gelu(new(3))  # this cache's one-time set-up (compiler check)
        background, eager = [], []
        for i in range(rounds):
            aoti_eager.enable(["aten::gelu"], devices=[device], cache_dir=cache_dir, compile="background")
            background.append(first_call_ms(new(100 + i)))
            aoti_eager.disable()
            eager.append(first_call_ms(new(200 + i)))
    print(f"first call of a new signature, median of {rounds}: background {statistics.median(background):.2f} ms, "
          f"eager {statistics.median(eager):.2f} ms ({rounds + 1} compiles queued, none waited for)")


def calls_while_compiling(device: str, rounds: int, calls: int) -> None:
    x = torch.randn(128, device=device)
    call = lambda: torch.abs(x)  # noqa: E731
    per_call_seconds(call, calls)  # warm-up
    eager = [per_call_seconds(call, calls) for _ in range(rounds)]
    with tempfile.TemporaryDirectory(prefix="aoti_eager-background-") as cache_dir:
        with aoti_eager.enabled(["aten::abs"], devices=[device], cache_dir=cache_dir, compile="background"):
            call()  # queues the compile
            compiling = [per_call_seconds(call, calls) for _ in range(rounds)]
            stats = aoti_eager.stats()["aten::abs"]
    if stats["hits"] or stats["cache_loads"]:
        raise SystemExit(f"the kernel arrived while the calls were timed: {stats}")
    eager += [per_call_seconds(call, calls) for _ in range(rounds)]
    eager_us, compiling_us = statistics.median(eager) * 1e6, statistics.median(compiling) * 1e6
    print(f"calls while the kernel compiles, abs of 128 floats, {rounds} rounds of {calls}: eager {eager_us:.2f} us, "
          f"background {compiling_us:.2f} us ({compiling_us / eager_us:.2f}x); "
          f"calls that asked Python: {stats['misses']} of {stats['calls']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="calls per round while compiling")
    args = parser.parse_args()
    print(machine(args.device))
    first_calls(args.device, args.rounds)
    calls_while_compiling(args.device, args.rounds, args.calls)


if __name__ == "__main__":
    main()
