"""Whether AOTInductor's runtime loads kernels without crashing here.

A library can crash the process (a segmentation fault) when AOTInductor
creates its model container, e.g. one built by a compiler that links its own
libstdc++ (see :mod:`aoti_eager.kernels.toolchain`, which avoids the known
case). A crash cannot be caught, so until one kernel of a cache environment
has loaded, each is loaded first in a child process.

What the child's end says:

- it loaded: the runtime is sound here; the environment's kernels load in
  process from then on (the verdict is kept beside its entries);
- it failed to load (an error, not a signal): that library's problem, its
  signature's to deal with (:class:`LibraryDoesNotLoad`);
- a signal: a crash. On a known-good library (a verified cache entry, which
  loaded and matched eager where it was compiled) the runtime is at fault, and
  every kernel of the environment stays eager (:class:`UnsafeToLoad`, the
  verdict kept until ``aoti-eager cache clear``); on a library just compiled,
  that library is (:class:`LibraryDoesNotLoad`).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from aoti_eager.cache.layout import LAYOUT_VERSION, atomic_write_text

log = logging.getLogger("aoti_eager")

_CHILD = (
    "import json, sys, aoti_eager._extension as e; "
    "e.load().CompiledKernel(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))"
)
VERDICT_FILE = "load-probe.json"


class UnsafeToLoad(RuntimeError):
    """The runtime crashes loading a known-good kernel: the environment's kernels stay eager."""


class LibraryDoesNotLoad(RuntimeError):
    """One library does not load (or crashed a child process before it was ever used)."""


# Environment directory -> None where kernels load, else the reason they do not.
_verdicts: dict[Path, str | None] = {}


def check_loads(environment_dir: Path, library: Path, device: str, output_counts: list[int], known_good: bool) -> None:
    """Returns if ``library`` may be loaded in this process.

    Raises UnsafeToLoad where the runtime crashes on this environment's
    kernels, LibraryDoesNotLoad where only ``library`` is at fault.
    ``known_good``: the library is a verified cache entry's.
    """
    crash = runtime_crashes(environment_dir)
    if crash is not None:
        raise UnsafeToLoad(crash)
    if environment_dir not in _verdicts:
        _probe(environment_dir, library, device, output_counts, known_good)


def runtime_crashes(environment_dir: Path) -> str | None:
    """Why kernels of ``environment_dir`` are not loaded, if a probe found they crash the runtime."""
    if environment_dir not in _verdicts:
        recorded = _recorded(environment_dir)
        if recorded is not None:
            _verdicts[environment_dir] = recorded["reason"]
    return _verdicts.get(environment_dir)


def _recorded(environment_dir: Path) -> dict | None:
    """The verdict kept beside the environment's entries; None if there is none."""
    try:
        record = json.loads((environment_dir / VERDICT_FILE).read_text())
        # Records without "loads" took any failure for a crash: judged again.
        if isinstance(record["loads"], bool) and (record["loads"] or isinstance(record["reason"], str)):
            return record
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _probe(environment_dir: Path, library: Path, device: str, output_counts: list[int], known_good: bool) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(library), device, json.dumps(output_counts)], capture_output=True, text=True
    )
    last = (child.stderr.strip().splitlines() or [""])[-1][:200]
    detail = f": {last}" if last else ""
    if child.returncode == 0:
        _remember(environment_dir, library, None)
        return
    if child.returncode > 0:
        raise LibraryDoesNotLoad(f"a test process could not load it (exit code {child.returncode}){detail}")
    which = "a known-good" if known_good else "a new"
    crash = f"AOTInductor's runtime crashed a test process loading {which} {device} kernel (signal {-child.returncode}){detail}"
    if not known_good:
        raise LibraryDoesNotLoad(crash)
    reason = f"{crash}; `aoti-eager cache clear` forgets this verdict"
    _remember(environment_dir, library, reason)
    raise UnsafeToLoad(reason)


def _remember(environment_dir: Path, library: Path, reason: str | None) -> None:
    _verdicts[environment_dir] = reason
    try:
        atomic_write_text(environment_dir / VERDICT_FILE, json.dumps({"loads": reason is None, "reason": reason, "library": str(library)}))
    except OSError as e:  # a read-only cache: this process keeps the verdict
        log.debug("aoti_eager: cannot keep the load probe's verdict in %s: %s", environment_dir, e)


def recorded_verdicts(root: Path) -> dict[str, str | None]:
    """Per environment of the cache ``root`` with a verdict: None where its kernels load, else why not."""
    verdicts = {}
    for record in sorted((root / LAYOUT_VERSION).glob(f"*/{VERDICT_FILE}")):
        recorded = _recorded(record.parent)
        if recorded is not None:
            verdicts[record.parent.name] = recorded["reason"]
    return verdicts


def forget_verdicts(root: Path) -> None:
    """Removes every verdict of the cache ``root``: the next kernel loaded is probed again."""
    for record in (root / LAYOUT_VERSION).glob(f"*/{VERDICT_FILE}"):
        record.unlink(missing_ok=True)
        _verdicts.pop(record.parent, None)
