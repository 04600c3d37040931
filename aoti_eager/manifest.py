"""Manifests: the (op, device, input signature) calls that missed the cache.

A manifest is a JSON Lines file, one call per line::

    {"op": "aten::abs", "device": "cpu", "key": "3f0c...", "signature": [{"name": "self", ...}]}

``signature`` is :meth:`CallSignature.to_json`, from which
:func:`aoti_eager.kernels.examples.example_arguments` rebuilds the call, and
``key`` the cache entry the call needs. Several processes may record into one
manifest: each line is appended by one ``write`` under a file lock, and an
entry already in the file is not written again.

A call that needs a dynamic-shape kernel (kernels/dynamic.py) is recorded
with the kernel's entry key and ``dynamic``: the dims that moved, for each
tensor argument, the smallest and largest size of each among the shapes
of its family that the recording process had seen (one ``[min, max]`` per
dim, in ``dims`` order), and whether it is a general kernel (every dim moves,
strides read at run time)::

    {"op": "aten::add.Tensor", "device": "cpu", "key": "9b1e...-04d2...", "signature": [...],
     "dynamic": {"dims": [[0], []], "seen": [[5, 9]], "general": false}}

Further shapes that kernel would serve are not recorded; a later widening
(another dim moves) is an entry of its own.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

log = logging.getLogger("aoti_eager")


@dataclass(frozen=True)
class ManifestEntry:
    op: str
    device: str  # the device type: "cpu" or "cuda"
    key: str
    signature: list[dict[str, Any]]
    # A dynamic-shape kernel's {"dims", "seen", "general"} (see above); None: the signature's own kernel.
    dynamic: dict[str, Any] | None = None

    @property
    def id(self) -> tuple[str, str, str]:
        return (self.op, self.device, self.key)

    def to_json(self) -> dict[str, Any]:
        """The entry as a manifest line holds it (no ``dynamic`` for a static kernel)."""
        data = asdict(self)
        if self.dynamic is None:
            del data["dynamic"]
        return data


def read_manifest(path: str | os.PathLike) -> list[ManifestEntry]:
    """The entries of a manifest, each signature once, in the order recorded.

    Raises ValueError, naming the line, for a line that is not an entry.
    """
    entries: dict[tuple[str, str, str], ManifestEntry] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = ManifestEntry(**json.loads(line))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not a manifest entry ({e})") from None
            entries.setdefault(entry.id, entry)
    return list(entries.values())


class Recorder:
    """Appends the signatures a process misses to a manifest, each once."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self._lock = FileLock(str(self.path) + ".lock")
        self._seen: set[tuple[str, str, str]] = set()

    def record(self, entry: ManifestEntry) -> None:
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
