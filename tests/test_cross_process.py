"""Many processes, one cache: a kernel compiled by one process is loaded by
the others; dead lock holders and killed compiles leave nothing wrong behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import filelock
import pytest
import torch

import aoti_eager
from aoti_eager.cache import KernelCache, inventory
from aoti_eager.kernels import toolchain
from aoti_eager.kernels.inductor import scratch
from aoti_eager.kernels.toolchain import environment_name
from helpers import assert_same_as_eager


SCRIPT = r"""
import json, sys, torch, aoti_eager
x = torch.linspace(-4, 4, 40)
expected = torch.sigmoid(x)
aoti_eager.enable(["aten::sigmoid"], devices=["cpu"], cache_dir=sys.argv[1])
results = [torch.sigmoid(x) for _ in range(3)]
stats = aoti_eager.stats()["aten::sigmoid"]
aoti_eager.disable()
for r in results:
    torch.testing.assert_close(r, expected)
print(json.dumps(stats))
"""


def run_process(cache_dir) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cache_dir)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_makes_no_compile(tmp_path):
    first = run_process(tmp_path)
    assert (first["compiles"], first["cache_loads"], first["hits"]) == (1, 0, 2), first
    second = run_process(tmp_path)
    assert (second["compiles"], second["cache_loads"], second["hits"]) == (0, 1, 2), second
    assert second["fallbacks"] == 0


def test_a_lock_whose_holder_died_is_taken_over(tmp_path, swap_toolchain):
    # The lock is an flock(2): the kernel drops it with its holder's last file
    # descriptor, however the holder dies. That is how a dead holder is detected.
    swap_toolchain(cpu_isa=lambda: "avx2")
    cache = KernelCache(tmp_path, environment_name(torch.device("cpu")))
    lock_path = cache.lock("aten::abs").lock_file
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, lock_path], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(filelock.Timeout):
            cache.lock("aten::abs", timeout=0.2).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    start = time.monotonic()
    with cache.lock("aten::abs", timeout=5):
        assert time.monotonic() - start < 1


HOLD_LOCK = r"""
import sys, time, filelock
held = filelock.FileLock(sys.argv[1])
held.acquire()
print("locked", flush=True)
time.sleep(600)
"""

COMPILE = r"""
import sys, torch, aoti_eager
aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=sys.argv[1])
torch.abs(torch.linspace(-3, 3, 24))
"""


# COMPILE, held after Inductor's first compiler run until it is killed.
STALLED_COMPILE = r"""
import pathlib, sys, time
from torch._inductor import cpp_builder
build = cpp_builder.CppBuilder.build
def stalled(builder):
    build(builder)
    pathlib.Path(sys.argv[2]).touch()
    time.sleep(600)
cpp_builder.CppBuilder.build = stalled
""" + COMPILE


def test_kill_9_in_the_middle_of_a_compile_leaves_no_entry_and_no_scratch_files(tmp_path):
    temporary = tmp_path / "tmp"  # where Inductor would keep its files by default
    temporary.mkdir()
    environment = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    building = tmp_path / "building"
    compiling = subprocess.Popen(
        [sys.executable, "-c", STALLED_COMPILE, str(tmp_path / "cache"), str(building)], env={**environment, "TMPDIR": str(temporary)},
    )

    def left_behind():
        # The compile's scratch directory exists only while it runs, under the lock.
        return list(scratch.root().glob(f"compile-*-{compiling.pid}-*"))

    try:
        deadline = time.monotonic() + 300
        # Killed once Inductor has built some of the generated C++ (a compile
        # is too quick now to be caught in it by timing).
        while not building.exists():
            assert compiling.poll() is None and time.monotonic() < deadline, "the compile never started"
            time.sleep(0.05)
    finally:
        compiling.send_signal(signal.SIGKILL)
        compiling.wait()
    assert compiling.returncode == -signal.SIGKILL
    assert inventory.entries(tmp_path / "cache") == [], "a killed compile published an entry"
    assert left_behind()
    files = [path for path in temporary.rglob("*") if not path.is_dir()]
    assert files == [], "a compile kept files outside the directories of this user's"

    # The next process compiles it and cleans up what the killed one left.
    x = torch.linspace(-3, 3, 24)
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path / "cache"):
        result = torch.abs(x)
        stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(result, x.abs())
    assert stats["compiles"] == 1, stats
    assert not left_behind() and not list(tmp_path.rglob(".tmp-*"))
    assert len(inventory.entries(tmp_path / "cache")) == 1


STRESS = r"""
import json, pathlib, sys, time, torch, aoti_eager
cache_dir, index, processes = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
x = torch.linspace(-5, 5, 40).reshape(4, 10)
aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=cache_dir)
# Everyone misses at once: wait until every process is ready.
(cache_dir / f"ready-{index}").touch()
while len(list(cache_dir.glob("ready-*"))) < processes:
    time.sleep(0.01)
result = torch.abs(x)
torch.testing.assert_close(result, x.abs(), rtol=0, atol=0)
print(json.dumps(aoti_eager.stats()["aten::abs"]))
"""


def test_processes_that_miss_together_compile_once(tmp_path):
    processes = 8
    started = [
        subprocess.Popen([sys.executable, "-c", STRESS, str(tmp_path), str(i), str(processes)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(processes)
    ]
    stats = []
    for process in started:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        stats.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(s["compiles"] for s in stats) == 1, stats
    assert sum(s["cache_loads"] for s in stats) == processes - 1, stats
    assert sum(s["fallbacks"] for s in stats) == 0, stats
