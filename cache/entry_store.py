"""What the runtime asks of a kernel cache: the entry-store interface.

The runtime (aoti_eager._runtime, _worker, _prewarm) talks to a cache only
through :class:`EntryStore`. Its first implementation is the local
filesystem store, :class:`aoti_eager.cache.store.KernelCache`; every entry the
C++ hit path loads comes from there, verified.

A remote tier (a fleet cache, see DESIGN.md "Trust and the fleet") is another
``EntryStore`` set as the local store's ``behind``: on a local miss the local
store looks it up and publishes what it returns locally before answering, as
Triton's ``RemoteCacheManager`` materializes remote hits into its
``FileCacheManager``. The runtime does not change for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, ContextManager, Iterator, Protocol

if TYPE_CHECKING:
    from aoti_eager.cache.store import Entry


class EntryStore(Protocol):
    """The entries of one cache environment (one device kind, toolchain and
    set of compile options), keyed by op and signature key.

    Lookups raise ``UntrustedEntry`` for an entry someone else could have
    written; a damaged entry is set aside and reads as a miss.
    """

    # Local directory of this environment, where facts about this machine are
    # kept (which kernels crash on load, see kernels/load_probe.py).
    directory: Path

    def lookup(self, op: str, signature_key: str) -> Entry | None:
        """The published entry, verified, or None."""

    def hold(self, op: str, signature_key: str) -> ContextManager[Entry | None]:
        """:meth:`lookup`, with the entry kept from removal for the block, so
        that its library can be loaded. A ``DamagedEntry`` raised in the block
        (its library does not load) sets the entry aside and propagates."""

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

    def entries(self) -> Iterator[tuple[str, str]]:
        """(op, signature key) of every published entry."""

    def trim(self, max_bytes: int) -> tuple[int, int]:
        """Removes least recently used entries until at most ``max_bytes``
        are left; returns how many entries and bytes went."""

    def shared_directory(self) -> Path:
        """A local directory for build products that every compile of this
        environment shares."""
