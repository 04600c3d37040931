"""The whole cache at once: every entry of every environment with its size and
last use, for eviction, verification and the command line.

The cache is walked without following symbolic links: the project never makes
one, so a link where a directory of the cache belongs was planted or made by
mistake. It is reported, removed (the link, not its target) by what removes
things, and never counted, entered, moved or removed through.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Iterator

from filelock import Timeout

from aoti_eager.cache import layout
from aoti_eager.cache.files import load_json, read_capped
from aoti_eager.cache.store import (
    ENTRY_FILE,
    TEMPORARY_PREFIX,
    DamagedEntry,
    UnsignedEntry,
    UntrustedEntry,
    op_lock,
    op_of_dirname,
    read_entry,
    remove_entry,
    remove_tree,
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
            data = load_json(read_capped(self.directory / ENTRY_FILE))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def _names_op(op: str, name: str) -> bool:
    """``aten::add`` names each of its overloads; ``aten::add.Tensor`` one."""
    return name == op or name.startswith(op + ".")


@dataclasses.dataclass
class Walk:
    """What a walk of the cache found (see :func:`walk`)."""

    entries: list[Listing] = dataclasses.field(default_factory=list)
    # Symbolic links where the cache has directories and files of its own.
    links: list[Path] = dataclasses.field(default_factory=list)
    # Directories that a compile, publication or removal is assembling, or
    # that a process killed meanwhile left (see abandoned_temporaries).
    temporaries: list[Path] = dataclasses.field(default_factory=list)


def _children(directory: Path, links: list[Path]) -> list[os.DirEntry]:
    """What ``directory`` holds, less symbolic links, which go to ``links``."""
    try:
        with os.scandir(directory) as scanned:
            children = sorted(scanned, key=lambda child: child.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    links += [Path(child.path) for child in children if child.is_symlink()]
    return [child for child in children if not child.is_symlink()]


def walk(root: Path, op: str | None = None) -> Walk:
    """The entries under ``root`` (those of ``op`` if given), least recently
    used first, and the links and temporary directories found on the way."""
    found = Walk()
    top = root / layout.LAYOUT_VERSION
    if top.is_symlink():
        found.links.append(top)
        return found
    for environment in _children(top, found.links if op is None else []):
        if not environment.is_dir(follow_symlinks=False):
            continue
        op_links: list[Path] = []
        for op_dir in _children(Path(environment.path), op_links):
            if op_dir.name.startswith(".") or not op_dir.is_dir(follow_symlinks=False):
                continue  # .shared, probe verdicts
            if op is not None and not _names_op(op, op_of_dirname(op_dir.name)):
                continue
            for child in _children(Path(op_dir.path), found.links):
                if child.name.startswith(TEMPORARY_PREFIX):
                    found.temporaries.append(Path(child.path))
                elif not child.name.startswith(".") and child.is_dir(follow_symlinks=False):
                    try:
                        size = sum(f.stat(follow_symlinks=False).st_size for f in os.scandir(child.path))
                        last_use = child.stat(follow_symlinks=False).st_mtime
                    except OSError:
                        continue  # removed meanwhile
                    found.entries.append(Listing(Path(child.path), size, last_use))
        found.links += [link for link in op_links if op is None or _names_op(op, op_of_dirname(link.name))]
    found.entries.sort(key=lambda listing: listing.last_use)
    return found


def entries(root: Path, op: str | None = None) -> list[Listing]:
    """The entries under ``root`` (those of ``op`` if given), least recently used first."""
    return walk(root, op).entries


def quarantined(root: Path) -> list[Path]:
    """The entries in the quarantine (and links in their place, never followed)."""
    links: list[Path] = []
    directory = root / "quarantine"
    if directory.is_symlink():
        return [directory]
    return [Path(child.path) for child in _children(directory, links)] + links


def abandoned_temporaries(root: Path, op: str | None = None) -> Iterator[Path]:
    """Temporary directories that no living process is using: those of ops
    whose lock can be taken without waiting (a compile or publication holds
    it). Each is yielded with the lock held, so it may be removed."""
    by_op_dir: dict[Path, list[Path]] = {}
    for tmp in walk(root, op).temporaries:
        by_op_dir.setdefault(tmp.parent, []).append(tmp)
    for op_dir, temporaries in by_op_dir.items():
        lock = op_lock(op_dir, timeout=0)
        try:
            lock.acquire()
        except (Timeout, OSError):
            continue  # a live compile, or a lock this user may not take
        try:
            yield from temporaries
        finally:
            lock.release()


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path``, links not followed."""
    total = 0
    for directory, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                pass  # removed meanwhile
    return total


@dataclasses.dataclass
class Eviction:
    removed: list[Listing] = dataclasses.field(default_factory=list)
    # Entries that a process was loading: left in place.
    in_use: list[Listing] = dataclasses.field(default_factory=list)
    # Symbolic links found where entries belong: removed, their targets untouched.
    links_removed: list[Path] = dataclasses.field(default_factory=list)


def evict(root: Path, max_bytes: int | None = None, older_than: float | None = None, op: str | None = None) -> Eviction:
    """Removes entries, least recently used first, until those left hold at
    most ``max_bytes``, and every entry unused for ``older_than`` seconds;
    only entries of ``op`` if given. Entries being loaded stay. Symbolic links
    found on the way are removed."""
    found = walk(root, op)
    total = sum(listing.bytes for listing in found.entries)
    cutoff = time.time() - older_than if older_than is not None else None
    eviction = Eviction()
    for link in found.links:
        remove_tree(root, link)
        eviction.links_removed.append(link)
    for listing in found.entries:
        stale = cutoff is not None and listing.last_use < cutoff
        if not stale and (max_bytes is None or total <= max_bytes):
            break
        if remove_entry(root, listing.directory):
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
        remove_tree(root, path)
    return len(old)


def clear_quarantine(root: Path) -> int:
    """Removes every quarantined entry; returns how many there were."""
    gone = quarantined(root)
    for path in gone:
        remove_tree(root, path)
    return len(gone)


@dataclasses.dataclass
class Problem:
    path: Path
    op: str | None  # None: a link above the op level
    problem: str


def verify(root: Path, quarantine: bool = False) -> list[Problem]:
    """Re-hashes every entry; returns the bad ones, and symbolic links, with
    what is wrong. With ``quarantine``, bad entries are moved to the
    quarantine (not another member's that this user does not trust, see
    UnsignedEntry) and links removed (never their targets)."""
    found = walk(root)
    problems = []
    for listing in found.entries:
        try:
            read_entry(listing.directory, root)
        except (DamagedEntry, UntrustedEntry) as e:
            problems.append(Problem(listing.directory, listing.op, str(e)))
            if quarantine and not isinstance(e, UnsignedEntry):
                set_aside(root, listing.directory, str(e))
    for link in found.links:
        problems.append(Problem(link, _op_of_link(root, link), f"a symbolic link (to {os.readlink(link)}), not part of the cache"))
        if quarantine:
            remove_tree(root, link)
    return problems


def _op_of_link(root: Path, link: Path) -> str | None:
    parts = link.relative_to(root / layout.LAYOUT_VERSION).parts
    return op_of_dirname(parts[1]) if len(parts) >= 2 else None
