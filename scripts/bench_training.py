"""A GPT-2 training step with aoti_eager against eager, on one machine.

Two copies of one GPT-2 (transformers, built from a config: ``bench`` extra),
each with its AdamW(foreach=True), train on the same batches: forward,
``loss.backward()``, ``clip_grad_norm_``, the optimizer step. The one with
aoti_eager enables every op that one step reaches. Printed per step: the
seconds, misses and compiles, and the loss against eager's; then the medians
of steady steps, of eager's, and of the first step after each
``disable()``/``enable()`` (rounds alternate between the two copies).

    python scripts/bench_training.py --device cpu --layers 2 --width 128 --batch 4 --length 64
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

import aoti_eager
from timing import machine


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(1, args.width // 64), vocab_size=args.vocab,
                        n_positions=args.length, bos_token_id=0, eos_token_id=0,
                        # No dropout: the two copies must compute the same losses.
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config).to(args.device)
    ids = torch.randint(0, args.vocab, (args.batch, args.length), device=args.device)
    return model, ids


def trainer(model: torch.nn.Module, ids: torch.Tensor):
    """One training step of ``model`` on ``ids`` per call: its loss and seconds."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step() -> tuple[float, float]:
        start = time.perf_counter()
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the device
        return value, time.perf_counter() - start

    return step


def counts() -> tuple[int, int, int]:
    rows = aoti_eager.stats().values()
    return sum(r["misses"] for r in rows), sum(r["compiles"] for r in rows), sum(r["cache_loads"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--warm-steps", type=int, default=6, help="steps with aoti_eager enabled throughout")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds of one eager and one aoti_eager step")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args()

    model, ids = build(args)
    eager_model = copy.deepcopy(model)
    eager_step, aoti_step = trainer(eager_model, ids), trainer(model, ids)
    # The ops of a step of a third copy: the two trained ones stay in step.
    ops = aoti_eager.ops_reached(trainer(copy.deepcopy(model), ids))
    print(machine(args.device))
    print(f"GPT-2 {args.layers} x {args.width}, batch {args.batch} x {args.length}, {len(ops)} ops enabled")
    print("step | aoti_eager s | misses | compiles | loads | loss | eager loss")
    aoti_eager.enable(ops, devices=[args.device], cache_dir=args.cache_dir)
    steady = []
    before = counts()
    for i in range(args.warm_steps):
        loss, seconds = aoti_step()
        eager_loss, _ = eager_step()
        now = counts()
        print(f"{i} | {seconds:.3f} | {now[0] - before[0]} | {now[1] - before[1]} | {now[2] - before[2]} | {loss:.6f} | {eager_loss:.6f}")
        before = now
        steady.append(seconds)
    aoti_eager.disable()
    eager, reenabled, misses = [], [], 0
    for _ in range(args.rounds):
        eager_loss, seconds = eager_step()
        eager.append(seconds)
        aoti_eager.enable(ops, devices=[args.device], cache_dir=args.cache_dir)
        loss, seconds = aoti_step()
        misses += counts()[0]
        aoti_eager.disable()
        reenabled.append(seconds)
        torch.testing.assert_close(torch.tensor(loss), torch.tensor(eager_loss))
    print(f"median s per step: eager {statistics.median(eager):.4f}, aoti_eager steady (steps 3+) "
          f"{statistics.median(steady[3:] or steady):.4f}, aoti_eager first step after enable() "
          f"{statistics.median(reenabled):.4f}; misses after enable(): {misses}")


if __name__ == "__main__":
    main()
