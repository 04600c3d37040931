"""First-call latency with compile="background" against eager.

Each round calls gelu on a shape no process has seen: with aoti_eager in
background mode (the miss builds the signature, looks in the cache, queues
the compile and runs the original kernel), then eagerly on another new
shape. A compile="now" first call would include the compile itself (seconds).

    python scripts/bench_background.py
"""

from __future__ import annotations

import statistics
import tempfile
import time

import torch

import aoti_eager


def first_call_ms(x: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.nn.functional.gelu(x)
    return (time.perf_counter() - start) * 1e3


def main(rounds: int = 5) -> None:
    torch.nn.functional.gelu(torch.randn(8))  # eager's own first-call costs, once
    with tempfile.TemporaryDirectory(prefix="aoti_eager-background-") as cache_dir:
        aoti_eager.enable(["aten::gelu"], devices=["cpu"], cache_dir=cache_dir, compile="background")
        torch.nn.functional.gelu(torch.randn(3))  # this cache's one-time set-up (compiler check)
        background, eager = [], []
        for i in range(rounds):
            aoti_eager.enable(["aten::gelu"], devices=["cpu"], cache_dir=cache_dir, compile="background")
            background.append(first_call_ms(torch.randn(64, 100 + i)))
            aoti_eager.disable()
            eager.append(first_call_ms(torch.randn(64, 200 + i)))
        queued = rounds + 1
    print(f"first call of a new signature, median of {rounds}: background {statistics.median(background):.2f} ms, "
          f"eager {statistics.median(eager):.2f} ms ({queued} compiles queued, none waited for)")


if __name__ == "__main__":
    main()
