"""The overrides of this process: installed at the dispatcher, removed, and
put back; the miss handler the C++ side calls, which hands each miss to its
:class:`~aoti_eager._runtime.Override`; and their stats, summed over devices.

An override that :func:`uninstall` removes keeps what it knows, and
:func:`install` puts it back as it was: enabling an op again costs no lookup,
load or compile.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch._ops import OpOverload

from aoti_eager import _extension
from aoti_eager._decisions import Decision, RetryLater
from aoti_eager._ops import DISPATCH_KEYS
from aoti_eager._options import Options
from aoti_eager._runtime import Override
from aoti_eager._stats import Stats

log = logging.getLogger("aoti_eager")


@dataclass
class _Registry:
    """The overrides of this process, by token (the C++ side's handle) and by
    (op, device); those that uninstall() took out of the dispatcher, with
    what they know: install() puts one back as it was (decisions, loaded
    kernels, verdicts), so that enabling again costs no lookup, load or compile."""

    tokens: Iterator[int] = field(default_factory=itertools.count)
    by_token: dict[int, Override] = field(default_factory=dict)
    installed: dict[tuple[OpOverload, str], Override] = field(default_factory=dict)
    removed: dict[tuple[OpOverload, str], Override] = field(default_factory=dict)
    handler_set: bool = False
    # Per thread: how deep it is in misses_held_back().
    holding_back: threading.local = field(default_factory=threading.local)


_registry = _Registry()
_registry_lock = threading.RLock()


@contextlib.contextmanager
def misses_held_back() -> Iterator[None]:
    """Misses of enabled ops on this thread run the original kernel, and are
    decided at their next call after the block: nothing is compiled or
    loaded. Hits run their kernels, and other threads are unaffected."""
    holding_back = _registry.holding_back
    holding_back.depth = getattr(holding_back, "depth", 0) + 1
    try:
        yield
    finally:
        holding_back.depth -= 1


def _on_miss(token: int, args: list[Any], decide: bool) -> Decision:
    """The miss handler of csrc/op_override.h. With ``decide`` false the call
    could not be keyed: it runs eagerly, and only why is recorded."""
    override = _registry.by_token.get(token)
    if override is None:
        return RetryLater("the override was removed")
    try:
        if not decide:
            decision = override.unkeyable(args)
        elif getattr(_registry.holding_back, "depth", 0):
            decision = RetryLater("misses are held back on this thread")
        else:
            decision = override.decide(args)
    except Exception:  # noqa: BLE001 - never let a miss take the user's call down
        log.exception("aoti_eager: internal error while handling a call of %s; running it eagerly", override.name)
        decision = RetryLater("internal error")
    if decision.kernel is None:
        # However it was decided (now, remembered, or read from the cache), the call runs eagerly: stats() says why.
        override.stats.fallback_reason = decision.reason
    return decision


def install(op: OpOverload, device: str, options: Options) -> Override | None:
    """Overrides ``op`` at ``device``'s dispatch key as ``options`` say; for an
    op already overridden, only the recorder, the compile mode and the fleet
    cache (where one is given) change."""
    key = (op, device)
    with _registry_lock:
        if key in _registry.installed:
            override = _registry.installed[key]
            override.enabled_again(options)
            return override
        if (restored := _restore(key, options)) is not None:
            return restored
        if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), DISPATCH_KEYS[device]):
            return None
        C = _extension.load()
        if not _registry.handler_set:
            C.set_miss_handler(_on_miss)
            _registry.handler_set = True
        override = Override(op, device, options, next(_registry.tokens))
        override.handle = C.Override(op._schema.name, op._schema.overload_name, DISPATCH_KEYS[device], override.token)
        _kernels_changed(op)
        _registry.by_token[override.token] = override
        _registry.installed[key] = override
        return override


def _restore(key: tuple[OpOverload, str], options: Options) -> Override | None:
    """The override that uninstall() removed for ``key``, installed again with
    its stats at zero (but the last reason a call ran eagerly), where it was
    enabled the same way (cache, compile mode, manifest: a run that records
    its misses, or compiles them, starts from the cache); else None."""
    override = _registry.removed.pop(key, None)
    if override is None or not override.options.same(options):
        return None
    # The C++ side keeps the decisions, and runs those for eager without asking: their reason stays.
    override.stats = Stats(fallback_reason=override.stats.fallback_reason)
    override.handle.restore()
    _kernels_changed(override.op)
    _registry.by_token[override.token] = override
    _registry.installed[key] = override
    return override


def uninstall(op: OpOverload | None = None, device: str | None = None) -> None:
    """Restores the original kernels of ``op`` (every op if None) on ``device``
    (every device if None). What the overrides know stays, for :func:`install`."""
    with _registry_lock:
        for key in [k for k in _registry.installed if op in (None, k[0]) and device in (None, k[1])]:
            override = _registry.installed.pop(key)
            override.handle.remove()
            _kernels_changed(override.op)
            _registry.by_token.pop(override.token, None)
            _registry.removed[key] = override


def _kernels_changed(op: OpOverload) -> None:
    """Forgets which kernel the Python dispatcher (export and Dynamo trace
    under it) found for each dispatch key of ``op``: it caches the key whose
    kernel serves a call. For an op with no kernel of its own at the
    overridden key (``clone``: CompositeExplicitAutograd's only), that is the
    key itself while the override is installed; after it is removed, that key
    has no kernel, and the next traced call (export's own ``torch.clone`` of
    the RNG state) jumps to a null one. PyTorch's ``py_impl`` clears it so."""
    op._dispatch_cache.clear()


def forget() -> None:
    """Drops what removed overrides knew: ops enabled again start as in a new
    process, from the cache."""
    with _registry_lock:
        _registry.removed.clear()


def installed() -> list[Override]:
    with _registry_lock:
        return list(_registry.installed.values())


def stats() -> dict[str, dict[str, Any]]:
    """:func:`aoti_eager.stats`'s rows of the enabled ops: each overload's, summed over devices."""
    result: dict[str, dict[str, Any]] = {}
    for override in installed():
        counters = override.handle.counters()
        row = result.setdefault(
            override.name,
            dict(calls=0, hits=0, misses=0, compiles=0, cache_loads=0, fallbacks=0, fallback_reason=None, compile_seconds=0.0, queued=0,
                 compiling=0),
        )
        row["calls"] += counters["calls"]
        row["hits"] += counters["hits"]
        row["misses"] += counters["misses"]
        row["fallbacks"] += counters["eager_calls"]
        row["compiles"] += override.stats.compiles
        row["cache_loads"] += override.stats.cache_loads
        row["queued"] += override.stats.queued
        row["compiling"] += override.compiles_running()
        row["compile_seconds"] = round(row["compile_seconds"] + override.stats.compile_seconds, 3)
        if counters["eager_calls"]:  # a reason kept from before the op was enabled again says nothing of these calls
            row["fallback_reason"] = override.stats.fallback_reason or row["fallback_reason"]
    return result
