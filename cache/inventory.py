"""The whole cache at once: every entry of every environment with its size and
last use, for eviction, verification and the command line."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

from aoti_eager.cache import layout
from aoti_eager.cache.store import (
    ENTRY_FILE,
    DamagedEntry,
    UntrustedEntry,
    op_of_dirname,
    read_entry,
    remove_entry,
    set_aside,
)


@dataclasses.dataclass
class Listing:
    """One published entry, as found on disk (nothing verified)."""

    directory: Path
    bytes: int
    last_use: float

    @property
    def environment(self) -> str:
        return self.directory.parent.parent.name

    @property
    def device(self) -> str:
        return self.environment.split("-", 1)[0]

    @property
    def op(self) -> str:
        return op_of_dirname(self.directory.parent.name)

    def metadata(self) -> dict[str, Any]:
        """``entry.json``, or {} where it cannot be read."""
        try:
            data = json.loads((self.directory / ENTRY_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def _names_op(op: str, name: str) -> bool:
    """``aten::add`` names each of its overloads; ``aten::add.Tensor`` one."""
    return name == op or name.startswith(op + ".")


def entries(root: Path, op: str | None = None) -> list[Listing]:
    """The entries under ``root`` (those of ``op`` if given), least recently used first."""
    listed = []
    for directory in (root / layout.LAYOUT_VERSION).glob("*/*/*"):
        if directory.name.startswith(".") or not directory.is_dir():
            continue  # locks, probe verdicts, temporary directories
        if op is not None and not _names_op(op, op_of_dirname(directory.parent.name)):
            continue
        try:
            size = sum(path.stat().st_size for path in directory.iterdir())
            last_use = directory.stat().st_mtime
        except OSError:
            continue  # removed meanwhile
        listed.append(Listing(directory, size, last_use))
    return sorted(listed, key=lambda listing: listing.last_use)


def quarantined(root: Path) -> list[Path]:
    directory = root / "quarantine"
    return sorted(directory.iterdir()) if directory.is_dir() else []


@dataclasses.dataclass
class Eviction:
    removed: list[Listing] = dataclasses.field(default_factory=list)
    # Entries that a process was loading: left in place.
    in_use: list[Listing] = dataclasses.field(default_factory=list)


def evict(root: Path, max_bytes: int | None = None, older_than: float | None = None, op: str | None = None) -> Eviction:
    """Removes entries, least recently used first, until those left hold at
    most ``max_bytes``, and every entry unused for ``older_than`` seconds;
    only entries of ``op`` if given. Entries being loaded stay."""
    listed = entries(root, op)
    total = sum(listing.bytes for listing in listed)
    cutoff = time.time() - older_than if older_than is not None else None
    eviction = Eviction()
    for listing in listed:
        stale = cutoff is not None and listing.last_use < cutoff
        if not stale and (max_bytes is None or total <= max_bytes):
            break
        if remove_entry(listing.directory):
            eviction.removed.append(listing)
            total -= listing.bytes
        else:
            eviction.in_use.append(listing)
    return eviction


def remove_old_layouts(root: Path) -> int:
    """Removes the directories of earlier layouts (``v1/`` beside ``v2/``),
    whose entries no process of this version looks up; returns how many."""
    old = [
        path for path in root.glob("v[0-9]*")
        if path.name[1:].isdigit() and path.name != layout.LAYOUT_VERSION and path.is_dir() and not path.is_symlink()
    ]
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return len(old)


def clear_quarantine(root: Path) -> int:
    """Removes every quarantined entry; returns how many there were."""
    gone = quarantined(root)
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return len(gone)


def verify(root: Path, quarantine: bool = False) -> list[tuple[Listing, str]]:
    """Re-hashes every entry; returns the bad ones with what is wrong, moved to
    the quarantine if ``quarantine``."""
    problems = []
    for listing in entries(root):
        try:
            read_entry(listing.directory, root)
        except (DamagedEntry, UntrustedEntry) as e:
            problems.append((listing, str(e)))
            if quarantine:
                set_aside(root, listing.directory, str(e))
    return problems
