"""Disk and memory that cached kernels cost.

1. Disk: the size of each cache entry folder (kernel.so, kernel.json where
   AOTInductor wrote one, entry.json), per op.
2. Host memory: a new process's resident set (VmRSS) before and after loading
   N cached kernels of distinct signatures (a few unary and binary ops over
   many shapes). Each signature runs eagerly first, so eager's own one-time
   costs (lazy library and kernel loading) are in the baseline; outputs are
   dropped, inputs stay allocated in both measurements. The first kernel also
   brings up AOTInductor's runtime, so it is reported apart from the others.
3. On CUDA, device memory per loaded kernel: ``torch.cuda.memory_allocated``
   (what the kernels keep through PyTorch's allocator) and the drop in
   ``torch.cuda.mem_get_info``'s free memory less the growth of the
   allocator's reserved memory (module code and data loaded by the driver).

The signatures are recorded into a manifest (a run with ``compile="never"``)
and compiled by ``aoti-eager prewarm --jobs J`` with the keep-eager timing off
(``AOTI_EAGER_KEEP_FASTER=0``), so that every signature has a kernel to load;
with ``--cache-dir`` an existing cache is reused and only what it lacks is
compiled.

    python scripts/bench_memory.py [--device cpu|cuda] [--kernels 100] [--jobs J]
        [--cache-dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

UNARY = ["abs", "neg", "exp", "sigmoid", "tanh", "sin", "cos", "erf", "reciprocal", "floor", "ceil", "expm1"]
BINARY = ["add.Tensor", "mul.Tensor", "sub.Tensor", "maximum", "minimum", "atan2"]
# Distinct ops compile in parallel; signatures of one op one at a time (the
# op's lock), so the set is wide enough to keep 16 jobs busy.
OPS = UNARY + BINARY


def signatures(count: int) -> list[tuple[str, int]]:
    """``count`` (op, length) pairs: the ops in turn, each over new lengths."""
    return [(OPS[i % len(OPS)], 256 * (1 + i // len(OPS))) for i in range(count)]


def overload_name(op: str) -> str:
    """Only the overload called is enabled: with a whole packet, a recording
    run (which runs the original kernels) would also record the ``.out``
    overloads those call inside."""
    return f"aten::{op}" if "." in op else f"aten::{op}.default"


def make_call(op: str, length: int, device: str):
    """The op's call on float32 vectors of ``length``, and its arguments."""
    packet, _, overload = overload_name(op).removeprefix("aten::").partition(".")
    overload = getattr(getattr(torch.ops.aten, packet), overload)
    x = torch.randn(length, device=device)
    args = (x,) if op in UNARY else (x, torch.randn(length, device=device))
    return overload, args


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def record_manifest(path: Path, calls: list[tuple[str, int]], device: str, cache_dir: Path) -> None:
    """Records the signatures the cache lacks, as misses (nothing compiles)."""
    import aoti_eager

    ops = sorted({overload_name(op) for op, _ in calls})
    aoti_eager.enable(ops, devices=[device], cache_dir=cache_dir, record=path, compile="never")
    try:
        for op, length in calls:
            overload, args = make_call(op, length, device)
            overload(*args)
    finally:
        aoti_eager.disable()


def prewarm(manifest: Path, cache_dir: Path, device: str, jobs: int | None) -> float:
    """Compiles what the cache lacks, every signature to a kernel; returns seconds."""
    env = {**os.environ, "AOTI_EAGER_KEEP_FASTER": "0"}
    command = [sys.executable, "-m", "aoti_eager", "--cache-dir", str(cache_dir), "prewarm", str(manifest),
               "--devices", device] + (["--jobs", str(jobs)] if jobs else [])
    start = time.perf_counter()
    out = subprocess.run(command, env=env, stdout=sys.stderr)
    if out.returncode not in (0, 1):  # 1: some entries failed; they are reported, not loaded
        raise SystemExit(f"prewarm exited with code {out.returncode}")
    return time.perf_counter() - start


def disk(cache_dir: Path, device: str, ops: set[str]) -> dict:
    """Bytes of each entry folder with a kernel, per op."""
    from aoti_eager.cache import inventory

    per_op: dict[str, list[int]] = {}
    for listing in inventory.entries(cache_dir):
        meta = listing.metadata()
        if listing.device == device and listing.op in ops and meta.get("library"):
            per_op.setdefault(listing.op, []).append(listing.bytes)
    every = [b for sizes in per_op.values() for b in sizes]
    return dict(
        entries=len(every),
        mean_bytes=statistics.mean(every) if every else None,
        min_bytes=min(every, default=None),
        max_bytes=max(every, default=None),
        per_op={op: dict(entries=len(s), mean_bytes=statistics.mean(s)) for op, s in sorted(per_op.items())},
    )


def measure(calls: list[tuple[str, int]], device: str, cache_dir: Path) -> dict:
    """Runs in a new process: memory before and after loading every call's kernel."""
    import aoti_eager

    prepared = [make_call(op, length, device) for op, length in calls]
    cuda = device == "cuda"

    def settle() -> None:
        gc.collect()
        if cuda:
            torch.cuda.synchronize()

    def snapshot() -> dict:
        settle()
        shot = dict(rss_mb=rss_mb())
        if cuda:
            free, _ = torch.cuda.mem_get_info()
            shot.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(), free=free)
        return shot

    for overload, args in prepared:  # eager's one-time costs go into the baseline
        overload(*args)
    aoti_eager.enable(sorted({overload_name(op) for op, _ in calls}), devices=[device], cache_dir=cache_dir)
    before = snapshot()
    first = None
    for i, (overload, args) in enumerate(prepared):
        overload(*args)  # the result is dropped at once: only the kernel stays
        if i == 0:
            first = snapshot()
    after = snapshot()
    stats = aoti_eager.stats()
    loads = sum(row["cache_loads"] for row in stats.values())
    hits_or_loads = dict(
        cache_loads=loads,
        compiles=sum(row["compiles"] for row in stats.values()),
        fallbacks=sum(row["fallbacks"] for row in stats.values()),
    )
    aoti_eager.disable()
    result = dict(kernels=len(prepared), **hits_or_loads, before=before, after_first=first, after=after)
    rest = max(1, loads - 1)
    result["rss_first_kernel_mb"] = first["rss_mb"] - before["rss_mb"]
    result["rss_per_kernel_mb"] = (after["rss_mb"] - first["rss_mb"]) / rest
    if cuda:
        def device_bytes(a: dict, b: dict) -> int:
            # Memory the driver took that the caching allocator did not reserve.
            return (a["free"] - b["free"]) - (b["reserved"] - a["reserved"])

        result["cuda_allocated_per_kernel_bytes"] = (after["allocated"] - first["allocated"]) / rest
        result["cuda_device_first_kernel_bytes"] = device_bytes(before, first)
        result["cuda_device_per_kernel_bytes"] = device_bytes(first, after) / rest
        result["cuda_device"] = torch.cuda.get_device_name()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--kernels", type=int, default=100, help="distinct signatures to compile and load")
    parser.add_argument("--jobs", type=int, default=None, help="prewarm jobs (default: prewarm's, from cores and memory)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="a cache to reuse (default: a new one, removed after)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # the measuring child
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    calls = signatures(args.kernels)
    if args.measure:
        print(json.dumps(measure(calls, args.device, args.cache_dir)))
        return

    with tempfile.TemporaryDirectory(prefix="aoti_eager-memory-") as scratch:
        cache_dir = args.cache_dir or Path(scratch) / "cache"
        manifest = Path(scratch) / "manifest.jsonl"
        record_manifest(manifest, calls, args.device, cache_dir)
        # Only misses are recorded: with every signature in the cache there is no manifest.
        prewarm_seconds = prewarm(manifest, cache_dir, args.device, args.jobs) if manifest.exists() else 0.0
        ops = {overload_name(op).removesuffix(".default") for op, _ in calls}  # as the cache names them
        on_disk = disk(cache_dir, args.device, ops)
        child = subprocess.run(
            [sys.executable, __file__, "--measure", "--device", args.device, "--kernels", str(args.kernels),
             "--cache-dir", str(cache_dir)],
            capture_output=True, text=True,
        )
        if child.returncode != 0:
            raise SystemExit(f"the measuring process failed:\n{child.stderr}")
        memory = json.loads(child.stdout.strip().splitlines()[-1])
    report = dict(device=args.device, torch=torch.__version__, kernels=args.kernels, ops=len({op for op, _ in calls}),
                  prewarm_seconds=round(prewarm_seconds, 1), disk=on_disk, memory=memory)
    if args.json:
        print(json.dumps(report, indent=1))
        return

    mb = 1 << 20
    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({memory['cuda_device']})" if args.device == "cuda" else "")
          + f", {args.kernels} signatures over {report['ops']} ops, prewarm {prewarm_seconds:.0f} s")
    if on_disk["entries"]:
        print(f"disk per entry: mean {on_disk['mean_bytes'] / 1024:.0f} KiB "
              f"(min {on_disk['min_bytes'] / 1024:.0f}, max {on_disk['max_bytes'] / 1024:.0f}) over {on_disk['entries']} entries")
        for op, row in on_disk["per_op"].items():
            print(f"  {op:<18} {row['entries']:>4} entries, mean {row['mean_bytes'] / 1024:.0f} KiB")
    print(f"loaded {memory['cache_loads']} kernels from the cache ({memory['compiles']} compiles, "
          f"{memory['fallbacks']} eager calls)")
    print(f"RSS: {memory['before']['rss_mb']:.1f} MB before, {memory['after']['rss_mb']:.1f} MB after; "
          f"first kernel {memory['rss_first_kernel_mb']:.2f} MB, then {memory['rss_per_kernel_mb']:.3f} MB per kernel")
    if args.device == "cuda":
        print(f"CUDA: allocator {memory['cuda_allocated_per_kernel_bytes'] / mb:.3f} MB per kernel; "
              f"device memory outside the allocator: first kernel {memory['cuda_device_first_kernel_bytes'] / mb:.2f} MB, "
              f"then {memory['cuda_device_per_kernel_bytes'] / mb:.3f} MB per kernel")


if __name__ == "__main__":
    main()
