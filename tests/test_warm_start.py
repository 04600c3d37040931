"""Starting warm: recording misses, prewarming a manifest, background
compiles, and shipping a cache as a bundle."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import aoti_eager
from aoti_eager import _background, _decisions, _worker
from aoti_eager._ops import overload_named, qualified_name
from aoti_eager.cache import KernelCache, inventory, signing
from aoti_eager.cache.store import LIBRARY_FILE
from aoti_eager.cli import main
from aoti_eager.kernels import toolchain
from aoti_eager.kernels.compile import call_op, compile_options
from aoti_eager.kernels.examples import example_arguments
from aoti_eager.kernels.signature import CallSignature
from aoti_eager.kernels.toolchain import environment_name
from aoti_eager.kernels import CompileRequest
from aoti_eager.manifest import read_manifest
from helpers import assert_same_as_eager, op_rows, publish_kernel, run_shapes

A = torch.ops.aten


def manifest_of(path: Path, calls: list[tuple[torch._ops.OpOverload, list]]) -> list[CompileRequest]:
    """Writes a manifest of ``calls`` (op, arguments as the dispatcher sees them)."""
    entries = []
    for op, args in calls:
        signature = CallSignature.of(op, "cpu", args)
        entries.append(CompileRequest(qualified_name(op), "cpu", signature.key, signature.to_json()))
    path.write_text("".join(json.dumps(e.to_json()) + "\n" for e in entries))
    return entries


def run_python(code: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600,
                         env={**os.environ, **(env or {})})
    assert out.returncode == 0, out.stderr
    return out


def aoti_eager_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aoti_eager", *argv], capture_output=True, text=True, timeout=1800)


RECORD = r"""
import sys, torch, aoti_eager
aoti_eager.enable(["aten::abs", "aten::add.Tensor"], devices=["cpu"], cache_dir=sys.argv[1], compile="never")
for n in map(int, sys.argv[2:]):
    x = torch.randn(n)
    for _ in range(2):
        torch.abs(x)
        torch.add(x, 2.0, alpha=3)
"""


@pytest.fixture(scope="module", autouse=True)
def _vec_isas_probed():
    """Background CPU misses run eagerly until the CPU's vector ISAs are known
    (probed once per machine, up to 45 s on a GPU host): the tests here that
    are not about that probe start after it."""
    toolchain.cpu_isa()


def test_two_processes_record_into_one_manifest(tmp_path, shared_cache):
    manifest = tmp_path / "misses.jsonl"
    env = {**os.environ, "AOTI_EAGER_RECORD": str(manifest)}
    processes = [
        subprocess.Popen([sys.executable, "-c", RECORD, str(shared_cache), *sizes], env=env,
                         stderr=subprocess.PIPE, text=True)
        for sizes in (["3", "5"], ["5", "7"])
    ]
    for p in processes:
        assert p.wait(timeout=1800) == 0, p.stderr.read()
    lines = manifest.read_text().splitlines()
    entries = [CompileRequest.from_json(json.loads(line)) for line in lines]
    assert len({e.id for e in entries}) == len(entries), "a signature was recorded twice"
    # Each process's first size (3, 5) is its own kernel; its second makes the size a
    # symbol: the one dynamic kernel both processes recorded.
    abs_keys = {CallSignature.of(A.abs.default, "cpu", [torch.randn(n)]).key for n in (3, 5)}
    assert {e.key for e in entries if e.op == "aten::abs" and e.dynamic is None} == abs_keys
    assert [e.dynamic["dims"] for e in entries if e.op == "aten::abs" and e.dynamic] == [[[0]]]
    assert len([e for e in entries if e.op == "aten::add.Tensor"]) == 3


def test_example_arguments_rebuild_the_recorded_signature(tmp_path, shared_cache):
    base = torch.randn(9, 7)
    calls = [
        (A.abs.default, [base.t()]),  # not contiguous
        (A.abs.default, [base.flatten()[1:]]),  # not aligned
        (torch.add, [base, 2.5]),  # reaches add.Tensor as a wrapped number
        (A.add.Tensor, [base.to(torch.int32), base.to(torch.int32)], {"alpha": 3}),
    ]
    recorded, rebuilt = tmp_path / "recorded.jsonl", tmp_path / "rebuilt.jsonl"
    ops = ["aten::abs.default", "aten::add.Tensor"]
    # compile="never": nothing is published, so the rebuilt calls miss too.
    aoti_eager.enable(ops, devices=["cpu"], cache_dir=shared_cache, record=recorded, compile="never")
    for op, args, *kwargs in calls:
        op(*args, **(kwargs[0] if kwargs else {}))
    aoti_eager.disable()
    entries = read_manifest(recorded)
    assert len(entries) == len(calls)
    aoti_eager.enable(ops, devices=["cpu"], cache_dir=shared_cache, record=rebuilt, compile="never")
    for entry in entries:
        args = example_arguments(entry.signature, torch.device("cpu"))
        call_op(overload_named(entry.op), args)
    aoti_eager.disable()
    assert [e.id for e in read_manifest(rebuilt)] == [e.id for e in entries]


@pytest.fixture(scope="module")
def warm_manifest(shared_cache, tmp_path_factory):
    """A manifest of two calls of different ops (they compile in parallel)."""
    path = tmp_path_factory.mktemp("manifest") / "model.jsonl"
    x = torch.randn(4, 4)
    manifest_of(path, [(A.abs.default, [x]), (A.add.Tensor, [x, x, 1])])
    return path


WARM_RUN = r"""
import json, sys, torch, aoti_eager
x = torch.randn(4, 4)
aoti_eager.enable(["aten::abs", "aten::add.Tensor"], devices=["cpu"], cache_dir=sys.argv[1])
results = [torch.abs(x), torch.add(x, x)]
stats = aoti_eager.stats()
aoti_eager.disable()
torch.testing.assert_close(results[0], x.abs())
torch.testing.assert_close(results[1], x + x)
print(json.dumps(stats))
"""


def test_prewarm_with_two_jobs_then_a_new_process_compiles_nothing(shared_cache, warm_manifest):
    out = aoti_eager_cli("--cache-dir", str(shared_cache), "prewarm", str(warm_manifest), "--jobs", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "total" in out.stdout and "2 entries in" in out.stdout
    stats = json.loads(run_python(WARM_RUN, str(shared_cache)).stdout.splitlines()[-1])
    for op in ("aten::abs", "aten::add.Tensor"):
        assert (stats[op]["compiles"], stats[op]["cache_loads"], stats[op]["hits"]) == (0, 1, 0), stats
        assert stats[op]["fallbacks"] == 0
    again = aoti_eager_cli("--cache-dir", str(shared_cache), "prewarm", str(warm_manifest), "--json")
    assert again.returncode == 0, again.stderr
    assert {r["status"] for r in json.loads(again.stdout)["results"]} == {"cached"}


def test_interrupted_prewarm_leaves_the_cache_consistent_and_resumes(shared_cache, tmp_path):
    manifest = tmp_path / "misses.jsonl"
    first, second = manifest_of(manifest, [(A.abs.default, [torch.randn(6, n)]) for n in (3, 2)])
    cache = KernelCache(shared_cache, environment_name(torch.device("cpu"), compile_options("cpu")))
    prewarm = subprocess.Popen(
        [sys.executable, "-m", "aoti_eager", "--cache-dir", str(shared_cache), "prewarm", str(manifest), "--jobs", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # A shell without job control starts background jobs with SIGINT ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert prewarm.stdout.readline().startswith("[1/2 done"), prewarm.communicate()
    prewarm.send_signal(signal.SIGINT)  # while the second entry compiles
    out, err = prewarm.communicate(timeout=60)
    assert prewarm.returncode == 130, out + err
    assert "run the same command again" in err
    assert inventory.verify(shared_cache) == []
    assert cache.lookup(first.op, first.key).library is not None
    assert cache.lookup(second.op, second.key) is None

    resumed = aoti_eager_cli("--cache-dir", str(shared_cache), "prewarm", str(manifest), "--json")
    assert resumed.returncode == 0, resumed.stderr
    assert [r["status"] for r in json.loads(resumed.stdout)["results"]] == ["cached", "compiled"]
    assert cache.lookup(second.op, second.key).library is not None
    op_dir = cache.entry_dir(second.op, second.key).parent
    assert not list(op_dir.glob(".tmp-*")), "the interrupted compile left its scratch directory"


def test_prewarm_reports_entries_it_cannot_compile(shared_cache, tmp_path):
    manifest = tmp_path / "misses.jsonl"
    (entry,) = manifest_of(manifest, [(A.abs.default, [torch.randn(4, 4)])])
    # A key that the rebuilt call does not produce: its entry never appears.
    manifest.write_text(json.dumps({**entry.to_json(), "key": "0" * 24}) + "\n")
    out = aoti_eager_cli("--cache-dir", str(shared_cache), "prewarm", str(manifest))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAILED aten::abs on cpu (self=float32[4, 4])" in out.stdout
    missing = aoti_eager_cli("--cache-dir", str(shared_cache), "prewarm", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "none.jsonl" in missing.stderr, missing.stderr


def _calls_until(predicate, call, timeout: float = 1200):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = call()
        if predicate():
            return result
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_background_compile_answers_eagerly_at_once_then_hits(shared_cache):
    x = torch.randn(5, 3)
    aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=shared_cache, compile="background")
    start = time.perf_counter()
    first = torch.abs(x)
    seconds = time.perf_counter() - start
    stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(first, x.abs())
    # Queued, unless the machine's vector ISAs are still being probed (the next test).
    assert (stats["compiles"], stats["fallbacks"]) == (0, 1) and stats["queued"] <= 1, stats
    assert seconds < 5, f"the first call waited {seconds:.1f} s"
    hits = lambda: aoti_eager.stats()["aten::abs"]["hits"] > 0  # noqa: E731
    later = _calls_until(hits, lambda: torch.abs(x))
    assert_same_as_eager(later, x.abs())
    assert aoti_eager.stats()["aten::abs"]["cache_loads"] == 1


def test_no_call_waits_for_the_probe_of_the_cpus_vector_isas(shared_cache, monkeypatch, swap_toolchain):
    """CPU kernels' cache is named by the vector ISA, which Inductor probes
    once per machine (30 s on an H100 host): a background miss before the
    probe ends runs eagerly at once, counted as compiling (its compile is to
    come), and a later one compiles."""
    probe_may_end, probed = threading.Event(), threading.Event()
    cpu_isa = toolchain.current().cpu_isa

    def slow_probe() -> str:
        probe_may_end.wait(timeout=30)
        probed.set()
        return cpu_isa()

    swap_toolchain(vec_isas_known=probed.is_set)
    swap_toolchain(cpu_isa=slow_probe)
    monkeypatch.setattr(_background, "_probe", None)
    x = torch.randn(7, 2)
    aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=shared_cache, compile="background")
    results = [torch.abs(x) for _ in range(3)]
    stats = aoti_eager.stats()["aten::abs"]
    for result in results:
        assert_same_as_eager(result, x.abs())
    assert (stats["queued"], stats["compiles"], stats["fallbacks"], stats["compiling"]) == (0, 0, 3, 1), stats
    assert _background._probe.is_alive()
    probe_may_end.set()
    hits = lambda: aoti_eager.stats()["aten::abs"]["hits"] > 0  # noqa: E731
    assert_same_as_eager(_calls_until(hits, lambda: torch.abs(x)), x.abs())
    assert aoti_eager.stats()["aten::abs"]["queued"] == 1


def test_a_worker_rebuilds_each_entry_alone(shared_cache, tmp_path):
    """A worker that rebuilt one entry rebuilds the next as recorded: the
    shapes it saw before do not make the next one's call a family's."""
    entries = manifest_of(tmp_path / "m.jsonl", [(A.abs.default, [torch.randn(5, 3)]), (A.abs.default, [torch.randn(7, 2)])])
    outcomes = [_worker.warm(entry, shared_cache) for entry in entries]
    assert {o.status for o in outcomes} <= {"cached", "compiled"}, outcomes
    cache = KernelCache(shared_cache, environment_name(torch.device("cpu"), compile_options("cpu")))
    for entry in entries:
        assert cache.lookup(entry.op, entry.key) is not None, entry


def test_calls_while_their_kernel_compiles_ask_for_it_once_a_retry_interval(tmp_path, monkeypatch):
    """Calls of a signature compiling in the background run the original
    kernel straight from C++; one call a retry interval asks Python again."""
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", _SLOW_WORKER])  # answers after a second
    x = torch.randn(5, 3)
    aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=tmp_path / "cache", compile="background")
    start = time.monotonic()
    results = [torch.abs(x) for _ in range(1000)]
    elapsed = time.monotonic() - start
    stats = aoti_eager.stats()["aten::abs"]
    assert (stats["calls"], stats["fallbacks"], stats["queued"], stats["compiling"]) == (1000, 1000, 1, 1), stats
    assert stats["misses"] <= 1 + elapsed / _decisions.BACKGROUND_RETRY_SECONDS, (stats, elapsed)
    for result in results[:: len(results) // 10]:
        assert_same_as_eager(result, x.abs(), atol=0, rtol=0)
    time.sleep(_decisions.BACKGROUND_RETRY_SECONDS)
    asked = stats["misses"]
    assert_same_as_eager(torch.abs(x), x.abs(), atol=0, rtol=0)
    assert aoti_eager.stats()["aten::abs"]["misses"] == asked + 1  # the compile is still running: asks again later


def test_a_crashing_background_compile_falls_back_to_eager(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    x = torch.randn(2, 9)
    # A cache of its own: the background thread keeps a worker per cache while entries come.
    aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=tmp_path / "cache", compile="background")
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        failed = lambda: "background compile failed" in (aoti_eager.stats()["aten::abs"]["fallback_reason"] or "")  # noqa: E731
        result = _calls_until(failed, lambda: torch.abs(x), timeout=60)
    assert_same_as_eager(result, x.abs())
    assert "SIGKILL" in aoti_eager.stats()["aten::abs"]["fallback_reason"]
    assert any("SIGKILL" in r.message for r in caplog.records)
    assert_same_as_eager(torch.abs(x), x.abs())


# Answers each entry with its own pid; dies on every entry of aten::neg.
_FAKE_WORKER = r"""
import json, os, signal, sys
for line in sys.stdin:
    if json.loads(line)["op"].startswith("aten::neg"):
        os.kill(os.getpid(), signal.SIGKILL)
    print(json.dumps({"status": "compiled", "reason": str(os.getpid())}), flush=True)
"""


# Answers each entry with its own pid, a second after it came.
_SLOW_WORKER = r"""
import json, os, sys, time
for line in sys.stdin:
    time.sleep(1)
    print(json.dumps({"status": "compiled", "reason": str(os.getpid())}), flush=True)
"""


@pytest.mark.parametrize("jobs, workers", [(3, 3), (1, 1)])
def test_background_compiles_run_side_by_side_up_to_the_setting(tmp_path, monkeypatch, jobs, workers):
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", _SLOW_WORKER])
    monkeypatch.setenv("AOTI_EAGER_BACKGROUND_JOBS", str(jobs))
    # A root of its own: a thread left idle by another test starts a worker for it too.
    entries = [CompileRequest("aten::abs.default", "cpu", f"key-{i}", []) for i in range(3)]
    futures = [_background.submit(_background.InWorker(entry, tmp_path / "cache")) for entry in entries]
    answered_by = {future.result(timeout=120).reason for future in futures}
    assert len(answered_by) == workers


def test_one_worker_compiles_entry_after_entry_and_a_dead_one_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", _FAKE_WORKER])
    manifest = tmp_path / "manifest.jsonl"
    calls = [(A.abs.default, [torch.randn(n)]) for n in (2, 3)] + [(A.neg.default, [torch.randn(2)])]
    manifest_of(manifest, calls + [(A.abs.default, [torch.randn(n)]) for n in (4, 5)])
    before = set(_worker._running)  # e.g. a background compile's worker
    report = aoti_eager.prewarm(manifest, jobs=1, cache_dir=tmp_path / "cache")
    outcomes = [r.outcome for r in report.results]
    assert [o.status for o in outcomes] == ["compiled", "compiled", "failed", "compiled", "compiled"], outcomes
    assert "SIGKILL" in outcomes[2].reason
    first, second = {outcomes[0].reason, outcomes[1].reason}, {outcomes[3].reason, outcomes[4].reason}
    assert len(first) == 1 and len(second) == 1 and first != second, outcomes
    assert _worker._running <= before, "prewarm left a worker running"


def test_a_worker_that_does_not_answer_in_time_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", "import time; time.sleep(60)"])
    worker = _worker.Worker(tmp_path)
    entry = CompileRequest("aten::abs.default", "cpu", "key", [])
    start = time.monotonic()
    outcome = worker.compile(entry, timeout=1)
    assert outcome.status == "failed" and "took over 1 s" in outcome.reason, outcome
    assert time.monotonic() - start < 30 and worker._process is None


def test_one_pool_runs_jobs_here_and_in_workers(tmp_path, monkeypatch):
    """A region's compile runs on a thread of the pool, an op's in a worker
    process that thread drives; wait() waits for both, and an error is the future's."""
    answer = 'import json, os; input(); print(json.dumps({"status": "compiled", "reason": str(os.getpid())}), flush=True)'
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", answer])

    def failing():
        raise ValueError("no kernel")

    here = _background.submit(_background.Here(lambda: threading.current_thread().name))
    there = _background.submit(_background.InWorker(CompileRequest("aten::abs.default", "cpu", "key", []), tmp_path))
    failed = _background.submit(_background.Here(failing))
    assert _background.wait(timeout=60)
    assert here.result() == "aoti_eager-background-compiles"
    assert there.result().status == "compiled" and int(there.result().reason) != os.getpid()
    with pytest.raises(ValueError, match="no kernel"):
        failed.result()


def test_background_workers_yield_the_cpu_and_prewarms_do_not(tmp_path, monkeypatch):
    """A background worker runs beside the calls it compiles for, at a lower
    priority; prewarm's are the job itself."""
    answer = 'import json, os; input(); print(json.dumps({"status": "compiled", "reason": str(os.nice(0))}), flush=True)'
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", answer])
    entry = CompileRequest("aten::abs.default", "cpu", "key", [])
    ours = os.nice(0)
    background = _background.submit(_background.InWorker(entry, tmp_path)).result(timeout=60)
    prewarm_worker = _worker.Worker(tmp_path)
    try:
        prewarm = prewarm_worker.compile(entry, timeout=60)
    finally:
        prewarm_worker.close()
    assert int(background.reason) == min(19, ours + _background.NICENESS), background
    assert int(prewarm.reason) == ours, prewarm


def test_workers_share_the_cores_as_inductors_compile_threads(tmp_path, monkeypatch):
    """Inductor's own default, a compile pool of one process per core in
    every worker, oversubscribed the cores many times over."""
    answer = 'import json, os; input(); print(json.dumps({"status": "compiled", "reason": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")}), flush=True)'
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", answer])
    monkeypatch.setattr(_worker, "_cores", lambda: 16)
    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    entry = CompileRequest("aten::abs.default", "cpu", "key", [])

    def threads(jobs: int) -> str:
        worker = _worker.Worker(tmp_path, jobs=jobs)
        try:
            return worker.compile(entry, timeout=60).reason
        finally:
            worker.close()

    assert [threads(jobs) for jobs in (1, 4, 16, 32)] == ["16", "4", "1", "1"]
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "3")  # the user's choice
    assert threads(16) == "3"


def test_workers_create_cuda_contexts_of_one_hardware_queue(tmp_path, monkeypatch):
    """The driver creates contexts one at a time, the quicker with fewer queues;
    a worker runs one stream. A value the user set is kept."""
    answer = 'import json, os; input(); print(json.dumps({"status": "compiled", "reason": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}), flush=True)'
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", answer])
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    entry = CompileRequest("aten::abs.default", "cuda", "key", [])

    def connections() -> str:
        worker = _worker.Worker(tmp_path)
        try:
            return worker.compile(entry, timeout=60).reason
        finally:
            worker.close()

    assert connections() == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "4")
    assert connections() == "4"


def ship(source: Path, tmp_path: Path, capsys) -> Path:
    """The cache at ``source`` exported as a signed bundle and imported into an
    empty cache, every entry imported and verified; that cache's root."""
    bundle, imported = tmp_path / "kernels.tar.gz", tmp_path / "imported"
    signing.generate_key_pair(tmp_path / "key")
    assert main(["--cache-dir", str(source), "cache", "export", str(bundle), "--sign-key", str(tmp_path / "key")]) == 0
    capsys.readouterr()
    assert main(["--cache-dir", str(imported), "cache", "import", str(bundle), "--trust-key", str(tmp_path / "key.pub"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["imported"] and sorted(report["imported"]) == sorted(
        "/".join(listing.directory.parts[-3:]) for listing in inventory.entries(imported)
    )
    assert inventory.verify(imported) == []
    return imported


def test_export_then_import_into_an_empty_cache_compiles_nothing(shared_cache, tmp_path, capsys):
    x = torch.randn(4, 4)
    with aoti_eager.enabled(["aten::abs"], devices=["cpu"], cache_dir=shared_cache):
        torch.abs(x)  # compiled here unless another test did
    imported = ship(shared_cache, tmp_path, capsys)
    aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=imported)
    result = torch.abs(x)
    stats = aoti_eager.stats()["aten::abs"]
    assert_same_as_eager(result, x.abs())
    assert (stats["compiles"], stats["cache_loads"]) == (0, 1), stats


def test_prewarm_names_a_malformed_manifest_line(tmp_path, capsys):
    manifest = tmp_path / "bad.jsonl"
    manifest.write_text('{"op": "aten::abs"}\n')
    assert main(["--cache-dir", str(tmp_path / "cache"), "prewarm", str(manifest)]) == 1
    assert f"{manifest}:1: not a manifest entry" in capsys.readouterr().err


# -- dynamic-shape kernels --------------------------------------------------------------------

def rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``add``'s arguments with ``n`` rows: a shape family whose dim 0 moves."""
    return torch.randn(n, 16), torch.randn(16)


def dynamic_entries(root: Path) -> list[tuple[str, dict]]:
    """(key, dims and guards) of each dynamic kernel of add.Tensor in the CPU cache at ``root``."""
    cache = KernelCache(root, environment_name(torch.device("cpu"), compile_options("cpu")))
    found = [(key, cache.lookup(op, key).dynamic) for op, key in cache.entries("aten::add.Tensor")]
    return [(key, dynamic) for key, dynamic in found if dynamic]


@pytest.fixture(scope="module")
def dynamic_run(tmp_path_factory):
    """A recording run that compiled a static kernel (5 rows) and a dynamic
    one (9), which then served 17 rows; its manifest's dynamic entry prewarmed
    into an empty cache."""
    base = tmp_path_factory.mktemp("dynamic")
    manifest, compiled, prewarmed = base / "misses.jsonl", base / "compiled", base / "prewarmed"
    compiles, _ = run_shapes("aten::add.Tensor", compiled, torch.add, [5, 9, 17], rows, record=manifest)
    assert compiles == [1, 1, 0]
    # Without the static kernel: the dynamic entry needs no other entry's kernel.
    dynamic_only = base / "dynamic.jsonl"
    dynamic_only.write_text(manifest.read_text().splitlines(keepends=True)[1])
    report = aoti_eager.prewarm(dynamic_only, jobs=1, cache_dir=prewarmed)
    return SimpleNamespace(manifest=manifest, compiled=compiled, prewarmed=prewarmed, report=report)


def test_a_dynamic_compile_is_recorded_with_its_dims_and_the_sizes_seen(dynamic_run):
    static, dynamic = read_manifest(dynamic_run.manifest)  # 17 rows: the dynamic kernel's, not recorded
    assert static.dynamic is None
    assert static.key == CallSignature.of(A.add.Tensor, "cpu", [*rows(5), 1]).key
    ((key, _),) = dynamic_entries(dynamic_run.compiled)
    assert dynamic.key == key
    assert dynamic.signature == CallSignature.of(A.add.Tensor, "cpu", [*rows(9), 1]).to_json()
    assert dynamic.dynamic == {"dims": [[0], []], "seen": [[5, 9]], "general": False}


def test_prewarm_compiles_a_dynamic_entry_into_the_kernel_the_run_compiled(dynamic_run):
    assert [r.outcome.status for r in dynamic_run.report.results] == ["compiled"], dynamic_run.report
    assert dynamic_entries(dynamic_run.prewarmed) == dynamic_entries(dynamic_run.compiled)
    compiles, stats = run_shapes("aten::add.Tensor", dynamic_run.prewarmed, torch.add, [33, 3], rows)
    assert compiles == [0, 0] and (stats["cache_loads"], stats["hits"]) == (1, 1), stats


def test_a_worker_compiles_a_request_through_the_pipeline_without_enabling_its_op(dynamic_run, tmp_path):
    _, dynamic = read_manifest(dynamic_run.manifest)
    outcome = _worker.warm(dynamic, tmp_path / "cache")
    assert (outcome.status, op_rows()) == ("compiled", {}), outcome
    assert dynamic_entries(tmp_path / "cache") == dynamic_entries(dynamic_run.compiled)
    assert _worker.warm(dynamic, tmp_path / "cache").status == "cached"


def test_a_dynamic_entry_survives_export_and_import(dynamic_run, tmp_path, capsys):
    imported = ship(dynamic_run.prewarmed, tmp_path, capsys)
    assert main(["--cache-dir", str(imported), "cache", "verify"]) == 0
    assert main(["--cache-dir", str(imported), "cache", "list"]) == 0
    assert "(self=float32[s0, 16], other=float32[16], alpha=1; s0 in [1, inf])" in capsys.readouterr().out
    compiles, stats = run_shapes("aten::add.Tensor", imported, torch.add, [21, 40], rows)
    assert compiles == [0, 0] and (stats["cache_loads"], stats["hits"]) == (1, 1), stats


def test_recording_without_compiling_records_the_dynamic_kernels_a_run_would_compile(tmp_path):
    manifest = tmp_path / "misses.jsonl"
    shapes = [(5, 16), (9, 16), (17, 16), (13, 24), (3, 24)]
    compiles, _ = run_shapes("aten::add.Tensor", tmp_path / "cache", torch.add, shapes,
                             lambda s: (torch.randn(*s), torch.randn(s[1])), record=manifest, compile="never")
    assert compiles == [0] * len(shapes)
    # 5 rows: static; 9: dim 0 moved; 17 is that kernel's; 13x24: the widening, of which 3x24 is.
    assert [(e.signature[0]["sizes"], e.dynamic) for e in read_manifest(manifest)] == [
        ([5, 16], None),
        ([9, 16], {"dims": [[0], []], "seen": [[5, 9]], "general": False}),
        ([13, 24], {"dims": [[0, 1], [0]], "seen": [[5, 17], [16, 24], [16, 24]], "general": False}),
    ]


def test_a_background_compile_of_a_second_shape_compiles_the_dynamic_kernel(tmp_path):
    aoti_eager.enable(["aten::add.Tensor"], devices=["cpu"], cache_dir=tmp_path, compile="background")
    calls = {n: rows(n) for n in (5, 9, 17, 33)}
    results = {n: torch.add(*calls[n]) for n in (5, 9, 17)}  # 17 waits for 9's compile: nothing more queued
    assert aoti_eager.stats()["aten::add.Tensor"]["queued"] == 2
    served = lambda: aoti_eager.stats()["aten::add.Tensor"]["hits"] > 0  # noqa: E731
    _calls_until(served, lambda: torch.add(*calls[9]))
    results[33] = torch.add(*calls[33])
    stats = aoti_eager.stats()["aten::add.Tensor"]
    assert (stats["queued"], stats["compiles"], stats["hits"]) == (2, 0, 2), stats
    assert [dynamic["dims"] for _, dynamic in dynamic_entries(tmp_path)] == [[[0], []]]
    # 17 waited for 9's compile and never asks again (C++ finds the dynamic
    # kernel): once 5 has asked, nothing is left compiling.
    _calls_until(lambda: aoti_eager.stats()["aten::add.Tensor"]["compiling"] == 0, lambda: torch.add(*calls[5]))
    aoti_eager.disable()
    for n, result in results.items():
        assert_same_as_eager(result, torch.add(*calls[n]), atol=0, rtol=0)


# Writes each entry it gets to the file named by its first argument; fails them all.
_FAILING_WORKER = r"""
import json, sys
for line in sys.stdin:
    with open(sys.argv[1], "a") as received:
        received.write(line)
    print(json.dumps({"status": "failed", "reason": "no kernel"}), flush=True)
"""


def test_after_a_failed_background_dynamic_compile_the_familys_shapes_compile_alone(tmp_path, monkeypatch):
    received = tmp_path / "received.jsonl"
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", _FAILING_WORKER, str(received)])
    aoti_eager.enable(["aten::add.Tensor"], devices=["cpu"], cache_dir=tmp_path / "cache", compile="background")
    calls = {n: rows(n) for n in (5, 9, 17)}
    entries = lambda: read_manifest(received) if received.exists() else []  # noqa: E731
    results = {}
    for n, queued in [(5, 1), (9, 3), (17, 4)]:  # 9's dynamic compile fails: 9, then 17, compile alone
        results[n] = _calls_until(lambda: len(entries()) == queued, lambda: torch.add(*calls[n]), timeout=60)  # noqa: B023
    assert [(e.signature[0]["sizes"][0], e.dynamic is not None) for e in entries()] == [
        (5, False), (9, True), (9, False), (17, False)
    ]
    aoti_eager.disable()
    for n, result in results.items():
        assert_same_as_eager(result, torch.add(*calls[n]), atol=0, rtol=0)


def test_wait_returns_once_the_queued_compiles_ended(tmp_path, swap_toolchain):
    swap_toolchain(vec_isas_known=lambda: True)  # the miss queues its compile at once
    x = torch.randn(6, 5)
    aoti_eager.enable(["aten::abs"], devices=["cpu"], cache_dir=tmp_path, compile="background")
    assert_same_as_eager(torch.abs(x), x.abs())
    assert aoti_eager.stats()["aten::abs"]["queued"] == 1
    assert aoti_eager.wait(timeout=600)
    assert aoti_eager.stats()["aten::abs"]["compiling"] == 0
    hits = lambda: aoti_eager.stats()["aten::abs"]["hits"] > 0  # noqa: E731
    assert_same_as_eager(_calls_until(hits, lambda: torch.abs(x)), x.abs())
