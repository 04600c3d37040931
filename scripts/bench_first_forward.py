"""A model's first forward with an empty cache: aoti_eager compiling now, in
the background, and ``torch.compile(model)``, each in a new process.

GPT-2 and BERT (Hugging Face transformers, built from configs: random weights,
nothing downloaded; the ``bench`` extra) with every op their forward reaches
enabled (``aoti_eager.ops_reached``). Each measurement runs in a new process
with an empty kernel cache and empty Inductor and Triton caches, as for a user
who has used aoti_eager before on this machine (its extension, machine records
and precompiled headers are the user's, not the cache's; a first run warms
them and is not reported):

- ``eager``: the forward's warm time, the reference for the others;
- ``now``: ``compile="now"``, seconds of the first forward (every compile in it);
- ``background``: ``compile="background"``, then the forward again and again:
  seconds from the first forward's start to the first forward in which no
  call missed and no background compile was still running (every signature
  compiled and in use), and how long the forwards meanwhile took against eager's;
- ``torch.compile``: seconds of the compiled model's first forward.

The aoti_eager processes enable their ops first, as a script does at its top,
then build the model (``import transformers`` included) and time eager's
forward with the ops disabled; "head start" is the seconds from ``enable()``
to the first forward, which background compiles use to start the process their
workers fork from. The ops are those the forward reaches
(``aoti_eager.ops_reached``), found beforehand in a process of their own.

Then each process times its warm forward against eager's, in alternating
rounds, and checks its output against eager's.

    python scripts/bench_first_forward.py [--device cpu|cuda] [--models gpt2,bert] [--layers 2] [--verbose] [--json]

``--verbose`` passes each process's stderr on, with aoti_eager's log in it
(milliseconds since the process started): every compile, and each background compile's
seconds in its worker (in a new worker: with the worker's start-up).

Targets (issue "Cold start", on the H100): with ``background``, every
signature in use within 10 s of the first forward (GPT-2) and 5 s (BERT), the
forwards meanwhile at eager's speed; with ``now``, GPT-2's first forward within 40 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_BACKGROUND_S = {"gpt2": 10.0, "bert": 5.0}
TARGET_NOW_S = {"gpt2": 40.0}
# A background row that has not got every kernel in use by then reports none.
GIVE_UP_S = 300.0
MODES = ("eager", "now", "background", "torch.compile")


def build(model_name: str, layers: int, device: str):
    """The model (width 768, 12 heads) and its inputs: a batch of 2 sequences of 32 tokens."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if model_name == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=768, n_head=12)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(num_hidden_layers=layers, hidden_size=768, num_attention_heads=12)
        model = transformers.BertModel(config)
    ids = torch.randint(0, config.vocab_size, (2, 32), device=device)
    return model.eval().to(device), dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def child(model_name: str, mode: str, layers: int, device: str, rounds: int, verbose: bool, ops: list[str]) -> dict:
    import logging

    import torch

    import aoti_eager

    if verbose:
        logging.basicConfig(format="%(relativeCreated)8.0f ms %(message)s")
        logging.getLogger("aoti_eager").setLevel(logging.DEBUG)
    enabled_at = time.perf_counter()
    if mode in ("now", "background"):
        aoti_eager.enable(ops, devices=[device], compile=mode)
        aoti_eager.disable()  # eager's forward below is the benchmark's, not the script's
    model, inputs = build(model_name, layers, device)

    def forward(fn=model):
        with torch.no_grad():
            output = fn(**inputs)
        return output.logits if model_name == "gpt2" else output.last_hidden_state

    def timed(fn=model) -> tuple[float, torch.Tensor]:
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        output = forward(fn)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start, output

    if mode == "ops":
        return dict(ops=[f"{op._schema.name}.{op._overloadname}" for op in aoti_eager.ops_reached(forward)])
    expected = forward()
    eager_s = statistics.median(timed()[0] for _ in range(rounds))
    row: dict = dict(model=model_name, mode=mode, eager_ms=eager_s * 1e3)
    if mode == "eager":
        return row

    if mode == "torch.compile":
        fn, on, off = torch.compile(model), (lambda: None), (lambda: None)
        row["first_forward_s"], output = timed(fn)
    else:
        fn = model
        row["enabled_ops"] = len(ops)
        on = lambda: aoti_eager.enable(ops, devices=[device], compile=mode)  # noqa: E731
        off = aoti_eager.disable
        misses = lambda: {op: s["misses"] for op, s in aoti_eager.stats().items() if s["misses"]}  # noqa: E731
        compiling = lambda: {op: s["compiling"] for op, s in aoti_eager.stats().items() if s["compiling"]}  # noqa: E731
        on()
        start = time.perf_counter()
        row["head_start_s"] = start - enabled_at
        row["first_forward_s"], output = timed()
        if mode == "background":
            meanwhile, missed = [], misses()
            # Forwards with pauses between them, as a workload leaves the
            # compiles some of the CPU, until one of them misses nothing and
            # no compile is still running (calls of a signature that is
            # compiling run eagerly without a miss).
            said = time.perf_counter()
            while time.perf_counter() - start < GIVE_UP_S:
                time.sleep(0.05)
                seconds, output = timed()
                now_missed, now_compiling = misses(), compiling()
                if now_missed == missed and not now_compiling:
                    row["all_in_use_s"] = time.perf_counter() - seconds - start
                    break
                meanwhile.append(seconds)
                if verbose and time.perf_counter() - said > 10:
                    said = time.perf_counter()
                    missing = {op: n - missed.get(op, 0) for op, n in now_missed.items() if n != missed.get(op, 0)}
                    print(f"{(said - start):.0f} s: missed {missing}, compiling {now_compiling}", file=sys.stderr, flush=True)
                missed = now_missed
            row["forwards_meanwhile"] = len(meanwhile)
            if meanwhile:
                row["meanwhile_median_ms"] = statistics.median(meanwhile) * 1e3
                row["meanwhile_max_ms"] = max(meanwhile) * 1e3
        row["compiles"] = sum(s["compiles"] + s["queued"] for s in aoti_eager.stats().values())
    off()  # assert_close's own aten calls are not the model's: no compiles of them
    torch.testing.assert_close(output, expected, rtol=1e-3, atol=1e-3)

    warm, eager = [], []
    for _ in range(rounds):
        on()
        timed(fn)
        warm.append(timed(fn)[0])
        off()
        eager.append(timed()[0])
    row["warm_ratio"] = statistics.median(warm) / statistics.median(eager)
    return row


def run_child(model_name: str, mode: str, args: argparse.Namespace, ops: list[str] = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="aoti_eager-first-forward-") as scratch:
        env = dict(
            os.environ, AOTI_EAGER_CACHE_DIR=os.path.join(scratch, "kernels"),
            TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, "inductor"), TRITON_CACHE_DIR=os.path.join(scratch, "triton"),
        )
        command = [sys.executable, __file__, "--child", model_name, mode, "--device", args.device, "--layers",
                   str(args.layers), "--rounds", str(args.rounds), "--ops", ",".join(ops)] + ["--verbose"] * args.verbose
        if args.verbose:
            print(f"{model_name} {mode}:", file=sys.stderr, flush=True)
        # Verbose, the child's stderr is ours as it comes: a run that never ends still says why.
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=None if args.verbose else subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{model_name} {mode} failed:\n{(done.stderr or '')[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--models", default="gpt2,bert")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="warm rounds of each, alternating")
    parser.add_argument("--no-warm-up", action="store_true", help="skip the unreported first run of each mode")
    parser.add_argument("--verbose", action="store_true", help="each process's aoti_eager log on stderr")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--ops", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        ops = args.ops.split(",") if args.ops else []
        print(json.dumps(child(*args.child, args.layers, args.device, args.rounds, args.verbose, ops)))
        return

    from timing import machine

    models, modes = args.models.split(","), args.modes.split(",")
    reached = {name: run_child(name, "ops", args)["ops"] for name in models}
    if not args.no_warm_up:
        # Builds what is the user's, not the cache's (the extension, machine
        # records, precompiled headers), as an earlier use would have.
        run_child(models[0], "background", argparse.Namespace(**{**vars(args), "layers": 1, "rounds": 1}), reached[models[0]])
    if not args.json:
        print(f"{machine(args.device)}, {os.cpu_count()} CPUs, {args.layers} layers, batch 2 of 32 tokens")
        print("| model | mode | head start s | first forward s | all in use s | forwards meanwhile: median / max ms (eager ms) | compiles | warm vs eager |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    rows = []
    for model_name in models:
        for mode in modes:
            rows.append(row := run_child(model_name, mode, args, reached[model_name]))
            if row["mode"] == "background":
                row["target_met"] = row.get("all_in_use_s", float("inf")) <= TARGET_BACKGROUND_S[row["model"]]
            elif row["mode"] == "now" and row["model"] in TARGET_NOW_S:
                row["target_met"] = row["first_forward_s"] <= TARGET_NOW_S[row["model"]]
            if not args.json:
                print(_markdown(row), flush=True)
    if args.json:
        print(json.dumps(dict(machine=machine(args.device), cpus=os.cpu_count(), layers=args.layers, rows=rows)))


def _markdown(row: dict) -> str:
    meanwhile = f"({row['eager_ms']:.1f})"
    if "forwards_meanwhile" in row:
        meanwhile = (f"{row['forwards_meanwhile']}: {row.get('meanwhile_median_ms', 0):.1f} / "
                     f"{row.get('meanwhile_max_ms', 0):.1f} {meanwhile}")
    cells = [
        row["model"], row["mode"], f"{row['head_start_s']:.1f}" if "head_start_s" in row else "",
        f"{row['first_forward_s']:.2f}" if "first_forward_s" in row else "",
        f"{row['all_in_use_s']:.1f}" if "all_in_use_s" in row else "", meanwhile, str(row.get("compiles", "")),
        f"{row['warm_ratio']:.2f}x" if "warm_ratio" in row else "",
    ]
    return "| " + " | ".join(cells) + " |"


if __name__ == "__main__":
    main()
