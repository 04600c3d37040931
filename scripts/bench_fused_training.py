"""A GPT-2 training step through fused regions, against eager and torch.compile.

Copies of one GPT-2 (transformers, built from a config: the ``bench`` extra;
fp32 weights) train from one initial state on one batch, each with its
AdamW(foreach=True): the forward as users call it (labels; the config's
``use_cache``), ``backward()``, ``clip_grad_norm_``, the optimizer step.
Sides: eager; ``aoti_eager.fuse`` (each block's forward and backward
compiled, on an empty cache); ``torch.compile`` of the model. Per side: the
median ms a step over alternating rounds of ``--calls`` steps, against
eager's; the peak memory a step allocates (CUDA); the first step's seconds
(compiles included); the losses of ``--steps`` steps against eager's
(dropout 0: the largest relative difference of a step's loss; else the mean
of the last ten steps' losses, relative). ``--autocast``: the steps run
under ``torch.autocast`` in bf16. Then new processes' first steps (``--first
SIDE --cache-dir DIR`` is such a process): eager's; fused on the warm cache
and on an empty one; torch.compile's on empty caches of its own (Inductor's
and Triton's). The machine's one-time set-up (the extension's build, the
compiler's probe) is done by then, as ``aoti-eager doctor`` does it.

    python scripts/bench_fused_training.py [--device cuda] [--layers 6] [--width 768] [--batch 8] [--length 256]
        [--dropout 0.0] [--autocast] [--steps 50] [--rounds 5] [--calls 10]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import torch

import aoti_eager
from timing import alternating, machine, per_call_seconds


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor]:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64),
                                     resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout)
    model = transformers.GPT2LMHeadModel(config).to(args.device).train()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.length), device=args.device)
    return model, ids


def trainer(model: torch.nn.Module, ids: torch.Tensor, autocast: bool, forward: Callable[..., Any] | None = None):
    """One training step of ``model`` per call (through ``forward``, default the model): its loss."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    forward = model if forward is None else forward
    device = ids.device.type

    def step() -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def sides(base: torch.nn.Module, ids: torch.Tensor, args: argparse.Namespace, cache_dir: str) -> dict[str, Callable]:
    """Each side's step, on a copy of ``base``."""
    eager, fused, compiled = (copy.deepcopy(base) for _ in range(3))
    aoti_eager.fuse(fused, cache_dir=cache_dir)
    return {
        "eager": trainer(eager, ids, args.autocast),
        "fused": trainer(fused, ids, args.autocast),
        "torch.compile": trainer(compiled, ids, args.autocast, torch.compile(compiled)),
    }


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_step(args: argparse.Namespace) -> float:
    """Seconds of a new process's first step (``--first``), from its model built."""
    model, ids = build(args)
    synchronize()
    start = time.perf_counter()
    if args.first == "fused":
        aoti_eager.fuse(model, cache_dir=args.cache_dir)
    trainer(model, ids, args.autocast, torch.compile(model) if args.first == "torch.compile" else None)()
    synchronize()
    return time.perf_counter() - start


def first_in_a_new_process(side: str, cache_dir: str | None) -> float:
    """``first_step`` of ``side`` in a new process, on ``cache_dir`` (None: empty caches, torch.compile's too)."""
    env = None
    if cache_dir is None:
        empty = tempfile.mkdtemp(prefix="aoti_eager-bench-")
        cache_dir = f"{empty}/aoti_eager"
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{empty}/inductor", TRITON_CACHE_DIR=f"{empty}/triton")
    argv = [sys.executable, __file__, *sys.argv[1:], "--first", side, "--cache-dir", cache_dir]
    child = subprocess.run(argv, capture_output=True, text=True, check=True, env=env)
    return json.loads(child.stdout.strip().splitlines()[-1])["seconds"]


def losses_against_eager(losses: list[float], eager: list[float], dropout: float) -> str:
    if dropout == 0:
        return f"{max(abs(a - e) / abs(e) for a, e in zip(losses, eager)):.1e} max"
    mean = lambda values: sum(values[-10:]) / len(values[-10:])  # noqa: E731
    return f"{mean(losses) / mean(eager) - 1:+.2%} mean of last 10"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--autocast", action="store_true", help="bf16 autocast around the forward")
    parser.add_argument("--steps", type=int, default=50, help="steps whose losses are compared with eager's")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="timed steps a round, after one untimed")
    parser.add_argument("--first", choices=["eager", "fused", "torch.compile"], help="time a first step in this process, and exit")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()
    if args.first:
        print(json.dumps({"seconds": first_step(args)}))
        return
    print(machine(args.device) + f", GPT-2 {args.layers} x {args.width}, batch {args.batch} x {args.length}, "
          f"dropout {args.dropout}, {'bf16 autocast' if args.autocast else 'fp32'}")
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="aoti_eager-bench-")
    base, ids = build(args)
    steps = sides(base, ids, args, cache_dir)
    losses, first, peak = {}, {}, {}
    for name, step in steps.items():
        synchronize()
        start = time.perf_counter()
        losses[name] = [step().item()]
        first[name] = time.perf_counter() - start
        losses[name] += [step().item() for _ in range(args.steps - 1)]
    for name, step in steps.items():
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            step()
            peak[name] = torch.cuda.max_memory_allocated() / 2**20
    medians = alternating({name: lambda step=step: (step(), per_call_seconds(step, args.calls))[1]
                           for name, step in steps.items()}, args.rounds)
    regions = {k: v for k, v in aoti_eager.stats().items() if k.startswith("region::")}
    new_process = {(side, where): first_in_a_new_process(side, where) for side, where in (
        ("eager", cache_dir), ("fused", cache_dir), ("fused", None), ("torch.compile", None))}
    eager = medians["eager"]
    print("\n| side | ms a step | vs eager | peak MiB | first step s | losses vs eager |\n| --- | --- | --- | --- | --- | --- |")
    for name in steps:
        print(f"| {name} | {medians[name] * 1e3:.2f} | {medians[name] / eager:.3f}x | "
              f"{peak.get(name, float('nan')):.0f} | {first[name]:.1f} | "
              f"{losses_against_eager(losses[name], losses['eager'], args.dropout)} |")
    print(f"\nA new process's first step: eager {new_process['eager', cache_dir]:.2f} s; fused on the warm cache "
          f"{new_process['fused', cache_dir]:.2f} s, on an empty cache {new_process['fused', None]:.1f} s; "
          f"torch.compile on empty caches {new_process['torch.compile', None]:.1f} s")
    for name, row in regions.items():
        print(f"{name}: {json.dumps({k: row[k] for k in ('calls', 'hits', 'fallbacks', 'compiles', 'fallback_reason')})}")


if __name__ == "__main__":
    main()
