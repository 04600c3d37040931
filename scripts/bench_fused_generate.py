"""Greedy ``generate()`` of a fused decoder: its blocks take the KV cache.

Per model (GPT-2 and a Llama with grouped-query attention, built from
configs, nothing downloaded) and batch size, in one process: eager with its
``DynamicCache``; ``fuse(model)`` called the same way (each block's kernel
takes its cache layer and returns it grown); and transformers' own compiled
generation (``cache_implementation="static"``, which compiles the forward
with ``torch.compile``). Each row: the first ``generate()`` (the fused one on
an empty cache; compiles included), then tokens per second in alternating
rounds (median), and whether its tokens equal eager's. Needs the ``bench``
extra.

    python scripts/bench_fused_generate.py [--device cpu|cuda] [--models gpt2,llama] [--batches 1,8]
        [--prompt 128] [--new-tokens 128] [--rounds 3] [--no-static] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time

import torch
import transformers

import aoti_eager
from timing import alternating, machine


def build(name: str, device: str) -> torch.nn.Module:
    """A 12 × 768 model on CUDA (bf16), a tiny one on the CPU (fp32)."""
    cuda = device == "cuda"
    layers, width, heads = (12, 768, 12) if cuda else (2, 128, 4)
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads, n_positions=1024)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                                          num_key_value_heads=heads // 3 if cuda else 2, intermediate_size=4 * width,
                                          vocab_size=32000 if cuda else 4096, max_position_embeddings=1024)
        model = transformers.LlamaForCausalLM(config)
    return model.to(device, torch.bfloat16 if cuda else torch.float32).eval()


def generate(model: torch.nn.Module, ids: torch.Tensor, tokens: int, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
                              **kwargs)


def seconds(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def rows(name: str, batch: int, args: argparse.Namespace) -> list[dict]:
    device = args.device
    eager = build(name, device)
    fused = copy.deepcopy(eager)
    aoti_eager.fuse(fused, cache_dir=tempfile.mkdtemp())
    ids = torch.randint(1, 1000, (batch, args.prompt), device=device)
    sides = {"eager": lambda: generate(eager, ids, args.new_tokens),
             "fused": lambda: generate(fused, ids, args.new_tokens)}
    if not args.no_static:
        sides["static (torch.compile)"] = lambda: generate(eager, ids, args.new_tokens, cache_implementation="static")
    before = _region_row()
    expected = sides["eager"]()
    first, equal = {}, {}
    for side, fn in sides.items():
        out: list = []
        first[side] = seconds(lambda: out.append(fn()), device)
        equal[side] = torch.equal(out[0], expected)
    median = alternating({side: (lambda fn=fn: seconds(fn, device)) for side, fn in sides.items()}, args.rounds)
    region = {k: _region_row().get(k, 0) - before.get(k, 0) for k in ("compiles", "fallbacks")}
    reason = _region_row().get("fallback_reason")
    aoti_eager.unfuse(fused)
    tokens = batch * args.new_tokens
    return [dict(model=name, batch=batch, side=side, first_s=round(first[side], 2), tokens_per_s=round(tokens / median[side], 1),
                 speed_vs_eager=round(median["eager"] / median[side], 3), tokens_equal=equal[side],
                 **({"compiles": region["compiles"], "eager_calls": region["fallbacks"], "reason": reason}
                    if side == "fused" else {}))
            for side in sides]


def _region_row() -> dict:
    """The stats row of the fused model's blocks (the one region fused at a time)."""
    return next((v for k, v in aoti_eager.stats().items() if k.startswith("region::")), {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-static", action="store_true", help="without transformers' compiled static-cache row")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [row for name in args.models.split(",") for batch in map(int, args.batches.split(","))
               for row in rows(name, batch, args)]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(machine(args.device))
    print("| model | batch | side | first generate s | tokens/s | × eager's tokens/s | tokens equal | compiles | eager calls |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['model']} | {r['batch']} | {r['side']} | {r['first_s']} | {r['tokens_per_s']} | {r['speed_vs_eager']}x | "
              f"{r['tokens_equal']} | {r.get('compiles', '')} | {r.get('eager_calls', '')} |")


if __name__ == "__main__":
    main()
