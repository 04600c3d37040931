"""A fused GPT-2 (Hugging Face transformers) over several sequence lengths
from a cold cache, with its blocks' dynamic kernels and without them
(``AOTI_EAGER_DYNAMIC_SHAPES=0``: a kernel per length): compiles, seconds of
the first forward at each length in all, outputs against eager's, and a
warm forward's time against eager at one length.

The model is built from a config (random weights, nothing downloaded); each
mode fuses its own copy with an empty cache. Needs the ``bench`` extra:
``pip install -e '.[bench]'``.

    python scripts/bench_region_lengths.py [--layers 4] [--hidden 256] [--batch 4]
        [--lengths 64,96,128,160,192] [--rounds 21] [--json]

Target: two compiles for any number of lengths (the first length's static
kernel, then one dynamic kernel), every output equal to eager's.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from typing import Any

import torch

import aoti_eager
from aoti_eager import settings


def _median_seconds(run: Any, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[rounds // 2]


def measure(eager: torch.nn.Module, lengths: list[int], batch: int, rounds: int) -> dict[str, Any]:
    """A fused copy of ``eager`` called at each of ``lengths`` from a cold cache."""
    model = copy.deepcopy(eager)
    aoti_eager.fuse(model, cache_dir=tempfile.mkdtemp())
    name = f"region::{type(eager.transformer.h[0]).__module__}.{type(eager.transformer.h[0]).__qualname__}"
    before = aoti_eager.stats()[name]  # a process's counts go on from one model to the next
    first = 0.0
    with torch.no_grad():
        for length in lengths:
            ids = torch.randint(0, eager.config.vocab_size, (batch, length))
            start = time.perf_counter()
            logits = model(ids, use_cache=False).logits
            first += time.perf_counter() - start
            torch.testing.assert_close(logits, eager(ids, use_cache=False).logits)
        ids = torch.randint(0, eager.config.vocab_size, (batch, lengths[len(lengths) // 2]))
        fused = _median_seconds(lambda: model(ids, use_cache=False), rounds)
        reference = _median_seconds(lambda: eager(ids, use_cache=False), rounds)
    row = {k: v - before[k] for k, v in aoti_eager.stats()[name].items() if k in ("compiles", "hits", "fallbacks")}
    aoti_eager.unfuse(model)
    return {**row, "first_forwards_s": round(first, 2), "warm_ms": round(fused * 1e3, 2), "eager_ms": round(reference * 1e3, 2),
            "ratio": round(fused / reference, 3)}


def main() -> None:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lengths", default="64,96,128,160,192")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64, vocab_size=1000,
                                     n_positions=max(lengths))
    eager = transformers.GPT2LMHeadModel(config).eval()
    results = {"dynamic": measure(eager, lengths, args.batch, args.rounds)}
    with settings.dynamic_shapes.set_to("0"):
        results["a kernel per length"] = measure(eager, lengths, args.batch, args.rounds)
    if args.json:
        print(json.dumps(results))
        return
    print(f"GPT-2 {args.layers} x {args.hidden}, batch {args.batch}, lengths {lengths}, torch {torch.__version__}")
    for mode, r in results.items():
        print(f"{mode:>20}: {r['compiles']} compiles, first forwards {r['first_forwards_s']} s, hits {r['hits']}, "
              f"fallbacks {r['fallbacks']}; warm {r['warm_ms']} ms against eager {r['eager_ms']} ms ({r['ratio']}x)")


if __name__ == "__main__":
    main()
