"""Whole models against eager: aoti_eager and torch.compile side by side in one
process, on transformers models built from configs (random weights, nothing
downloaded). Needs the ``bench`` extra: ``pip install -e '.[bench]'``.

Workloads (CUDA: bf16 for inference; CPU: smaller, fp32), inference in eval
mode under ``no_grad``:

- gpt2: GPT-2 12 layers x 768 at batch 8 x 512 tokens (CPU: 4 x 256 at 4 x 128)
- bert: BERT 12 x 768 at 16 x 256 (CPU: 4 x 256 at 4 x 128)
- vit: ``ViTModel`` of a default ``ViTConfig`` at batch 32 (CPU: 4 x 256 at batch 4)
- train: a GPT-2 training step, fp32: forward, backward, ``clip_grad_norm_``,
  ``AdamW(foreach=True)``; 6 x 768 at 8 x 256 (CPU: 2 x 128 at 4 x 64)

For each: the ops the step reaches (``aoti_eager.ops_reached``) are enabled,
compiling now; the first steps compile (counted), then eager, aoti_eager and
``torch.compile`` of the model run in alternating rounds of ``--calls``
steps, each after one untimed step (median seconds a step). Outputs (losses, for training, step by step from one initial state)
are compared with eager's; misses are counted over a warm step. A
``torch.profiler`` step of eager and of aoti_eager gives each op's self time
(CPU time, and device time on CUDA) side by side. On CPU it also tells what
the pool of CPU kernels' freed outputs holds after the timed rounds
(``AOTI_EAGER_CPU_POOL``): the memory the speed costs.

    python scripts/bench_models.py [--device cpu|cuda] [--workloads gpt2,train] [--rounds 5] [--calls 10] [--steps 3]
        [--cache-dir DIR] [--top 8]
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers
from torch.profiler import ProfilerActivity, profile

import aoti_eager
from aoti_eager import _extension, settings
from timing import alternating, machine, timed, timed_enabled, total_compiles

# (layers, width, heads, batch, tokens) per device.
SIZES = {
    "gpt2": {"cuda": (12, 768, 12, 8, 512), "cpu": (4, 256, 4, 4, 128)},
    "bert": {"cuda": (12, 768, 12, 16, 256), "cpu": (4, 256, 4, 4, 128)},
    "vit": {"cuda": (12, 768, 12, 32, 0), "cpu": (4, 256, 4, 4, 0)},
    "train": {"cuda": (6, 768, 12, 8, 256), "cpu": (2, 128, 4, 4, 64)},
}


@dataclass
class Workload:
    """A step to time, and what its result is compared on."""

    step: Callable[[], Any]  # one forward, or one training step; returns the output or loss
    compiled_step: Callable[[], Any]  # the same with torch.compile
    fresh: Callable[[], Callable[[], Any]]  # a step of a copy of the initial state (for training)


def model_and_inputs(name: str, device: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The workload's model (random weights, on ``device`` in its dtype) and the keyword arguments of its forward."""
    layers, width, heads, batch, tokens = SIZES[name][device]
    dtype = torch.bfloat16 if device == "cuda" and name != "train" else torch.float32
    torch.manual_seed(0)
    if name == "vit":
        config = transformers.ViTConfig() if device == "cuda" else transformers.ViTConfig(
            num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads, intermediate_size=4 * width)
        model = transformers.ViTModel(config)
        inputs = {"pixel_values": torch.randn(batch, 3, config.image_size, config.image_size, device=device, dtype=dtype)}
    elif name == "bert":
        config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=width, num_attention_heads=heads, intermediate_size=4 * width)
        model = transformers.BertModel(config)
        inputs = {"input_ids": torch.randint(0, config.vocab_size, (batch, tokens), device=device)}
    else:
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads)
        model = transformers.GPT2LMHeadModel(config)
        inputs = {"input_ids": torch.randint(0, config.vocab_size, (batch, tokens), device=device)}
    return model.to(device=device, dtype=dtype), inputs


def build(name: str, device: str) -> Workload:
    model, inputs = model_and_inputs(name, device)
    if name != "train":
        model.eval()

        def forward(m: torch.nn.Module) -> Callable[[], Any]:
            def step() -> Any:
                with torch.no_grad():
                    return m(**inputs)[0]
            return step

        return Workload(forward(model), forward(torch.compile(model)), lambda: forward(model))
    initial = copy.deepcopy(model.state_dict())

    def training(m: torch.nn.Module, forward: Callable[..., Any]) -> Callable[[], Any]:
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)

        def step() -> Any:
            loss = forward(**inputs, labels=inputs["input_ids"]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()
        return step

    def fresh() -> Callable[[], Any]:
        model.load_state_dict(initial)
        return training(model, model)

    return Workload(training(model, model), training(model, torch.compile(model)), fresh)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def max_difference(results: list[Any], expected: list[Any]) -> float:
    """The largest absolute difference from eager's, relative to eager's largest value."""
    worst = 0.0
    for got, want in zip(results, expected):
        got, want = got.float(), want.float()
        worst = max(worst, ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item())
    return worst


def self_times(step: Callable[[], Any], device: str) -> dict[str, tuple[float, ...]]:
    """Milliseconds of self time per op name in one profiled step: CPU time,
    and on CUDA device time first."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        synchronize()
    fields = (["self_device_time_total"] if device == "cuda" else []) + ["self_cpu_time_total"]
    return {e.key: tuple(getattr(e, f) / 1e3 for f in fields) for e in prof.key_averages()}


def empty_cpu_pool() -> None:
    """Gives the pool's freed blocks back to c10, so that what it holds after a
    workload is that workload's."""
    extension = _extension.load()
    extension.set_cpu_pool_limit(0)
    extension.set_cpu_pool_limit(settings.cpu_pool.get())


def run(name: str, device: str, rounds: int, calls: int, steps: int, cache_dir: str, top: int) -> dict[str, Any]:
    empty_cpu_pool()
    work = build(name, device)
    step = work.fresh()
    expected = [step() for _ in range(steps)]
    work.compiled_step(), work.compiled_step()  # torch.compile's compile, before timing
    ops = aoti_eager.ops_reached(work.fresh())
    aoti_eager.enable(ops, devices=[device], cache_dir=cache_dir)
    step = work.fresh()
    results = [step() for _ in range(steps)]  # the first steps compile
    compiles = total_compiles()
    kept_eager = sum(1 for s in aoti_eager.stats().values() if (s["fallback_reason"] or "").startswith("eager is faster"))
    before = sum(s["misses"] for s in aoti_eager.stats().values())
    step()
    misses = sum(s["misses"] for s in aoti_eager.stats().values()) - before
    aoti_eager.disable()

    medians = alternating({
        "eager": lambda: timed(work.step, calls),
        "aoti_eager": lambda: timed_enabled(work.step, ops, calls, devices=[device], cache_dir=cache_dir),
        "torch.compile": lambda: timed(work.compiled_step, calls),
    }, rounds)
    # What the speed costs in memory: CPU kernels' freed outputs kept for the next step.
    pool_mib = _extension.load().cpu_pool_held_bytes() / 2**20
    eager_ops = self_times(work.step, device)
    aoti_eager.enable(ops, devices=[device], cache_dir=cache_dir)
    work.step()
    aoti_ops = self_times(work.step, device)
    aoti_eager.disable()
    none = (0.0,) * len(next(iter(eager_ops.values())))
    names = sorted(set(eager_ops) | set(aoti_ops), key=lambda n: -max(eager_ops.get(n, none)[0], aoti_ops.get(n, none)[0]))[:top]
    return dict(
        name=name, ops=len(ops), compiles=compiles, kept_eager=kept_eager, misses=misses,
        difference=max_difference(results, expected), pool_mib=pool_mib, **medians,
        breakdown=[(n, eager_ops.get(n, none), aoti_ops.get(n, none)) for n in names],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--workloads", default="gpt2,bert,vit,train")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10, help="timed steps a round, after one untimed")
    parser.add_argument("--steps", type=int, default=3, help="compared with eager's (the first ones compile)")
    parser.add_argument("--cache-dir", default=None, help="default: a new empty cache")
    parser.add_argument("--top", type=int, default=8, help="ops in each per-op breakdown")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    print(machine(args.device) + f", transformers {transformers.__version__}, threads {torch.get_num_threads()}")
    header = ("| workload | eager ms | aoti_eager ms | vs eager | torch.compile ms | vs eager | ops | compiles | "
              "kept eager | misses a warm step | max diff vs eager (relative) |\n" + "| --- " * 11 + "|")
    rows = []
    with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as scratch:
        for name in args.workloads.split(","):
            try:
                rows.append(run(name, args.device, args.rounds, args.calls, args.steps, args.cache_dir or scratch, args.top))
            except Exception as e:  # noqa: BLE001 - the other workloads still run
                aoti_eager.disable()
                print(f"\n{name}: failed: {type(e).__name__}: {e}")
                continue
            # Each workload as it ends: a run cut short keeps what it measured.
            print(f"\n{header}\n{table_row(rows[-1])}")
            if args.device == "cpu":
                print(f"\n{name}: the pool of CPU kernels' freed outputs holds {rows[-1]['pool_mib']:.0f} MiB after the timed rounds")
            units = ["device", "CPU"] if args.device == "cuda" else ["CPU"]
            columns = " | ".join(f"{side} {unit}" for unit in units for side in ("eager", "aoti_eager"))
            print(f"\n{name}: self ms in one step, top {args.top} by {units[0]} time\n\n| op | {columns} |\n|" + " --- |" * (1 + 2 * len(units)))
            for n, eager_ms, aoti_ms in rows[-1]["breakdown"]:
                print(f"| `{n[:60]}` | " + " | ".join(f"{e:.3f} | {a:.3f}" for e, a in zip(eager_ms, aoti_ms)) + " |")
    print(f"\n{header}")
    for r in rows:
        print(table_row(r))


def table_row(r: dict[str, Any]) -> str:
    e = r["eager"]
    return (f"| {r['name']} | {e * 1e3:.2f} | {r['aoti_eager'] * 1e3:.2f} | {r['aoti_eager'] / e:.3f}x | "
            f"{r['torch.compile'] * 1e3:.2f} | {r['torch.compile'] / e:.3f}x | {r['ops']} | {r['compiles']} | "
            f"{r['kept_eager']} | {r['misses']} | {r['difference']:.1e} |")

if __name__ == "__main__":
    main()
