"""What the runtime asks of a kernel cache: the entry-store interface.

The runtime (aoti_eager._runtime, _worker, _prewarm) talks to a cache only
through :class:`EntryStore`. Its first implementation is the local
filesystem store, :class:`aoti_eager.cache.store.KernelCache`; every entry the
C++ hit path loads comes from there, verified.

A remote tier (the fleet cache, :mod:`aoti_eager.cache.remote`) is a
:class:`RemoteTier` set as the local store's ``behind``: on a local miss the
local store fetches the entry from it and publishes it locally before
answering, as Triton's ``RemoteCacheManager`` materializes remote hits into
its ``FileCacheManager``; a local publication is offered to it, and a compile
holds its lock too. The runtime does not change for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path
from typing import Any, ContextManager, Iterator, Protocol


@dataclasses.dataclass
class Entry:
    """What the cache knows about one (op, device, signature).

    ``library`` is None for a signature decided "eager" (``reason`` says why).
    ``timing`` is the kernel's time against eager's, measured once when it was
    compiled (``kernel_us``, ``eager_us``, ``ratio``); an eager entry with a
    timing is one where eager was measured faster.
    """

    op: str
    signature: list[dict[str, Any]]
    output_counts: list[int] | None = None
    library: Path | None = None
    reason: str | None = None
    compile_seconds: float = 0.0
    sha256: str | None = None
    timing: dict[str, float] | None = None
    # A dynamic-shape kernel's dims and guards (kernels/dynamic.py: ShapeFamily.to_json).
    dynamic: dict[str, Any] | None = None
    # A region's result: its pytree structure and values (kernels/region.py: Outputs.to_json).
    result_structure: dict[str, Any] | None = None
    created: float = dataclasses.field(default_factory=time.time)
    # Where it was published (its op is ``op``): an entry moved to another key no longer matches.
    signature_key: str | None = None
    # The sha256 of each file beside the library (kernel.json), by name.
    sidecar_sha256: dict[str, str] | None = None
    # Of every other field as written in entry.json (see metadata_digest).
    metadata_sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["library"] = self.library.name if self.library else None
        d["metadata_sha256"] = metadata_digest(d)
        return d


def metadata_digest(data: dict[str, Any]) -> str:
    """The sha256 of an entry's fields as ``entry.json`` holds them, but its own:
    an edited or damaged ``entry.json`` no longer matches it."""
    fields = {k: v for k, v in data.items() if k != "metadata_sha256"}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


class LockedElsewhere(TimeoutError):
    """Another machine holds the signature's compile lock: the call runs
    eagerly, and the caches are asked again after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after


class EntryStore(Protocol):
    """The entries of one cache environment (one device kind, toolchain and
    set of compile options), keyed by op and signature key.

    Lookups raise ``UntrustedEntry`` for an entry someone else could have
    written; a damaged entry is set aside and reads as a miss.
    """

    # Local directory of this environment; its name is the environment's.
    directory: Path

    def lookup(self, op: str, signature_key: str) -> Entry | None:
        """The published entry, verified, or None."""

    def hold(self, op: str, signature_key: str) -> ContextManager[Entry | None]:
        """:meth:`lookup`, with the entry kept from removal for the block, so
        that its library can be loaded. A ``DamagedEntry`` raised in the block
        (its library does not load) sets the entry aside and propagates."""

    def set_aside(self, op: str, signature_key: str, reason: str) -> None:
        """Sets a published entry aside as damaged, for ``reason``: one whose
        library loaded but whose kernel proved it damaged when it was used."""

    def publish(self, signature_key: str, entry: Entry, files: dict[str, Path] | None = None) -> Entry:
        """Publishes ``entry`` with ``files`` (name in the entry -> source
        path), atomically; returns the entry as published. The first
        publication of a key wins: a later one returns the first's entry."""

    def lock_signature(self, op: str, signature_key: str, timeout: float = -1) -> ContextManager[object]:
        """Held while the signature is compiled, so that it is compiled once;
        what dead holders left half done is cleaned up on entry. Raises
        ``TimeoutError`` after ``timeout`` seconds (< 0: waits forever)."""

    def remove(self, op: str, signature_key: str) -> bool:
        """Removes a published entry unless it is held; whether it is gone."""

    def entries(self, op: str | None = None) -> Iterator[tuple[str, str]]:
        """(op, signature key) of every published entry (of ``op``, if given)."""

    def keys(self, op: str, prefix: str) -> list[str]:
        """The signature keys of ``op``'s entries that begin with ``prefix``:
        those published here, then those only the tier behind holds (which
        :meth:`lookup` fetches)."""

    def shared_directory(self) -> Path:
        """A local directory for build products that every compile of this
        environment shares."""


class RemoteTier(Protocol):
    """A store behind the local one, shared by other machines: it answers a
    local miss, is offered what is published locally, and orders compiles
    across machines. Nothing it holds is loaded before it has verified it
    (see :mod:`aoti_eager.cache.remote`), and it never raises for its
    server's failures: it is then simply empty."""

    def fetch(self, op: str, signature_key: str, into: Path) -> tuple[Entry, dict[str, Path]] | None:
        """The entry it holds, verified, with its files written into the
        directory ``into`` (name in the entry -> path); None if it has none
        that may be used."""

    def offer(self, op: str, signature_key: str, directory: Path) -> bool:
        """Publishes the local entry in ``directory`` unless it holds one for
        the key already; whether it did."""

    def keys(self, op: str, prefix: str) -> list[str]:
        """The signature keys of ``op``'s entries it holds that begin with
        ``prefix`` (the entries of a shape family, for one); [] if it cannot
        tell."""

    def lock_signature(self, op: str, signature_key: str, timeout: float = -1) -> ContextManager[bool]:
        """Held while the signature is compiled, across machines; yields
        whether the lock is held (False: the entry was published meanwhile,
        or the tier is unreachable). Raises :class:`LockedElsewhere` where
        another machine holds it (after a wait of at most ``timeout``
        seconds, where the tier waits at all)."""
