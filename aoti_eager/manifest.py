"""Manifests: the kernels that a run's misses asked for, to compile ahead of time.

A manifest is a JSON Lines file, one :class:`CompileRequest` a line
(kernels/request.py gives the format), or one :class:`RegionRequest` for a
fused region's miss (a line with ``"region"``; kernels/region.py). Several
processes may record into one manifest: each line is appended by one
``write`` under a file lock, and a request already in the file is not written
again. Further shapes that a recorded dynamic-shape kernel would serve are
not recorded; a later widening (another dim moves) is a request of its own.

A region's call can be rebuilt only beside its model, so the readers of ops
(:func:`read_manifest`, ``aoti-eager prewarm``) pass its lines over with one
note; ``aoti_eager.prewarm(manifest, model=...)`` compiles them.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

from filelock import FileLock

from aoti_eager.kernels.region import RegionRequest
from aoti_eager.kernels.request import CompileRequest

log = logging.getLogger("aoti_eager")

Request = Union[CompileRequest, RegionRequest]


@dataclass
class Manifest:
    """A manifest's entries, each once, in the order recorded."""

    ops: list[CompileRequest] = field(default_factory=list)
    regions: list[RegionRequest] = field(default_factory=list)


def regions_note(count: int) -> str:
    """What a reader of ops says of the region lines it passes over."""
    if count == 1:
        return "1 region entry needs its model: prewarm it with aoti_eager.prewarm(manifest, model=...)"
    return f"{count} region entries need their model: prewarm them with aoti_eager.prewarm(manifest, model=...)"


def read_entries(path: str | os.PathLike) -> Manifest:
    """The op and region entries of a manifest, each once, in the order recorded.

    Raises ValueError, naming the line, for a line that is not an entry.
    """
    entries: dict[tuple[str, str, str], Request] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
                entry: Request = (RegionRequest if "region" in data else CompileRequest).from_json(data)
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise ValueError(f"{path}:{number}: not a manifest entry ({e})") from None
            entries.setdefault(entry.id, entry)
    manifest = Manifest()
    for entry in entries.values():
        (manifest.regions if isinstance(entry, RegionRequest) else manifest.ops).append(entry)
    return manifest


def read_manifest(path: str | os.PathLike) -> list[CompileRequest]:
    """The op entries of a manifest, each signature once, in the order
    recorded; its region entries are passed over with one log line.

    Raises ValueError, naming the line, for a line that is not an entry.
    """
    manifest = read_entries(path)
    if manifest.regions:
        log.warning("aoti_eager: %s: %s", path, regions_note(len(manifest.regions)))
    return manifest.ops


class Recorder:
    """Appends the requests a process misses to a manifest, each once."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self._lock = FileLock(str(self.path) + ".lock")
        self._seen: set[tuple[str, str, str]] = set()

    def record(self, entry: Request) -> None:
        if entry.id in self._seen:
            return
        self._seen.add(entry.id)
        try:
            with self._lock:
                if self.path.exists():
                    manifest = read_entries(self.path)
                    recorded = {e.id for e in (*manifest.ops, *manifest.regions)}
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
