"""The demo: a small transformer in plain PyTorch, made fast with one call,
``aoti_eager.fuse(model, ops=aoti_eager.ops_reached(model, x))``.

Runs in a fresh process against empty caches (cold: the blocks and ops
compile), then in another fresh process against the same caches (warm: they
load), and prints for each: the seconds to the first result (eager's, the
fused model's, ``torch.compile``'s), the steady time of a forward against
eager's (alternating rounds, medians), each output's largest difference from
eager's, and per region and op: calls, hits, compiles (here and in workers), cache loads.

    python scripts/demo.py [--cache-dir DIR] [--rounds N] [--no-torch-compile]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, LAYERS, VOCAB, BATCH, TOKENS = 256, 4, 4, 2048, 1, 16


class Block(nn.Module):
    """A pre-norm transformer layer: causal self-attention, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).transpose(1, 3).unbind(2)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Model(nn.Module):
    """Token and position embeddings, repeated blocks, a final norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(TOKENS, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def seconds(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run(cache_dir: str, rounds: int, with_compile: bool) -> dict:
    """One process's run: first results, then steady forwards side by side."""
    import aoti_eager
    from timing import alternating, timed, timed_enabled

    torch.manual_seed(0)
    model = Model().eval()
    ids = torch.randint(0, VOCAB, (BATCH, TOKENS))
    torch.set_grad_enabled(False)  # inference: no autograd graph kept (a training call compiles a backward too)
    first = {}
    first["eager"], expected = seconds(lambda: model(ids))
    fused_model = copy.deepcopy(model)

    def fuse_and_run():
        ops = aoti_eager.ops_reached(fused_model, ids)
        aoti_eager.fuse(fused_model, ops=ops, cache_dir=cache_dir)  # the one call
        return ops, fused_model(ids)

    first["fused"], (ops, got) = seconds(fuse_and_run)
    results = {"fused": got}
    for _ in range(2):  # the second decides the kernels its first forward compiled in workers; the third hits them
        fused_model(ids)
    stats = {name: row for name, row in aoti_eager.stats().items() if row["calls"]}  # three forwards': compiles, loads, hits
    aoti_eager.disable()  # the ops are enabled for the fused side's rounds only: the others run eager's kernels
    sides = {
        "eager": lambda: timed(lambda: model(ids), 5),
        "fused": lambda: timed_enabled(lambda: fused_model(ids), ops, 5, cache_dir=cache_dir),
    }
    if with_compile:
        compiled = torch.compile(copy.deepcopy(model))
        first["torch.compile"], results["torch.compile"] = seconds(lambda: compiled(ids))
        sides["torch.compile"] = lambda: timed(lambda: compiled(ids), 5)
    return dict(
        first=first, steady=alternating(sides, rounds), stats=stats,
        difference={side: (y - expected).abs().max().item() for side, y in results.items()},
    )


def report(title: str, result: dict) -> None:
    first, steady = result["first"], result["steady"]
    print(f"\n== {title}")
    print("first result s:     " + " | ".join(f"{side} {s:.2f}" for side, s in first.items())
          + "   (fused: ops_reached + fuse + first forward)")
    print("steady ms/forward:  " + " | ".join(
        f"{side} {s * 1e3:.2f}" + (f" ({s / steady['eager']:.2f}x eager)" if side != "eager" else "")
        for side, s in steady.items()))
    print("max abs diff vs eager: " + " | ".join(f"{side} {d:.1e}" for side, d in result["difference"].items()))
    print("the fused model's first three forwards, per region and op:")
    header = (f"{'region or op':<34}{'calls':>7}{'hits':>7}{'compiles':>10}{'in workers':>12}{'loads':>7}{'eager':>7}"
              f"{'compile s':>11}")
    print(header + "\n" + "-" * len(header))
    for name, row in result["stats"].items():
        print(f"{name.replace('region::__main__.', 'region::'):<34}{row['calls']:>7}{row['hits']:>7}{row['compiles']:>10}"
              f"{row['queued']:>12}{row['cache_loads']:>7}{row['fallbacks']:>7}{row['compile_seconds']:>11.1f}")
        if row["fallback_reason"] and not row["hits"]:
            print(f"    ran eagerly: {row['fallback_reason']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", help="kernel cache to use (default: a new empty one, so the first run is cold)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of 5 forwards a side")
    parser.add_argument("--no-torch-compile", action="store_true", help="leave torch.compile out")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.cache_dir, args.rounds, not args.no_torch_compile)))
        return
    with tempfile.TemporaryDirectory(prefix="aoti_eager-demo-") as scratch:
        cache_dir = args.cache_dir or scratch
        # Inductor's and Triton's caches start empty too, and the warm process finds them filled.
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor"),
               "TRITON_CACHE_DIR": os.path.join(scratch, "triton")}
        print(f"aoti_eager demo: a {LAYERS}-block transformer (width {WIDTH}) at {BATCH} x {TOKENS} tokens, "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads; cache {cache_dir}")
        command = [sys.executable, __file__, "--child", "--cache-dir", cache_dir, "--rounds", str(args.rounds)]
        command += ["--no-torch-compile"] if args.no_torch_compile else []
        for title in ("cold process (empty caches: compiles)", "warm process (same caches, new process: loads)"):
            start = time.perf_counter()
            out = subprocess.run(command, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"demo run failed:\n{out.stderr}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            report(f"{title}: {time.perf_counter() - start:.0f} s in all", result)
            served = sum(row["compiles"] + row["cache_loads"] for row in result["stats"].values())
            if served == 0:
                reasons = sorted({row["fallback_reason"] for row in result["stats"].values() if row["fallback_reason"]})
                sys.exit(f"\ndemo FAILED: the {title.split(' (')[0]} compiled and loaded no kernel: "
                         + ("; ".join(reasons) or "no reason recorded") + "\n`aoti-eager doctor` checks the whole path.")


if __name__ == "__main__":
    main()
