"""What this process knows of its fused regions, in one object: :data:`regions`.

Every fused instance shares it: each region's stats and modules alive, the
decision of each key, what each region family learnt, the values forwards
read, the background compiles running, the caches opened, and what was
logged once. The hit path (:mod:`aoti_eager._region_calls`) reads none of it
on a hit. Here too: a region's kernel as its decision holds it, and the
logging-once helpers.
"""

from __future__ import annotations

import collections
import logging
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from aoti_eager import _mechanism
from aoti_eager._decisions import Decision
from aoti_eager._options import Options
from aoti_eager._planner import Family
from aoti_eager._stats import Stats
from aoti_eager.cache.entry_store import EntryStore
from aoti_eager.kernels.region import Outputs

log = logging.getLogger("aoti_eager")

# The reason the calls of a key give while its kernel compiles in a thread of this process.
COMPILING = "its kernel is compiling in the background"


@dataclass(frozen=True)
class RegionKernel:
    """What a region's :class:`~aoti_eager._decisions.UseKernel` runs: the
    library, and how its result is built from the tensors it returns."""

    compiled: Any  # a CompiledKernel (csrc/compiled_kernel.h)
    # None: a kernel loaded from the cache learns it from eager's first result in this process (_region_calls._learnt).
    outputs: Outputs | None = None
    # A kernel loaded from the cache: its entry, which that first result checks.
    loaded: _Loaded | None = None


@dataclass(frozen=True)
class _Loaded:
    """The entry a kernel was loaded from, and the structure of the result that it keeps."""

    cache: EntryStore
    name: str
    key: str
    structure: dict[str, Any] | None


@dataclass
class RegionRegistry:
    """The fused regions of this process: what their calls did, decided and
    learnt, shared by every instance (an instance's own memo of its calls
    stays with its prepared state, ``_region_calls._Prepared``)."""

    stats: dict[str, Stats] = field(default_factory=dict)
    # Each region's fused modules alive: stats() has rows for those regions.
    live: dict[str, weakref.WeakSet] = field(default_factory=lambda: collections.defaultdict(weakref.WeakSet))
    # (cache directory of the environment, key, compile mode) -> what its calls run; decided under ``lock``.
    decided: dict[tuple[str, str, str], Decision] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    # (cache directory of the environment, family key) -> what this process knows of the region family.
    families: dict[tuple[str, str], Family] = field(default_factory=dict)
    # A state's structure (state_structure) -> the attributes its forwards were seen to read in this process:
    # its calls' keys hold their values. A superset of what one call reads keys it soundly, so it only grows.
    reads: dict[str, frozenset] = field(default_factory=dict)
    # (cache directory of the environment, region_shapes.values_key) -> kernels compiled here for those calls' numbers.
    value_variants: collections.Counter = field(default_factory=collections.Counter)
    # (cache directory of the environment, graph_digest of an exported program) -> the entry and file of its library.
    twins: dict[tuple[str, str], tuple[str, str, str]] = field(default_factory=dict)  # (name, key, library file)
    # (cache directory of the environment, key) -> the background compile its calls wait for, and its region.
    compiling: dict[tuple[str, str], tuple[Future, str]] = field(default_factory=dict)
    # (root, device, fleet cache's URL, how long its lock is waited for) -> the cache.
    caches: dict[tuple[Path, str, str | None, float], EntryStore] = field(default_factory=dict)
    # (region, what was said) and (region, why it ran eagerly) already logged: one line per process, not per call.
    logged: set[tuple[str, str]] = field(default_factory=set)
    logged_eager: set[tuple[str, str]] = field(default_factory=set)

    def stats_of(self, name: str) -> Stats:
        return self.stats.setdefault(name, Stats())

    def cache(self, options: Options, device: torch.device, wait: float = 0.0) -> EntryStore:
        """The cache of kernels for ``device`` that ``options`` name, with its
        fleet cache behind, whose lock a miss waits ``wait`` seconds for (a call's: none)."""
        where = (options.root, str(device), options.remote, wait)
        if where not in self.caches:
            self.caches[where] = _mechanism.open_cache(options.root, device, options.remote, wait=wait)
        return self.caches[where]

    def replace(self, old: Decision, new: Decision) -> None:
        """``new`` where ``old`` was kept (a kernel that learnt its result's
        structure, or failed to run): the calls that find it from now on."""
        with self.lock:
            for kept in (self.decided, *(family.decisions for family in self.families.values())):
                for where in [where for where, decided in kept.items() if decided is old]:
                    kept[where] = new

    def forget(self) -> None:
        """Drops what was decided of region calls and learnt of their families:
        calls decide again from the cache, as in a new process."""
        with self.lock:
            self.decided.clear()
            self.families.clear()
            self.twins.clear()


regions = RegionRegistry()


def _log_eager_once(name: str, reason: str) -> None:
    regions.logged_eager.add((name, reason))
    # Compiling in the background is what was asked for: no warning.
    _log_once(name, f" runs eagerly: {reason}", logging.INFO if reason == COMPILING else logging.WARNING)


def _log_once(name: str, said: str, level: int = logging.WARNING) -> None:
    if (name, said) not in regions.logged:
        regions.logged.add((name, said))
        log.log(level, "aoti_eager: %s%s", name, said)
