"""Entries of the kernel cache: lookup, per-op locks and atomic publication.

An entry is a directory named by its signature digest. It is assembled under a
temporary name inside the op's directory and published with one ``rename``, so
a reader sees either no entry or a complete one; ``entry.json`` carries the
artifact's sha256, checked before the library is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from aoti_eager.cache import layout

log = logging.getLogger("aoti_eager")

ENTRY_FILE = "entry.json"
LIBRARY_FILE = "kernel.so"


@dataclasses.dataclass
class Entry:
    """What the cache knows about one (op, device, signature).

    ``library`` is None for a signature decided "eager" (``reason`` says why).
    """

    op: str
    signature: list[dict[str, Any]]
    output_counts: list[int] | None = None
    library: Path | None = None
    reason: str | None = None
    compile_seconds: float = 0.0
    sha256: str | None = None
    created: float = dataclasses.field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["library"] = self.library.name if self.library else None
        return d


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class UntrustedEntry(Exception):
    """An entry that another user could have written: it is never loaded."""


def check_trusted(path: Path, root: Path) -> None:
    """Raises UntrustedEntry unless ``path`` and every directory between it and
    ``root`` belong to this user and are not writable by group or others."""
    current = path
    while True:
        st = current.stat()
        if st.st_uid != os.getuid():
            raise UntrustedEntry(f"{current} belongs to uid {st.st_uid}, not to this user")
        if st.st_mode & 0o022:
            raise UntrustedEntry(f"{current} is writable by group or others (mode {st.st_mode & 0o777:o})")
        if current == root or current.parent == current:
            return
        current = current.parent


def _op_dirname(op: str) -> str:
    return op.replace("::", ".")


class KernelCache:
    """The entries of one cache root for one device."""

    def __init__(self, root: Path, device: torch.device, compile_options: dict[str, Any] | None = None):
        self.root = Path(root)
        self.device = device
        self.compile_options = compile_options or {}
        environment = layout.environment_key(self.root, device, self.compile_options)
        self.directory = self.root / layout.LAYOUT_VERSION / environment

    def _op_dir(self, op: str) -> Path:
        return self.directory / _op_dirname(op)

    def entry_dir(self, op: str, signature_key: str) -> Path:
        return self._op_dir(op) / signature_key

    def lock(self, op: str, timeout: float = -1) -> FileLock:
        """The lock held while an entry of ``op`` is compiled.

        An flock: the kernel releases it when its holder dies, so a crashed
        compile never leaves a stale lock behind. ``timeout`` < 0 waits forever.
        """
        op_dir = self._op_dir(op)
        layout.make_private_dirs(op_dir)
        return FileLock(str(op_dir / ".lock"), timeout=timeout, mode=0o600)

    def remove_abandoned(self, op: str) -> None:
        """Removes entries half-assembled by processes that died while publishing.

        Call it holding :meth:`lock`: entries are only published under it, so
        any temporary entry then belongs to no living process.
        """
        for tmp in self._op_dir(op).glob(".tmp-*"):
            log.info("aoti_eager: removing %s, left by a process that died while publishing", tmp)
            shutil.rmtree(tmp, ignore_errors=True)

    def lookup(self, op: str, signature_key: str) -> Entry | None:
        """The published entry, or None; a damaged entry is moved aside.

        Raises UntrustedEntry for an entry that another user could have written.
        """
        directory = self.entry_dir(op, signature_key)
        if directory.exists():
            check_trusted(directory, self.root)
            for path in directory.iterdir():
                check_trusted(path, directory)
        try:
            data = json.loads((directory / ENTRY_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self._set_aside(directory, f"unreadable {ENTRY_FILE}: {e}")
            return None
        try:
            entry = Entry(**{**data, "library": None})
            if data["library"] is not None:
                entry.library = directory / data["library"]
                if sha256_of(entry.library) != entry.sha256:
                    self._set_aside(directory, "artifact does not match its recorded sha256")
                    return None
        except (OSError, TypeError, KeyError) as e:
            self._set_aside(directory, f"incomplete entry: {e}")
            return None
        return entry

    def publish(self, signature_key: str, entry: Entry, files: dict[str, Path] | None = None) -> Entry:
        """Publishes ``entry`` with ``files`` (name in the entry -> source path).

        Returns the entry as published; if another process published the same
        signature first, its entry wins and is returned.
        """
        op_dir = self._op_dir(entry.op)
        layout.make_private_dirs(op_dir)
        tmp = op_dir / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir(mode=0o700)
        try:
            for name, source in (files or {}).items():
                shutil.copyfile(source, tmp / name)
            if entry.library is not None:
                entry.sha256 = sha256_of(tmp / LIBRARY_FILE)
                entry.library = Path(LIBRARY_FILE)
            (tmp / ENTRY_FILE).write_text(json.dumps(entry.to_json(), indent=1))
            final = self.entry_dir(entry.op, signature_key)
            try:
                os.rename(tmp, final)
            except OSError:
                published = self.lookup(entry.op, signature_key)
                if published is not None:
                    return published
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if entry.library is not None:
            entry.library = final / LIBRARY_FILE
        return entry

    def _set_aside(self, directory: Path, reason: str) -> None:
        quarantine = self.directory.parent.parent / "quarantine" / f"{directory.name}-{uuid.uuid4().hex[:8]}"
        log.warning("aoti_eager: cache entry %s set aside: %s", directory, reason)
        try:
            layout.make_private_dirs(quarantine.parent)
            os.rename(directory, quarantine)
        except OSError:
            shutil.rmtree(directory, ignore_errors=True)
