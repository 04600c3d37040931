"""Prewarming: compile every entry of a manifest that the cache lacks, in
parallel worker processes, before any process needs it.

Each job is a worker process (:mod:`aoti_eager._worker`) that compiles entries
one after another and publishes each like a miss would, so an interrupted
prewarm leaves only complete entries behind and running it again compiles what
is left. A region's entry is compiled in this process, for the fused instance
of the model given whose region and state structure it names: a worker could
not rebuild the user's module.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TextIO

import torch

from aoti_eager import _mechanism, _regions, _worker
from aoti_eager.cache import UntrustedEntry, default_root
from aoti_eager.kernels import CompileRequest
from aoti_eager.kernels.region import RegionRequest
from aoti_eager.kernels.signature import short_form
from aoti_eager.manifest import read_entries, regions_note

log = logging.getLogger("aoti_eager")

# The cache a prewarm fills when none is given: the package's cache_dir(),
# which the package (a layer above) hands down.
default_cache_dir: Callable[[], Path] = default_root


@dataclass
class Result:
    entry: CompileRequest | RegionRequest
    outcome: _worker.Outcome


@dataclass
class SkippedRegion:
    """A region entry not compiled, and why (no model given, no fused instance matches it, ...)."""

    entry: RegionRequest
    reason: str


@dataclass
class PrewarmReport:
    """What a prewarm did: one result per manifest entry for the devices asked for."""

    results: list[Result] = field(default_factory=list)
    # Entries for devices that were not asked for or are not here.
    skipped: list[CompileRequest] = field(default_factory=list)
    skipped_regions: list[SkippedRegion] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(r.outcome.status == status for r in self.results)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.outcome.status == "failed"]


def _available_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _in_cache(entry: CompileRequest, root: Path) -> _worker.Outcome | None:
    """The outcome for an entry the cache already holds, else None. With
    ``$AOTI_EAGER_REMOTE`` set, an entry the fleet cache holds is fetched
    (verified) into the local cache here: no worker starts for it."""
    cache = _mechanism.open_cache(root, torch.device(entry.device), None, wait=0.0)
    try:
        published = cache.lookup(entry.op, entry.key)
    except UntrustedEntry as e:
        return _worker.Outcome("failed", f"refused an untrusted cache entry: {e}")
    if published is None:
        return None
    return _worker.Outcome("cached" if published.library else "eager", published.reason)


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}:{seconds:02d}"


class _Progress:
    """``done/total, failed, elapsed, ETA``: one line rewritten in place on a
    terminal, a line per finished entry otherwise."""

    def __init__(self, total: int, output: TextIO | None):
        self.total, self.output = total, output
        self.done = self.failed = 0
        self.start = time.monotonic()
        self.tty = output is not None and output.isatty()

    def finished(self, result: Result) -> None:
        self.done += 1
        self.failed += result.outcome.status == "failed"
        if self.output is None:
            return
        elapsed = time.monotonic() - self.start
        eta = elapsed / self.done * (self.total - self.done)
        status = f"{self.done}/{self.total} done, {self.failed} failed, elapsed {_clock(elapsed)}, ETA {_clock(eta)}"
        if self.tty:
            self.output.write(f"\r{status}" + ("\n" if self.done == self.total else ""))
        else:
            entry = result.entry
            self.output.write(f"[{status}] {result.outcome.status} {entry.op} on {entry.device} ({_described(entry)})\n")
        self.output.flush()


def prewarm(
    manifest: str | os.PathLike,
    *,
    jobs: int | None = None,
    devices: Iterable[str] | None = None,
    cache_dir: str | os.PathLike | None = None,
    output: TextIO | None = None,
    model: torch.nn.Module | None = None,
) -> PrewarmReport:
    """Compiles every entry of ``manifest`` that the cache lacks.

    Each entry's call is rebuilt from its recorded signature and compiled,
    checked against eager and published as a miss of that call would be, in
    worker processes that compile entry after entry. What the cache (or the
    fleet cache) already holds is not compiled again.

    Args:
        manifest (str | PathLike): a manifest recorded with
            ``enable(record=...)`` or ``$AOTI_EAGER_RECORD``.
        jobs (int | None): worker processes compiling at once, each one entry
            at a time. Entries of one op compile side by side; only a
            signature's own compiles wait for each other (on its lock).
            Default: one per core, as memory allows
            (:func:`aoti_eager._worker.default_jobs`).
        devices (Iterable[str] | None): only entries for these device types.
            Default: cpu, and cuda when available.
        cache_dir (str | PathLike | None): the cache to fill. Default:
            :func:`aoti_eager.cache_dir`.
        output (TextIO | None): where progress goes (e.g. ``sys.stdout``).
            Default: none.
        model (torch.nn.Module | None): a model fused with
            :func:`aoti_eager.fuse`, for the manifest's region entries: each
            is compiled here, in order, for the fused instance whose region
            and state structure it names, as a miss of its call with
            ``compile="now"`` would be (so a region's shapes give the static,
            then the dynamic kernel a run gives). Entries no instance matches
            are in ``.skipped_regions`` with the reason. Default: none (region
            entries are skipped, with one note).

    Returns:
        A :class:`PrewarmReport`: each entry's outcome; entries that failed
        are in ``.failed`` with the reason, and are compiled again by the next
        prewarm.

    Examples::

        >>> aoti_eager.enable(["aten::gelu"], record="misses.jsonl")
        >>> ...                                        # a run that misses
        >>> report = aoti_eager.prewarm("misses.jsonl", jobs=4)
        >>> report.count("compiled"), report.failed
        (12, [])
        >>> model = aoti_eager.fuse(model, record="regions.jsonl")   # a run of a fused model
        >>> ...                                                       # then, in a new process:
        >>> aoti_eager.prewarm("regions.jsonl", model=aoti_eager.fuse(model)).count("compiled")
        2
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    wanted = set(devices) if devices is not None else set(_available_devices())
    start = time.monotonic()
    report = PrewarmReport()
    pending = []
    entries = read_entries(manifest)
    for entry in entries.ops:
        if entry.device not in wanted or entry.device not in _available_devices():
            report.skipped.append(entry)
            continue
        known = _in_cache(entry, root)
        if known is None:
            pending.append(entry)
        else:
            report.results.append(Result(entry, known))
    progress = _Progress(len(pending), output)
    interrupted = threading.Event()

    workers: list[_worker.Worker] = []
    per_thread = threading.local()
    jobs = jobs or _worker.default_jobs()

    def compile_entry(entry: CompileRequest) -> _worker.Outcome:
        if interrupted.is_set():
            return _worker.Outcome("failed", "interrupted")
        if not hasattr(per_thread, "worker"):
            per_thread.worker = _worker.Worker(root, jobs=jobs)
            workers.append(per_thread.worker)
        return per_thread.worker.compile(entry)

    if pending:
        try:
            with ThreadPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(compile_entry, entry): entry for entry in pending}
                try:
                    for future in as_completed(futures):
                        result = Result(futures[future], future.result())
                        report.results.append(result)
                        progress.finished(result)
                except BaseException:
                    # Ctrl-C: stop the workers; each published entry is complete, and
                    # what a killed compile left is removed by the op's next compile.
                    interrupted.set()
                    pool.shutdown(wait=False, cancel_futures=True)
                    _worker.stop_all()
                    raise
        finally:
            # After the pool's threads have ended: a worker is driven by one thread.
            for worker in workers:
                worker.close()
    _prewarm_regions(entries.regions, model, wanted, report, output)
    report.seconds = time.monotonic() - start
    return report


def _prewarm_regions(entries: list[RegionRequest], model: torch.nn.Module | None, wanted: set[str],
                     report: PrewarmReport, output: TextIO | None) -> None:
    """Compiles the region ``entries`` for ``model``'s fused instances, one after another, in this process."""
    if entries and model is None:
        note = regions_note(len(entries))
        report.skipped_regions += [SkippedRegion(entry, "no model given") for entry in entries]
        if output is not None:
            output.write(note + "\n")
        else:
            log.warning("aoti_eager: %s", note)
        return
    instances = _regions.fused_instances(model) if entries else {}
    for entry in entries:
        matching = instances.get((entry.region, entry.structure))
        device = torch.device(entry.device).type
        if device not in wanted or device not in _available_devices():
            report.skipped_regions.append(SkippedRegion(entry, f"device {entry.device} not asked for or not here"))
        elif not matching:
            report.skipped_regions.append(SkippedRegion(entry, _unmatched(entry, instances)))
        else:
            status, reason, seconds = _regions.prewarm(matching, entry)
            report.results.append(Result(entry, _worker.Outcome(status, reason, seconds)))


def _unmatched(entry: RegionRequest, instances: dict[tuple[str, str], Any]) -> str:
    if any(name == entry.region for name, _ in instances):
        return (f"the model's fused {entry.region} instances have another state structure (parameters' shapes, "
                "dtypes or devices, the code or training flags changed)")
    return f"the model has no fused instance of {entry.region}" + ("" if instances else " (fuse it before prewarm)")


def _described(entry: CompileRequest) -> str:
    return short_form(entry.signature) + ("; dynamic-shape kernel" if entry.dynamic else "")


def summary(report: PrewarmReport) -> str:
    """A table per op and device, then the reason of every failed or eager entry."""
    statuses = ["compiled", "cached", "eager", "failed"]
    rows: dict[tuple[str, str], Counter] = {}
    seconds: Counter = Counter()
    for r in report.results:
        rows.setdefault((r.entry.op, r.entry.device), Counter())[r.outcome.status] += 1
        seconds[(r.entry.op, r.entry.device)] += r.outcome.seconds
    width = max([len(op) for op, _ in rows] + [len("op"), len("total")])
    lines = [f"{'op':<{width}}  device  " + "  ".join(f"{s:>8}" for s in statuses) + "  compile s"]
    for (op, device), counts in sorted(rows.items()):
        lines.append(f"{op:<{width}}  {device:<6}  " + "  ".join(f"{counts[s]:>8}" for s in statuses)
                     + f"  {seconds[(op, device)]:>9.1f}")
    lines.append(f"{'total':<{width}}  {'':<6}  " + "  ".join(f"{report.count(s):>8}" for s in statuses)
                 + f"  {sum(seconds.values()):>9.1f}")
    lines.append(f"{len(report.results)} entries in {report.seconds:.1f} s"
                 + (f"; {len(report.skipped)} skipped (devices not asked for or not here)" if report.skipped else "")
                 + (f"; {len(report.skipped_regions)} region entries skipped" if report.skipped_regions else ""))
    lines += [f"SKIPPED {s.entry.region} on {s.entry.device} ({_described(s.entry)}): {s.reason}"
              for s in report.skipped_regions if s.reason != "no model given"]
    for r in report.results:
        if r.outcome.status in ("failed", "eager"):
            lines.append(f"{r.outcome.status.upper()} {r.entry.op} on {r.entry.device} "
                         f"({_described(r.entry)}): {r.outcome.reason}")
    return "\n".join(lines)
