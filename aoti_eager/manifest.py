"""Manifests: the kernels that a run's misses asked for, to compile ahead of time.

A manifest is a JSON Lines file, one :class:`CompileRequest` a line
(kernels/request.py gives the format). Several processes may record into
one manifest: each line is appended by one ``write`` under a file lock, and
a request already in the file is not written again. Further shapes that a
recorded dynamic-shape kernel would serve are not recorded; a later widening
(another dim moves) is a request of its own.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from filelock import FileLock

from aoti_eager.kernels.request import CompileRequest

log = logging.getLogger("aoti_eager")


def read_manifest(path: str | os.PathLike) -> list[CompileRequest]:
    """The entries of a manifest, each signature once, in the order recorded.

    Raises ValueError, naming the line, for a line that is not an entry.
    """
    entries: dict[tuple[str, str, str], CompileRequest] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = CompileRequest.from_json(json.loads(line))
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise ValueError(f"{path}:{number}: not a manifest entry ({e})") from None
            entries.setdefault(entry.id, entry)
    return list(entries.values())


class Recorder:
    """Appends the signatures a process misses to a manifest, each once."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self._lock = FileLock(str(self.path) + ".lock")
        self._seen: set[tuple[str, str, str]] = set()

    def record(self, entry: CompileRequest) -> None:
        if entry.id in self._seen:
            return
        self._seen.add(entry.id)
        try:
            with self._lock:
                if self.path.exists():
                    recorded = {e.id for e in read_manifest(self.path)}
                    self._seen |= recorded
                    if entry.id in recorded:
                        return  # another process recorded it
                line = (json.dumps(entry.to_json(), sort_keys=True) + "\n").encode()
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)  # one write: a line is never interleaved with another
                finally:
                    os.close(fd)
        except (OSError, ValueError) as e:
            log.warning("aoti_eager: cannot record %s into %s: %s", entry.op, self.path, e)
