"""Reading what the cache, a bundle or the fleet holds without trusting it:
regular files only, opened without following a link and without blocking (a
pipe or a device in a file's place could block forever or never end), sizes
capped, JSON nesting bounded.

Every JSON document the cache reads from elsewhere (``entry.json``, a
signature, a manifest) goes through :func:`load_json`: a document nested
deeper than any the package writes is refused as unreadable (``ValueError``),
never a ``RecursionError`` on every call.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Iterator

# The largest JSON document read: entry.json, kernel.json, a signature, the
# manifest of a bundle's every member.
MAX_JSON_BYTES = 16 << 20
# Deeper than anything the package writes (an entry's dynamic-shape guards are the deepest).
MAX_JSON_DEPTH = 64
_CHUNK = 1 << 20


@contextlib.contextmanager
def open_regular_file(path: Path, follow_link: bool = False) -> Iterator[BinaryIO]:
    """``path`` opened for reading; OSError unless it is a regular file (not
    a directory, a device or a pipe, which could block or never end; nor a
    symbolic link unless ``follow_link``)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow_link else os.O_NOFOLLOW))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file (a directory, device or pipe)")
    with os.fdopen(fd, "rb") as f:
        yield f


def read_capped(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of the regular file ``path``; OSError for a larger one."""
    with open_regular_file(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(f"{path} holds more than {limit} bytes, more than any file of its kind")
    return data


def copy_hashed(source: BinaryIO, target: BinaryIO | None = None) -> dict:
    """Reads ``source`` to its end, writing what it reads into ``target`` if
    given; the sha256 and size of exactly those bytes."""
    sha256, size = hashlib.sha256(), 0
    while chunk := source.read(_CHUNK):
        sha256.update(chunk)
        size += len(chunk)
        if target is not None:
            target.write(chunk)
    return {"sha256": sha256.hexdigest(), "bytes": size}


def load_json(data: bytes | str) -> Any:
    """``json.loads(data)``; ValueError for a document nested deeper than
    :data:`MAX_JSON_DEPTH` (or than the parser's recursion allows)."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    pending = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        if children and depth >= MAX_JSON_DEPTH:
            raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
        pending += [(child, depth + 1) for child in children]
    return value
