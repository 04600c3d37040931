"""Host cost of a fused region's hit path over its kernel.

For a small MLP block with LayerNorms (10 parameters) and, where
transformers is installed, a tiny GPT-2 block called as GPT2Model calls it,
in one process, each timed in alternating rounds (median per call):

- kernel: the region's kernel alone, ``kernel.run(inputs)`` on its flat inputs;
- forward: the fused instance's ``forward(*args, **kwargs)`` (a hit);
- call: the fused instance called as a module (``block(*args, **kwargs)``);
- eager: the original forward of an unfused copy.

Sizes are tiny so that host cost shows; "over kernel" is forward - kernel.
The table gives each one's fastest round (on a shared machine, load only adds
to a call's cost), and the median rounds' difference beside it.

Then a refused region's cost: the fused instance called where no kernel
serves it, against an unfused copy called alike, for each way a call is
refused: decided eager (``compile="never"`` on an empty cache), autocast
without autograd, and an input no kernel takes (an object, as a KV cache).

    OMP_NUM_THREADS=1 python scripts/bench_region_call.py [--calls N] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import tempfile
from typing import Any, Callable, Iterator

import torch

import aoti_eager
from aoti_eager import _region_misses, _regions
from timing import machine, per_call_seconds


class MLPBlock(torch.nn.Module):
    """Pre-norm MLP with a residual and an output norm: 10 parameters."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)
        self.proj = torch.nn.Linear(width, width)
        self.norm2 = torch.nn.LayerNorm(width)

    def forward(self, x, cache=None):
        h = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm1(x))))
        return self.norm2(h + self.proj(h))


def mlp_case() -> tuple[torch.nn.Module, torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(MLPBlock(), MLPBlock()).eval()
    return model, model[0], (torch.randn(4, 16),), {}


def gpt2_case() -> tuple[torch.nn.Module, torch.nn.Module, tuple[Any, ...], dict[str, Any]] | None:
    try:
        import transformers
    except ImportError:
        return None
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2Model(config).eval()
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    # The block's arguments as the model gives them (taken on a copy: hooks on a fused instance refuse it).
    probe = copy.deepcopy(model)
    handle = probe.h[0].register_forward_pre_hook(lambda m, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
    with torch.no_grad():
        probe(torch.randint(0, 100, (1, 8)), use_cache=False)
    handle.remove()
    args, kwargs = seen[0]
    return model, model.h[0], args, kwargs


def rounds(fns: dict[str, Callable[[], object]], calls: int, repeats: int) -> dict[str, list[float]]:
    """us per call of each of ``fns`` in each of alternating rounds."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(per_call_seconds(fn, calls) * 1e6)
    return times


def measure(case: str, model: torch.nn.Module, block: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            cache_dir: str, calls: int, repeats: int) -> dict[str, Any]:
    eager = copy.deepcopy(block)
    aoti_eager.fuse(model, cache_dir=cache_dir)
    with torch.no_grad():
        block(*args, **kwargs)  # compiles
        instance = _regions._fused(block)
        decided, leaves, _, _ = _region_misses._decide(instance, args, kwargs, None)
        assert decided.kernel is not None, decided.reason
        kernel = decided.kernel.compiled
        inputs = [*instance.state().tensors, *(v for v in leaves if isinstance(v, torch.Tensor))]
        torch.testing.assert_close(block(*args, **kwargs), eager(*args, **kwargs))
        before = aoti_eager.stats()[_regions.region_name(block)]["hits"]
        us = rounds({
            "kernel": lambda: kernel.run(inputs),
            "forward": lambda: block.forward(*args, **kwargs),
            "call": lambda: block(*args, **kwargs),
            "eager": lambda: eager(*args, **kwargs),
        }, calls, repeats)
        hits = aoti_eager.stats()[_regions.region_name(block)]["hits"] - before
    assert hits == 2 * calls * repeats, "a timed call of the fused instance was no hit"
    aoti_eager.unfuse(model)
    return dict(case=case, **{f"{k}_us": min(v) for k, v in us.items()}, over_kernel_us=min(us["forward"]) - min(us["kernel"]),
                median_over_kernel_us=statistics.median(us["forward"]) - statistics.median(us["kernel"]))


class Cache:
    """An argument no kernel takes."""


@contextlib.contextmanager
def _autocast() -> Iterator[None]:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        yield


def refused(case: str, model: torch.nn.Module, block: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            cache_dir: str, calls: int, repeats: int) -> list[dict[str, Any]]:
    """The cost of calls of ``block`` that run its original forward, over an unfused copy's, per refusal."""
    ways = {
        "decided eager": (dict(compile="never"), kwargs, torch.no_grad),
        "autocast": ({}, kwargs, _autocast),
    }
    if isinstance(block, MLPBlock):
        ways["input no kernel takes"] = ({}, {**kwargs, "cache": Cache()}, torch.no_grad)
    rows = []
    for why, (options, called, mode) in ways.items():
        eager = copy.deepcopy(block)
        with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as empty, mode():
            aoti_eager.fuse(model, cache_dir=empty if options else cache_dir, **options)
            block(*args, **called)  # decided
            name = _regions.region_name(block)
            before = aoti_eager.stats()[name]["fallbacks"]
            us = rounds({"fused": lambda: block(*args, **called), "eager": lambda: eager(*args, **called)}, calls, repeats)
            assert aoti_eager.stats()[name]["fallbacks"] - before == calls * repeats, "a timed call was no fallback"
            aoti_eager.unfuse(model)
        rows.append(dict(case=case, refused=why, fused_us=min(us["fused"]), eager_us=min(us["eager"]),
                         over_eager_us=min(us["fused"]) - min(us["eager"]),
                         median_over_eager_us=statistics.median(us["fused"]) - statistics.median(us["eager"])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cache-dir", default=None, help="default: a new empty cache")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    cases = [("MLP block, 4x16, 10 params", mlp_case())]
    if (gpt2 := gpt2_case()) is not None:
        cases.append(("GPT-2 block, 1x8x32", gpt2))
    with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as scratch:
        rows = [measure(name, *case, args.cache_dir or scratch, args.calls, args.rounds) for name, case in cases]
        refusals = [r for name, case in cases for r in refused(name, *case, args.cache_dir or scratch, args.calls, args.rounds)]
    if args.json:
        print(json.dumps({"hits": rows, "refused": refusals}))
        return
    print(f"{machine('cpu')}, {torch.get_num_threads()} thread(s)")
    print(f"{'case':<28}{'kernel us':>10}{'forward us':>12}{'call us':>9}{'eager us':>10}{'over kernel us':>16}{'(medians)':>11}")
    for r in rows:
        print(f"{r['case']:<28}{r['kernel_us']:>10.2f}{r['forward_us']:>12.2f}{r['call_us']:>9.2f}{r['eager_us']:>10.2f}"
              f"{r['over_kernel_us']:>16.2f}{r['median_over_kernel_us']:>11.2f}")
    print(f"\n{'case':<28}{'refused':<24}{'fused us':>10}{'eager us':>10}{'over eager us':>15}{'(medians)':>11}")
    for r in refusals:
        print(f"{r['case']:<28}{r['refused']:<24}{r['fused_us']:>10.2f}{r['eager_us']:>10.2f}"
              f"{r['over_eager_us']:>15.2f}{r['median_over_eager_us']:>11.2f}")


if __name__ == "__main__":
    main()
