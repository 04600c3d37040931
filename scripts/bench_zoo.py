"""A model zoo: the one call ``aoti_eager.fuse(model, ops=aoti_eager.ops_reached(...))``
against eager and ``torch.compile(model)`` on eight architectures built from
transformers configs with random weights (nothing downloaded; the ``bench``
extra). Inference in eval mode under ``no_grad``; decoders and T5 as scoring
forwards (``use_cache=False``).

Models (``--device cuda``, bf16 / ``--device cpu``, fp32, tiny):

- llama: ``LlamaForCausalLM``, 12 query / 4 key-value heads, rotary; 12 x 768 at 8 x 512 / 4 x 384 at 1 x 16
- qwen2: ``Qwen2ForCausalLM``, 12 / 2 heads (CPU: 4 / 2); 12 x 768 at 8 x 512 / 4 x 256 at 1 x 16
- mixtral: ``MixtralForCausalLM``, 4 experts, top-2; 4 x 512 at 4 x 128 / 4 x 256 at 1 x 16
- bert: ``BertModel``; 12 x 768 at 8 x 512 / 4 x 256 at 1 x 16
- t5: ``T5ForConditionalGeneration``; 12 + 12 x 768 at 8 x 512 (decoder 8 x 128) / 4 + 4 x 256 at 1 x 16
- vit: ``ViTModel``; the default ``ViTConfig`` at batch 32 / 4 x 256, 64 x 64 images, batch 1
- resnet: ``ResNetModel``; the default ``ResNetConfig`` (ResNet-50) at 32 x 224 x 224 /
  basic blocks, widths 32-256, depths 2, 1 x 64 x 64
- wav2vec2: ``Wav2Vec2Model``; 12 x 768 at 8 x 2 s / 4 x 256 (feature convs 64 wide) at 1 x 0.5 s

For each model, side by side in one run (``bench_regions.py``'s measures):

- **Steady forward**: eager, fused and ``torch.compile`` in alternating rounds
  (medians), outputs against eager's; the regions ``fuse()`` chose, those
  compiled, and those whose calls ran eagerly with the reason ``stats()`` gave.
- **First forward** (``--first``): new processes on empty caches (this
  project's, Inductor's, Triton's): the one call and its first forward
  against ``torch.compile``'s first call; then a new process on the warm cache.
- **generate()** (``--generate``, decoders): greedy tokens a second, batch 1
  (32 new tokens on CPU, 64 on CUDA), tokens against eager's; the fused model's
  ops are those a ``generate()`` call reaches.

    python scripts/bench_zoo.py [--device cpu|cuda] [--models llama,bert] [--rounds 5] [--first] [--generate]
        [--json results.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import traceback
from typing import Any

import torch
import transformers

import aoti_eager
from bench_regions import first_forwards, options, region_rows, started, steady
from timing import alternating, machine, timed, timed_enabled

MODELS = ("llama", "qwen2", "mixtral", "bert", "t5", "vit", "resnet", "wav2vec2")
DECODERS = ("llama", "qwen2", "mixtral")
FIRST_TIMEOUT = 1800  # seconds a first-forward process may take before its model is reported as failed


def _decoder_config(name: str, cuda: bool) -> transformers.PretrainedConfig:
    # The CPU's Llama is 384 wide: 12 query heads of 32 (transformers wants the width a multiple of the heads).
    width = 768 if cuda else 384 if name == "llama" else 256
    common = dict(vocab_size=32000 if cuda else 4096, num_hidden_layers=12 if cuda else 4, hidden_size=width,
                  intermediate_size=8 * width // 3, max_position_embeddings=1024)
    if name == "llama":
        return transformers.LlamaConfig(**common, num_attention_heads=12, num_key_value_heads=4)
    if name == "qwen2":
        return transformers.Qwen2Config(**common, num_attention_heads=12 if cuda else 4, num_key_value_heads=2)
    width = 512 if cuda else 256
    return transformers.MixtralConfig(**{**common, "num_hidden_layers": 4, "hidden_size": width, "intermediate_size": 2 * width},
                                      num_attention_heads=8 if cuda else 4, num_key_value_heads=2,
                                      num_local_experts=4, num_experts_per_tok=2)


def model_and_inputs(name: str, device: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model (random weights, eval, on ``device`` in its dtype) and its forward's keyword arguments."""
    cuda = device == "cuda"
    layers, width, heads, batch, tokens = (12, 768, 12, 8, 512) if cuda else (4, 256, 4, 1, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    ids = lambda vocab, n=tokens, b=batch: torch.randint(0, vocab, (b, n), device=device)  # noqa: E731
    if name in DECODERS:
        config = _decoder_config(name, cuda)
        model = transformers.AutoModelForCausalLM.from_config(config)
        if name == "mixtral" and cuda:
            batch, tokens = 4, 128
        inputs = {"input_ids": ids(config.vocab_size, tokens, batch), "use_cache": False}
    elif name == "bert":
        config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                                         intermediate_size=4 * width)
        model, inputs = transformers.BertModel(config), {"input_ids": ids(config.vocab_size)}
    elif name == "t5":
        config = transformers.T5Config(vocab_size=32128 if cuda else 4096, d_model=width, d_kv=width // heads,
                                       d_ff=4 * width, num_layers=layers, num_heads=heads)
        model = transformers.T5ForConditionalGeneration(config)
        inputs = {"input_ids": ids(config.vocab_size), "decoder_input_ids": ids(config.vocab_size, 128 if cuda else tokens),
                  "use_cache": False}
    elif name == "vit":
        config = transformers.ViTConfig() if cuda else transformers.ViTConfig(
            num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads, intermediate_size=4 * width,
            image_size=64)
        model = transformers.ViTModel(config)
        inputs = {"pixel_values": torch.randn(32 if cuda else 1, 3, config.image_size, config.image_size, device=device)}
    elif name == "resnet":
        config = transformers.ResNetConfig() if cuda else transformers.ResNetConfig(
            embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[2, 2, 2, 2], layer_type="basic")
        model = transformers.ResNetModel(config)
        inputs = {"pixel_values": torch.randn(*(32, 3, 224, 224) if cuda else (1, 3, 64, 64), device=device)}
    elif name == "wav2vec2":
        config = transformers.Wav2Vec2Config(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads,
                                             intermediate_size=4 * width, **({} if cuda else {"conv_dim": (64,) * 7}))
        model = transformers.Wav2Vec2Model(config)
        inputs = {"input_values": torch.randn(8 if cuda else 1, 32000 if cuda else 8000, device=device)}
    else:
        raise ValueError(f"no model {name!r}; the zoo has {', '.join(MODELS)}")
    inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    return model.to(device=device, dtype=dtype).eval(), inputs


def generation(model: torch.nn.Module, inputs: dict[str, Any], device: str, rounds: int, cache_dir: str) -> dict[str, Any]:
    """Greedy ``generate()`` tokens a second of eager, the fused model and
    ``torch.compile`` (the model's ``compile()``, which its forwards go through)."""
    new = 64 if device == "cuda" else 32
    prompt = inputs["input_ids"][:1]

    def generate(m: torch.nn.Module) -> Any:
        return lambda: m.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    expected = generate(model)()
    fused_model, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
    ops = aoti_eager.ops_reached(generate(fused_model))
    aoti_eager.fuse(fused_model, ops=ops, cache_dir=cache_dir)
    since = region_rows()
    got = generate(fused_model)()
    aoti_eager.disable()  # enabled for the fused side's rounds only
    rows = region_rows(since)
    compiled_model.compile()
    compiled_got = generate(compiled_model)()
    seconds = alternating({
        "eager": lambda: timed(generate(model), 1),
        "fused": lambda: timed_enabled(generate(fused_model), ops, 1, cache_dir=cache_dir),
        "torch.compile": lambda: timed(generate(compiled_model), 1),
    }, rounds)
    return dict(
        tokens=new, **{side: new / s for side, s in seconds.items()},
        fused_same=torch.equal(got, expected), compiled_same=torch.equal(compiled_got, expected),
        fallbacks=sum(r["fallbacks"] for r in rows.values()), hits=sum(r["hits"] for r in rows.values()),
        reasons=sorted({r["fallback_reason"] for r in rows.values() if r["fallback_reason"]}),
    )


def measure(name: str, args: argparse.Namespace, scratch: str) -> dict[str, Any]:
    result: dict[str, Any] = {"name": name}
    if args.first:
        result["first"] = first_forwards(__file__, name, args.device, scratch, ops=True, timeout=FIRST_TIMEOUT)
        print(f"{name}: first forwards (s): " + ", ".join(f"{k} {v:.2f}" for k, v in result["first"].items()), flush=True)
    cache_dir = os.path.join(scratch, f"{name}-cache")
    result["steady"] = steady(name, *model_and_inputs(name, args.device), args.device, args.rounds, cache_dir, ops=True)
    print(steady_row(result["steady"]), flush=True)
    if args.generate and name in DECODERS:
        model, inputs = model_and_inputs(name, args.device)
        result["generate"] = generation(model, inputs, args.device, args.rounds, cache_dir)
        print(generate_row(name, result["generate"]), flush=True)
    return result


def steady_row(r: dict[str, Any]) -> str:
    e = r["eager"]
    compiled = sum(1 for row in r["rows"].values() if row["compiles"] or row["cache_loads"])
    return (f"| {r['name']} | {e * 1e3:.2f} | {r['fused'] * 1e3:.2f} | **{r['fused'] / e:.3f}x** | {r['torch.compile'] * 1e3:.2f} | "
            f"{r['torch.compile'] / e:.3f}x | {r['ops']} | {r['regions']} | {compiled} | {r['fallbacks']} | {r['difference']:.1e} |")


def generate_row(name: str, g: dict[str, Any]) -> str:
    same = lambda ok: "same" if ok else "**differ**"  # noqa: E731
    return (f"| {name} | {g['tokens']} | {g['eager']:.1f} | {g['fused']:.1f} | **{g['eager'] / g['fused']:.3f}x** | "
            f"{g['torch.compile']:.1f} | {g['eager'] / g['torch.compile']:.3f}x | {same(g['fused_same'])} | "
            f"{same(g['compiled_same'])} | {g['hits']} | {g['fallbacks']} |")


def regions_lines(r: dict[str, Any]) -> list[str]:
    """Per region ``fuse()`` chose: whether it compiled, and why calls ran eagerly."""
    lines = []
    for region, row in r["steady"]["rows"].items():
        state = "compiled" if row["compiles"] else "loaded" if row["cache_loads"] else "**not compiled**"
        why = f"; {row['fallbacks']} of {row['calls']} calls eager: {row['fallback_reason']}" if row["fallbacks"] else ""
        lines.append(f"| {r['name']} | `{region.removeprefix('region::')}` | {state}, {row['hits']} hits{why} |")
    return lines or [f"| {r['name']} | (none) | |"]


def report(results: list[dict[str, Any]], failures: dict[str, str]) -> None:
    done = [r for r in results if "steady" in r]
    print("\n### Steady forward (ms, medians of alternating rounds)\n\n| model | eager | fused | vs eager | torch.compile | vs eager "
          "| ops | regions | compiled | region calls eager | max diff vs eager (relative) |\n" + "| --- " * 11 + "|")
    for r in done:
        print(steady_row(r["steady"]))
    print("\n### Regions fuse() chose\n\n| model | region | what its calls did |\n| --- | --- | --- |")
    for r in done:
        print("\n".join(regions_lines(r)))
    firsts = [r for r in done if "first" in r]
    if firsts:
        print("\n### First forward (s, new processes)\n\n| model | torch.compile first call, empty caches | fuse(ops=...) + first "
              "forward, empty caches | eager first forward | fuse(ops=...) + first forward, warm cache |\n" + "| --- " * 5 + "|")
        for r in firsts:
            f = r["first"]
            print(f"| {r['name']} | {f['compile']:.1f} | {f['fuse']:.1f} | {f['eager, new process']:.2f} | {f['fused, new process']:.2f} |")
    generated = [r for r in done if "generate" in r]
    if generated:
        print("\n### generate() (tokens/s, greedy, batch 1; time vs eager)\n\n| model | new tokens | eager | fused | vs eager "
              "| torch.compile | vs eager | fused tokens | torch.compile tokens | region hits | region calls eager |\n"
              + "| --- " * 11 + "|")
        for r in generated:
            print(generate_row(r["name"], r["generate"]))
        for r in generated:
            for reason in r["generate"]["reasons"]:
                print(f"{r['name']} generate(): a region ran eagerly: {reason}")
    for name, error in failures.items():
        print(f"{name}: failed: {error}")


def main() -> None:
    parser = options(__doc__, MODELS)
    parser.add_argument("--generate", action="store_true", help="generate() tokens a second, for the decoders")
    parser.add_argument("--json", help="write the results there")
    args = parser.parse_args()
    if not started(args, model_and_inputs):
        return
    results, failures = [], {}
    with tempfile.TemporaryDirectory(prefix="aoti_eager-zoo-") as scratch:
        for name in args.models.split(","):
            try:
                results.append(measure(name, args, scratch))
            except Exception as e:  # noqa: BLE001 - the other models still run
                aoti_eager.disable()
                failures[name] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:300]}"
                traceback.print_exc()
    report(results, failures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(args.device), results=results, failures=failures), f, indent=1, default=str)


if __name__ == "__main__":
    main()
