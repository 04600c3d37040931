"""Record, prewarm and start warm: a small transformer block's forward pass in eager.

For each ``--jobs`` value, in a new cache:

1. a process runs the block with ``record=`` and ``compile="never"``: it runs
   eagerly and writes the signatures it missed to a manifest;
2. ``aoti-eager prewarm MANIFEST --jobs N`` compiles them (timed);
3. a new process runs the block again: every call is a cached kernel, no
   compile, and the output matches eager's.

    python scripts/prewarm_model.py --jobs 1 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# One signature each in this block: four compiles, of four ops, so that jobs
# run in parallel (compiles of one op take turns on its lock). Add
# "aten::addmm" and "aten::bmm" for the matrix products (six more signatures).
OPS = ["aten::native_layer_norm", "aten::_softmax", "aten::gelu", "aten::add.Tensor"]


class Block(torch.nn.Module):
    """Pre-norm self-attention and MLP, written out so each aten op is visible."""

    def __init__(self, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = (t.reshape(batch * self.heads, tokens, -1) for t in (q, k, v))
        attention = torch.softmax(torch.bmm(q, k.transpose(1, 2)) * (q.shape[-1] ** -0.5), dim=-1)
        mixed = torch.bmm(attention, v).reshape(batch, self.heads, tokens, -1).transpose(1, 2).reshape(batch, tokens, dim)
        x = x + self.proj(mixed)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


def run_block(cache_dir: str, record: str | None) -> None:
    """One process's run: prints the aoti_eager stats summed over ops, as JSON."""
    import aoti_eager

    torch.manual_seed(0)
    block, x = Block().eval(), torch.randn(2, 16, 64)
    with torch.no_grad():
        expected = block(x)
        compile = "never" if record else "now"
        aoti_eager.enable(OPS, devices=["cpu"], cache_dir=cache_dir, record=record, compile=compile)
        start = time.perf_counter()
        actual = block(x)
        seconds = time.perf_counter() - start
        stats = aoti_eager.stats()
        aoti_eager.disable()
    torch.testing.assert_close(actual, expected)
    totals = {key: sum(row[key] for row in stats.values()) for key in ("calls", "hits", "compiles", "cache_loads", "fallbacks")}
    print(json.dumps({"forward_seconds": round(seconds, 3), **totals}))


def child(*argv: str) -> dict:
    out = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2], help="prewarm with each of these job counts")
    parser.add_argument("--run-block", nargs=2, metavar=("CACHE_DIR", "RECORD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_block:
        cache_dir, record = args.run_block
        return run_block(cache_dir, record or None)
    for jobs in args.jobs:
        with tempfile.TemporaryDirectory(prefix="aoti_eager-prewarm-") as workdir:
            cache_dir, manifest = str(Path(workdir, "cache")), Path(workdir, "block.jsonl")
            recorded = child("--run-block", cache_dir, str(manifest))
            entries = len(manifest.read_text().splitlines())
            print(f"--jobs {jobs}: recording run: {recorded['calls']} calls, {entries} signatures recorded, "
                  f"{recorded['compiles']} compiles")
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "aoti_eager", "--cache-dir", cache_dir, "prewarm", str(manifest),
                            "--jobs", str(jobs)], check=True)
            prewarm_seconds = time.perf_counter() - start
            warm = child("--run-block", cache_dir, "")
            print(f"--jobs {jobs}: prewarm took {prewarm_seconds:.1f} s; warm run: {warm['calls']} calls, "
                  f"{warm['compiles']} compiles, {warm['cache_loads']} kernels loaded from the cache, "
                  f"{warm['hits']} hits, {warm['fallbacks']} eager calls; output matches eager")


if __name__ == "__main__":
    main()
