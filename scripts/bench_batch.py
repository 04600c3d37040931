"""A BERT (Hugging Face transformers) forward over variable batch sizes and
sequence lengths, with the ops of its forward enabled: compiles per call,
compiles per shape family, outputs against eager's, warm time against eager.

The model is built from a config (random weights, nothing downloaded). Each
call draws a batch size in [1, 32] and a sequence length in [8, 128] from a
seeded generator; as a tokenizer padding to the longest row would, one row
fills the sequence and the others have random lengths, masked out beyond.
``aoti_eager.ops_reached`` of the forward on the first call's input is what is
enabled. The first pass over the calls is cold (an empty cache unless
--cache-dir is given); each call's output is compared with eager's on the same
input. A shape family here is what the issue names: an op and the dtype and
rank of each tensor argument. Compiles are read from the cache's new entries
after each call: a kernel built (kept, or kept eager where it measured slower
than eager at compile) is a compile; an entry decided eager with no kernel built
(export refused the call) is counted apart. Then the pass is timed with
aoti_eager enabled and with eager, in alternating rounds in one process
(median of the rounds); each round enables the ops again, as a new process
would, and first runs the pass once untimed. Needs the ``bench`` extra:
``pip install -e '.[bench]'``.

    python scripts/bench_batch.py [--device cpu|cuda] [--calls 50] [--layers 2] [--hidden 256]
        [--seed 0] [--rounds 5] [--cache-dir DIR] [--verbose] [--json]

Targets: no compiles in the last 40 calls, at most 3 compiles per shape
family, every output equal to eager's (``torch.testing.assert_close``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import BertConfig, BertModel

import aoti_eager
from aoti_eager.cache import inventory
from aoti_eager.kernels.dynamic import ShapeFamily
from aoti_eager.kernels.signature import short_form
from timing import machine, per_call_seconds, total_compiles, warm_rounds

BATCH = (1, 32)
SEQ = (8, 128)
QUIET_CALLS = 40  # the last 40 calls compile nothing
COMPILES_PER_FAMILY = 3

log = logging.getLogger("bench_batch")


def draw_inputs(calls: int, vocab_size: int, seed: int, device: str) -> list[dict[str, torch.Tensor]]:
    shapes = random.Random(seed)
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for _ in range(calls):
        batch, seq = shapes.randint(*BATCH), shapes.randint(*SEQ)
        lengths = torch.randint(1, seq + 1, (batch,), generator=generator)
        lengths[torch.randint(batch, (), generator=generator)] = seq
        mask = torch.arange(seq) < lengths[:, None]
        ids = torch.randint(1, vocab_size, (batch, seq), generator=generator).masked_fill(~mask, 0)
        inputs.append(dict(input_ids=ids.to(device), attention_mask=mask.long().to(device)))
    return inputs


def family(op: str, signature: list[dict[str, Any]]) -> str:
    """An entry's shape family as the issue counts them: the op, and each tensor's dtype and rank."""

    def form(described: dict[str, Any]) -> list[str]:
        if described["kind"] == "tensor":
            return [f"{described['dtype']}[{', '.join('_' * len(described['sizes']))}]"]
        if described["kind"] == "list":
            return [f for item in described["items"] for f in form(item)]
        return []

    return f"{op}({', '.join(f for d in signature for f in form(d))})"


def kind(meta: dict[str, Any]) -> str:
    """What an entry holds: a ``static`` or ``dynamic`` kernel, ``slower`` (a
    kernel built, then kept eager as slower than eager), or ``refused`` (none built)."""
    if meta.get("library") is not None:
        return "dynamic" if meta.get("dynamic") else "static"
    return "slower" if meta.get("timing") is not None else "refused"


def cache_entries(root: Path) -> dict[str, dict[str, Any]]:
    """Every entry under ``root`` by its directory: op, family, kind, and its
    signature as ``aoti-eager cache list`` shows it (symbols where a dynamic kernel's sizes move)."""
    entries = {}
    for listing in inventory.entries(root):
        meta = listing.metadata()
        signature, dynamic = meta.get("signature", []), meta.get("dynamic")
        entries[str(listing.directory)] = dict(
            op=listing.op, family=family(listing.op, signature), kind=kind(meta),
            signature=ShapeFamily.from_json(dynamic).short(signature) if dynamic else short_form(signature),
            reason=meta.get("reason"), created=meta.get("created", 0.0),
        )
    return entries


def mismatch(output: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None where ``output`` is close to eager's, else the first line of why not."""
    try:
        torch.testing.assert_close(output, expected)
    except AssertionError as e:
        return str(e).strip().splitlines()[0]
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256, help="width; 64 per attention head, 4 times as wide a feed-forward")
    parser.add_argument("--seed", type=int, default=0, help="of the weights and of the calls' shapes and tokens")
    parser.add_argument("--rounds", type=int, default=5, help="warm rounds of each, alternating")
    parser.add_argument("--cache-dir", default=None, help="default: a new empty cache")
    parser.add_argument("--verbose", action="store_true", help="each call's shape and aoti_eager's INFO log (every compile) on stderr")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    if args.verbose:
        logging.basicConfig(format="%(asctime)s %(message)s")
        for name in ("aoti_eager", log.name):
            logging.getLogger(name).setLevel(logging.INFO)

    torch.manual_seed(args.seed)
    config = BertConfig(
        num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
        intermediate_size=4 * args.hidden,
    )
    model = BertModel(config).eval().to(args.device)
    inputs = draw_inputs(args.calls, config.vocab_size, args.seed, args.device)

    @torch.no_grad()
    def forward(call: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(**call).last_hidden_state

    def run_all() -> None:
        for call in inputs:
            forward(call)

    eager_outputs = [forward(call) for call in inputs]
    ops = aoti_eager.ops_reached(forward, inputs[0])
    later = {name for call in inputs[1:] for name in aoti_eager.ops_reached(forward, call).names}
    outside = sorted(later - set(ops.names))

    with tempfile.TemporaryDirectory(prefix="aoti_eager-bench-") as scratch:
        root = Path(args.cache_dir or scratch)
        enable_kwargs = dict(devices=[args.device], cache_dir=root)
        seen = set(cache_entries(root))
        aoti_eager.enable(ops=ops, **enable_kwargs)
        outputs, per_call = [], []
        start = time.perf_counter()
        for i, call in enumerate(inputs):
            log.info("call %d: batch %d, seq %d", i, *call["input_ids"].shape)
            outputs.append(forward(call))
            entries = cache_entries(root)
            new = sorted((e for key, e in entries.items() if key not in seen), key=lambda e: e["created"])
            per_call.append([dict(call=i, **e) for e in new])
            seen |= entries.keys()
        cold_s = time.perf_counter() - start
        kernels_compiled = total_compiles()
        # A second pass in the same process: every shape is decided, nothing should compile.
        second_pass_s = per_call_seconds(run_all, 1)
        second_pass_compiles = total_compiles() - kernels_compiled
        aoti_eager.disable()
        # Compared only now: assert_close's own ops would otherwise run (and compile) with the overrides.
        mismatches = {i: why for i, (output, expected) in enumerate(zip(outputs, eager_outputs))
                      if (why := mismatch(output, expected)) is not None}
        log.info("warm rounds")
        warm = warm_rounds(run_all, ops, args.rounds, **enable_kwargs)

    compiles = [e for new in per_call for e in new if e["kind"] != "refused"]
    refused = [e for new in per_call for e in new if e["kind"] == "refused"]
    late = [e for e in compiles if e["call"] >= len(inputs) - QUIET_CALLS]
    families = Counter(e["family"] for e in compiles)
    worst = max(families.values(), default=0)
    over = [name for name, n in families.most_common() if n > COMPILES_PER_FAMILY]
    row = dict(
        device=args.device, torch=torch.__version__, transformers=transformers.__version__, layers=args.layers,
        hidden=args.hidden, seed=args.seed, calls=len(inputs),
        shapes=[list(call["input_ids"].shape) for call in inputs],
        padded_calls=sum(not bool(call["attention_mask"].all()) for call in inputs),
        enabled_ops=ops.names, refused_ops=ops.refused, later_ops_not_enabled=outside,
        compiles_per_call=[sum(e["kind"] != "refused" for e in new) for new in per_call],
        total_compiles=len(compiles), kernels_compiled=kernels_compiled,
        kept_eager_as_slower=sum(e["kind"] == "slower" for e in compiles), refused=refused,
        compiles_in_last_calls=len(late), late_compiles=late,
        families=len(families), compiles_per_family=dict(families.most_common()), max_compiles_per_family=worst,
        families_over_target={name: [e for e in compiles if e["family"] == name] for name in over},
        outputs_equal=not mismatches, mismatches=mismatches,
        cold_pass_s=cold_s, second_pass_s=second_pass_s, second_pass_compiles=second_pass_compiles, **warm,
    )
    row["targets"] = dict(
        no_compiles_in_last_calls=not late,
        compiles_per_family=worst <= COMPILES_PER_FAMILY,
        outputs_equal=row["outputs_equal"],
    )
    if args.json:
        print(json.dumps(row))
        return
    print(f"{machine(args.device)}, transformers {row['transformers']}")
    print(f"BERT, {args.layers} layers, width {args.hidden}; {len(inputs)} calls, batch {BATCH[0]}-{BATCH[1]}, "
          f"sequence {SEQ[0]}-{SEQ[1]} (seed {args.seed}), {row['padded_calls']} with padded rows")
    print("shapes (batch x sequence): " + " ".join(f"{b}x{s}" for b, s in row["shapes"]))
    print(f"enabled ({len(ops)}): {', '.join(ops.names)}")
    print(f"reached by later calls, not by the first (not enabled): {', '.join(outside) or 'none'}")
    print(f"compiles per call: {row['compiles_per_call']}")
    print(f"total compiles {len(compiles)} ({row['kept_eager_as_slower']} of them kept eager as slower); "
          f"in the last {QUIET_CALLS} calls: {len(late)}")
    for e in late:
        print(f"  call {e['call']}: {e['kind']} {e['op']}({e['signature']})")
    print(f"refused before compiling (no kernel built): {len(refused)}")
    calls_refused: dict[tuple[str, str], list[int]] = {}
    for e in refused:
        calls_refused.setdefault((e["op"], e["reason"]), []).append(e["call"])
    for (op, reason), calls in calls_refused.items():
        print(f"  {op} at calls {calls}: {reason}")
    print(f"shape families compiled: {len(families)}; compiles per family: max {worst}")
    for name in over:
        print(f"  {name}: {families[name]}")
        for e in row["families_over_target"][name]:
            print(f"    call {e['call']}: {e['kind']} ({e['signature']})")
    print(f"outputs equal to eager's: {row['outputs_equal']}"
          + "".join(f"\n  call {i}: {why}" for i, why in mismatches.items()))
    print(f"cold pass {cold_s:.1f} s; second pass {second_pass_s:.2f} s with {second_pass_compiles} compiles")
    print(f"warm pass {warm['warm_s']:.3f} s, eager {warm['eager_s']:.3f} s, ratio {warm['warm_ratio']:.2f} "
          f"(median of {args.rounds} rounds); compiles per round while enabling again: "
          f"{warm['reload_compiles_per_round']}, in timed passes: {warm['timed_compiles']}")
    print("targets: " + ", ".join(f"{name} {'met' if met else 'MISSED'}" for name, met in row["targets"].items()))


if __name__ == "__main__":
    main()
