"""Op coverage against PyTorch's OpInfo database.

For each OpInfo in ``op_db``, dtype and device (a *unit*), a worker process
runs the OpInfo's first sample inputs once under a dispatch mode to see which
aten overloads they reach, enables those that aoti_eager accepts, calls the op
twice (the first call compiles or loads, the second must hit the kernel) and
compares with eager. ``--layouts`` also runs each sample with its tensors
laid out otherwise (with gaps, or transposed), where a kernel must still give
eager's output strides. A unit ends as one of:

- ``compiled``: every enabled overload ran a compiled kernel, results equal eager's;
- ``eager``: some enabled overload ran its original kernel (the reasons are kept);
- ``wrong``: a result, or an argument written in place, differs from eager's;
- ``crash``: the worker process died; ``timeout``: it ran past ``--timeout``;
- ``ineligible``: the samples reach no overload aoti_eager accepts (not counted).

Units run in ``--jobs`` worker processes, each running unit after unit, so
that starting Python, torch, CUDA and Inductor is paid once per worker, not
per unit. A unit that crashes its worker or runs past ``--timeout`` is
reported as such, and the next unit gets a new worker, as it does after any
unit that did not end clean. Results are appended to a JSONL file, and a
rerun skips the units already in it. ``--report`` writes the Markdown summary.

    python scripts/op_coverage.py --jobs 16 --dtypes float32 --devices cpu \\
        --results out/coverage.jsonl --report out/coverage.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import faulthandler
import fnmatch
import itertools
import json
import multiprocessing
import os
import platform
import queue
import shlex
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

# "harness error": the harness itself failed on the unit (not aoti_eager); not eligible.
OUTCOMES = ("compiled", "eager", "wrong", "crash", "timeout", "harness error", "ineligible")
# Worse outcomes win when a unit's samples disagree.
_SEVERITY = {o: i for i, o in enumerate(("ineligible", "compiled", "eager", "wrong"))}


@dataclass(frozen=True)
class Unit:
    op: str  # the OpInfo's full name, e.g. "nn.functional.gelu" or "max.reduction_with_dim"
    dtype: str
    device: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.op, self.dtype, self.device)


def _op_db() -> dict[str, Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return {op.full_name: op for op in op_db}


# ---------------------------------------------------------------- the worker


def _tolerances(opinfo: Any, dtype: Any, device: str) -> dict[str, float]:
    """The loosest tolerance the OpInfo's decorators give ``dtype`` on
    ``device``, never below assert_close's default; none (assert_close's
    defaults for each result's own dtype: an int64 ``sin`` returns floats)
    where the decorators give none."""
    import torch
    from torch.testing._internal.common_device_type import toleranceOverride
    from torch.testing._internal.opinfo.core import DecorateInfo

    overrides = [
        decorator.d[dtype]
        for info in opinfo.decorators
        if isinstance(info, DecorateInfo) and info.device_type in (None, device)
        for decorator in info.decorators
        if isinstance(decorator, toleranceOverride) and dtype in decorator.d
    ]
    if not overrides:
        return {}
    default_rtol, default_atol = torch.testing._comparison.default_tolerances(torch.empty(0, dtype=dtype))
    return {"atol": max([default_atol] + [o.atol for o in overrides]), "rtol": max([default_rtol] + [o.rtol for o in overrides])}


def _reached_overloads(opinfo: Any, call: tuple) -> list[Any]:
    """The aten overloads that reach a backend kernel when ``call`` runs (in first-call order)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    reached: dict[Any, None] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            reached.setdefault(func)
            return func(*args, **(kwargs or {}))

    args, kwargs = call
    with Record():
        opinfo.op(*args, **kwargs)
    return [op for op in reached if isinstance(op, torch._ops.OpOverload) and op.namespace == "aten"]


def _seeded_call(opinfo: Any, call: tuple) -> Any:
    import torch

    torch.manual_seed(0)  # ops that reach a random op see the same numbers each time
    args, kwargs = call
    return opinfo.op(*args, **kwargs)


def check_sample(opinfo: Any, sample: Any, dtype: Any, device: str) -> dict[str, Any]:
    """One sample: its outcome, reason and the overloads it enabled."""
    import aoti_eager
    from aoti_eager._ops import qualified_name, refusal
    from helpers import assert_same_as_eager, clone_tree

    call = ((sample.input, *sample.args), dict(sample.kwargs))
    try:
        reached = _reached_overloads(opinfo, clone_tree(call))
        expected_call = clone_tree(call)
        expected = _seeded_call(opinfo, expected_call)
    except Exception as e:  # noqa: BLE001 - a sample eager rejects says nothing about us
        return {"outcome": "ineligible", "reason": f"eager raises {type(e).__name__}"}
    refused = {qualified_name(op): refusal(op) for op in reached}
    enabled = [op for op in reached if refused[qualified_name(op)] is None]
    if not enabled:
        return {"outcome": "ineligible", "reason": "reaches no eligible overload", "refused": refused}

    runs = [clone_tree(call) for _ in range(2)]
    results = []
    with aoti_eager.enabled(enabled, devices=[device]):
        for run in runs:
            try:
                results.append(_seeded_call(opinfo, run))
            except Exception as e:  # noqa: BLE001
                results.append(e)
        stats = aoti_eager.stats()
    names = [qualified_name(op) for op in enabled]
    row = {"aten": names, "refused": {k: v for k, v in refused.items() if v}}

    tolerances = _tolerances(opinfo, dtype, device)
    for i, (result, run) in enumerate(zip(results, runs)):
        if isinstance(result, Exception):
            return {**row, "outcome": "wrong", "reason": f"call {i + 1} raised {type(result).__name__}: {result}"[:500]}
        try:
            assert_same_as_eager(result, expected, **tolerances)
            assert_same_as_eager(run, expected_call, "arguments", **tolerances)
        except AssertionError as e:
            return {**row, "outcome": "wrong", "reason": f"call {i + 1}: {e}"[:500]}

    fallbacks = {name: s["fallback_reason"] for name, s in stats.items() if s["fallbacks"]}
    if fallbacks:
        reason = "; ".join(f"{name}: {why}" for name, why in fallbacks.items())
        return {**row, "outcome": "eager", "reason": reason[:1000]}
    if not any(s["hits"] or s["fallbacks"] for s in stats.values()):
        # A composite that decomposes under the recording mode but, called
        # plainly, runs its own kernel (max_pool1d on CPU): nothing to take over.
        return {**row, "outcome": "ineligible", "reason": "called plainly, it reaches no enabled overload"}
    return {**row, "outcome": "compiled", "reason": None}


def _transposed(t: Any) -> Any:
    """A tensor ``t`` with its last two dims swapped in memory: same shape and values."""
    import torch

    return t.mT.contiguous().mT if isinstance(t, torch.Tensor) and t.dim() >= 2 else t


# How each sample's tensors are laid out: as the OpInfo gives them, with gaps
# between elements, or with their last two dims transposed (a KV cache's layout).
LAYOUTS = {
    "given": lambda sample: sample,
    "noncontiguous": lambda sample: sample.noncontiguous(),
    "transposed": lambda sample: sample.transform(_transposed),
}


def run_unit(unit: Unit, samples: int, layouts: list[str] = ("given",)) -> dict[str, Any]:
    """Runs ``unit`` in this process, each sample in each of ``layouts``;
    returns its JSONL row (without the run's metadata)."""
    import torch

    opinfo = _op_db()[unit.op]
    dtype = getattr(torch, unit.dtype)
    torch.manual_seed(0)
    rows = [
        check_sample(opinfo, LAYOUTS[layout](s), dtype, unit.device)
        for s in itertools.islice(opinfo.sample_inputs(unit.device, dtype), samples)
        for layout in layouts
    ]
    checked = [r for r in rows if r["outcome"] != "ineligible"]
    if not checked:
        reasons = sorted({r["reason"] for r in rows}) or ["no sample inputs"]
        refused = {k: v for r in rows for k, v in r.get("refused", {}).items() if v}
        return {"outcome": "ineligible", "reason": "; ".join(reasons), "aten": [], "refused": refused, "samples": len(rows)}
    worst = max(checked, key=lambda r: _SEVERITY[r["outcome"]])
    reasons = list(dict.fromkeys(r["reason"] for r in checked if r["outcome"] == worst["outcome"]))
    return {
        "outcome": worst["outcome"],
        "reason": "; ".join(reasons) if worst["outcome"] != "compiled" else None,
        "aten": sorted({a for r in checked for a in r["aten"]}),
        "refused": {k: v for r in checked for k, v in r["refused"].items()},
        "samples": len(rows),
        "samples_compiled": sum(r["outcome"] == "compiled" for r in checked),
    }


def _serve(connection: Any, cache_dir: str | None, log_path: str) -> None:
    """A worker process: runs the units it receives one after another, in its
    own session (so that killing it kills its compilers too), its output in a
    log that holds the current unit's alone, whose tail explains a crash."""
    os.setsid()
    if cache_dir is not None:
        os.environ["AOTI_EAGER_CACHE_DIR"] = cache_dir
    # Coverage asks whether a kernel compiles and matches eager, not whether it
    # is faster: timing it beside other units' compiles would be noise anyway.
    os.environ["AOTI_EAGER_KEEP_FASTER"] = "0"
    # Appending, so that the writes after a truncation start again at 0.
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    faulthandler.enable(log)  # a crash leaves the Python stack in the log
    import torch._inductor.config

    import aoti_eager
    from aoti_eager import _overrides

    # The jobs are the parallelism: a pool of Triton compile processes in each
    # worker would keep jobs x cores processes up on a GPU host.
    torch._inductor.config.compile_threads = 1

    while True:
        try:
            unit, samples, layouts = connection.recv()
        except EOFError:  # the driver is gone
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.ftruncate(log, 0)
        try:
            row = run_unit(unit, samples, layouts)
        except Exception as e:  # noqa: BLE001 - a harness error is reported, not a crash
            traceback.print_exc()
            row = {"outcome": "harness error", "reason": f"{type(e).__name__}: {e}"[:500]}
        finally:
            # The next unit starts with no op overridden, and as a new process
            # would: no decision or shape count of an earlier unit's (four mm
            # shapes of other units must not cap this unit's mm).
            aoti_eager.disable()
            _overrides.forget()
        connection.send((row, _usable(unit.device)))


def _usable(device: str) -> bool:
    """Whether this process can run another unit on ``device``: a device-side
    assert or a bad address leaves every later CUDA call failing, and shows
    at the latest at the next synchronize."""
    if device != "cuda":
        return True
    import torch

    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return False
    return True


# ---------------------------------------------------------------- the driver


# The outcomes after which a worker runs the next unit: after any other, it
# may keep what went wrong (an override half set up, a compiler's state, a
# CUDA context that a device-side assert broke), and a new worker takes over.
_CLEAN = ("compiled", "eager", "ineligible")


def _context(units: list[Unit]) -> multiprocessing.context.BaseContext:
    """Workers fork from a server that has imported torch and op_db once
    (seconds per worker saved), not from this multithreaded process. Importing
    op_db initializes CUDA, which a forked process cannot use: CUDA units spawn."""
    if any(u.device == "cuda" for u in units):
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.testing._internal.common_methods_invocations", "aoti_eager", "helpers"])
    return context


def _tail(path: Path, lines: int = 8) -> str:
    """The log's last lines; after a fault, the innermost frames of its stack."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    fault = next((i for i, line in enumerate(text) if line.startswith("Fatal Python error")), None)
    if fault is not None:
        # faulthandler lists every thread; the one that faulted is marked "Current thread".
        current = next((i for i, line in enumerate(text) if line.startswith("Current thread")), fault + 1)
        text = [text[fault], *text[current : current + lines - 1]]
    return " | ".join(line.strip() for line in text[-lines:])[-1000:]


class Worker:
    """A process that runs units one after another, so that only its first
    unit pays for starting Python, torch, CUDA and Inductor (more, on a GPU,
    than most units' compiles). Started on the first unit, and again after a
    unit that crashed it, ran past the timeout or did not end clean, and after
    ``units_per_worker`` units (each kernel loaded stays in the process).
    One thread drives one worker."""

    def __init__(self, context: Any, cache_dir: str | None = None, units_per_worker: int = 50):
        self.context, self.cache_dir, self.units_per_worker = context, cache_dir, units_per_worker
        self.process = None

    def _start(self) -> None:
        self._directory = tempfile.TemporaryDirectory(prefix="op_coverage-")
        self._log = Path(self._directory.name) / "log.txt"
        self._connection, theirs = self.context.Pipe()
        self.process = self.context.Process(target=_serve, args=(theirs, self.cache_dir, str(self._log)))
        self.process.start()
        theirs.close()  # else the worker's death would not end the pipe here
        self._units = 0

    def run(self, unit: Unit, samples: int, layouts: list[str], timeout: float) -> dict[str, Any]:
        """``unit``'s JSONL row (without the run's metadata)."""
        start = time.monotonic()
        if self.process is not None and not self.process.is_alive():
            self.close()  # died between units (out of memory?): not this unit's doing
        if self.process is None:
            self._start()
        self._connection.send((unit, samples, layouts))
        self._units += 1
        if not self._connection.poll(timeout):
            row, usable = {"outcome": "timeout", "reason": f"ran past {timeout:.0f} s; log: {_tail(self._log)}"}, False
        else:
            try:
                row, usable = self._connection.recv()
            except (EOFError, OSError):  # the worker died
                self.process.join()
                code = self.process.exitcode
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                row, usable = {"outcome": "crash", "reason": f"worker died ({how}); log: {_tail(self._log)}"}, False
        if not (usable and row["outcome"] in _CLEAN and self._units < self.units_per_worker):
            self.close()
        return {"op": unit.op, "dtype": unit.dtype, "device": unit.device, **row, "seconds": round(time.monotonic() - start, 1)}

    def close(self) -> None:
        """Stops the worker and whatever it started."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.join()
        self._connection.close()
        self._directory.cleanup()
        self.process = None


def run_units(
    units: list[Unit], *, jobs: int, samples: int, timeout: float, cache_dir: str | None = None, on_result=None,
    layouts: list[str] = ("given",), units_per_worker: int = 50,
) -> list[dict[str, Any]]:
    """Runs ``units`` on ``jobs`` worker processes, sharing one kernel cache
    (default ``$AOTI_EAGER_CACHE_DIR``)."""
    context = _context(units)
    todo = queue.SimpleQueue()
    for unit in units:
        todo.put(unit)
    rows, lock = [], threading.Lock()

    def drive() -> None:
        worker = Worker(context, cache_dir, units_per_worker)
        try:
            while True:
                try:
                    unit = todo.get_nowait()
                except queue.Empty:
                    return
                row = worker.run(unit, samples, layouts, timeout)
                with lock:
                    rows.append(row)
                    if on_result is not None:
                        on_result(row)
        finally:
            worker.close()

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for future in [pool.submit(drive) for _ in range(min(jobs, len(units)))]:
            future.result()
    return rows


def select_units(ops: list[str] | None, dtypes: list[str], devices: list[str], limit: int | None) -> list[Unit]:
    """Units of the OpInfos matching ``ops`` (names or globs) whose dtypes include ``dtypes``."""
    import torch

    db = _op_db()
    names = [n for n in db if ops is None or any(fnmatch.fnmatchcase(n, p) for p in ops)]
    if ops is not None:
        unknown = [p for p in ops if not any(fnmatch.fnmatchcase(n, p) for n in db)]
        if unknown:
            raise SystemExit(f"no OpInfo named {', '.join(unknown)}")
    names = names[:limit] if limit is not None else names
    return [
        Unit(name, dtype, device)
        for name in names
        for device in devices
        for dtype in dtypes
        if getattr(torch, dtype) in db[name].supported_dtypes(device)
    ]


def read_results(path: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """The latest row per unit; a truncated last line (an interrupted write) is ignored."""
    rows = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            rows[(row["op"], row["dtype"], row["device"])] = row
    return rows


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {os.cpu_count()} CPUs"
    if torch.cuda.is_available():
        text += f", {torch.cuda.get_device_name()}"
    return text


# ---------------------------------------------------------------- the report


def write_report(rows: Iterable[dict[str, Any]], path: Path) -> None:
    rows = sorted(rows, key=lambda r: (r["device"], r["dtype"], r["op"]))
    configs = sorted({(r["device"], r["dtype"]) for r in rows})
    counts = Counter((r["device"], r["dtype"], r["outcome"]) for r in rows)
    lines = ["# Op coverage against PyTorch's OpInfo database", ""]
    lines += [
        "Generated by `scripts/op_coverage.py --report`. Each OpInfo of",
        "`torch.testing._internal.common_methods_invocations.op_db`, per dtype and device,",
        "runs its first sample inputs with every aten overload they reach that aoti_eager",
        "accepts enabled, twice (compile or load, then the cached kernel), against eager.",
        "`compiled`: every enabled overload ran a compiled kernel and the results equal eager's;",
        "`eager`: an enabled overload ran its original kernel (the reason follows);",
        "`wrong`: a result differs from eager's; `crash`: the worker process died;",
        "`ineligible`: the samples reach no overload that aoti_eager accepts (views,",
        "random or data-dependent ops, composites, a composite whose plain call runs its",
        "own kernel), not counted as eligible.",
        "",
    ]
    for key in ("command", "machine", "torch"):
        values = sorted({str(r.get(key)) for r in rows})
        lines.append(f"- {key}: " + "; ".join(f"`{v}`" for v in values))
    lines += ["", "| device | dtype | eligible | " + " | ".join(OUTCOMES) + " | compiled / eligible |", "|" + " --- |" * (len(OUTCOMES) + 4)]
    for device, dtype in configs:
        n = {o: counts[(device, dtype, o)] for o in OUTCOMES}
        eligible = sum(n.values()) - n["ineligible"] - n["harness error"]
        share = f"{100 * n['compiled'] / eligible:.1f}%" if eligible else "-"
        lines.append(f"| {device} | {dtype} | {eligible} | " + " | ".join(str(n[o]) for o in OUTCOMES) + f" | {share} |")
    reasons = Counter()
    for r in rows:
        if r["outcome"] == "eager":
            for part in (r["reason"] or "").split("; "):
                reasons[part.split(": ", 1)[-1][:120]] += 1
    if reasons:
        lines += ["", "## Why ops run eagerly (by count)", "", "| units | reason |", "| --- | --- |"]
        lines += [f"| {n} | {_cell(why)} |" for why, n in reasons.most_common()]
    lines += ["", "## Per op", "", "| op | device | dtype | outcome | samples | aten overloads enabled | reason |", "|" + " --- |" * 7]
    for r in rows:
        aten = ", ".join(a.removeprefix("aten::") for a in r.get("aten", []))
        cells = [r["op"], r["device"], r["dtype"], r["outcome"], str(r.get("samples", "")), aten, _cell(r.get("reason") or "")]
        lines.append("| " + " | ".join(cells) + " |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _cell(text: str) -> str:
    # Errors raised in the extension name its source files: relative to the project.
    text = text.replace(f"{Path(__file__).resolve().parent.parent}/", "")
    return text.replace("|", "\\|").replace("\n", " ")[:300]


# ---------------------------------------------------------------- the command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=Path("coverage.jsonl"), help="JSONL file appended to and resumed from")
    parser.add_argument("--report", type=Path, nargs="?", const=Path("docs/coverage.md"), help="write the Markdown report (default docs/coverage.md)")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="worker processes at a time")
    parser.add_argument("--samples", type=int, default=3, help="sample inputs per unit")
    parser.add_argument("--layouts", default="given", help=f"comma-separated, each sample in each: {', '.join(LAYOUTS)}")
    parser.add_argument("--ops", help="comma-separated OpInfo names or globs (e.g. 'add,nn.functional.*')")
    parser.add_argument("--dtypes", default="float32", help="comma-separated, e.g. float32,float64,int64,bool")
    parser.add_argument("--devices", default="cpu,cuda", help="comma-separated; cuda is skipped without a GPU")
    parser.add_argument("--limit", type=int, help="only the first N matching OpInfos")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per unit before its worker is killed")
    parser.add_argument("--units-per-worker", type=int, default=50, help="units a worker process runs before a new one starts (bounds its memory)")
    parser.add_argument("--cache-dir", help="the kernel cache all workers share (default $AOTI_EAGER_CACHE_DIR)")
    args = parser.parse_args(argv)

    import torch

    devices = [d for d in args.devices.split(",") if d != "cuda" or torch.cuda.is_available()]
    ops = args.ops.split(",") if args.ops else None
    units = select_units(ops, args.dtypes.split(","), devices, args.limit)
    done = read_results(args.results)
    todo = [u for u in units if u.key not in done]
    print(f"{len(units)} units, {len(units) - len(todo)} already in {args.results}, {len(todo)} to run with {args.jobs} jobs", flush=True)

    meta = {"torch": torch.__version__, "machine": machine(), "command": shlex.join(["python", "scripts/op_coverage.py", *sys.argv[1:]])}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    with args.results.open("a") as out:

        def record(row: dict[str, Any]) -> None:
            out.write(json.dumps({**row, **meta}) + "\n")
            out.flush()
            print(f"{row['outcome']:>10}  {row['op']} {row['dtype']} {row['device']}  {row['seconds']} s  {row.get('reason') or ''}"[:200], flush=True)

        run_units(todo, jobs=args.jobs, samples=args.samples, timeout=args.timeout, cache_dir=args.cache_dir, on_result=record,
                  layouts=args.layouts.split(","), units_per_worker=args.units_per_worker)

    if args.report:
        write_report(read_results(args.results).values(), args.report)
        print(f"report: {args.report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
