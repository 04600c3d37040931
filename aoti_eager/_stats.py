"""What the calls of one op overload on one device, or of one region's
instances, did in this process: a row of :func:`aoti_eager.stats`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Stats:
    """One op's or one region's counts. An op's calls, hits and fallbacks are
    counted by its C++ kernel (csrc/op_override.h) and read when reported;
    a region's, by its Python forward."""

    calls: int = 0
    hits: int = 0
    # Calls that ran the original kernel or forward, and the last reason why.
    fallbacks: int = 0
    fallback_reason: str | None = None
    compiles: int = 0
    compile_seconds: float = 0.0
    cache_loads: int = 0
    queued: int = 0  # compiles started in the background

    def compiled(self, seconds: float) -> None:
        """A compile here published a kernel (or a verdict) in ``seconds``."""
        self.compiles += 1
        self.compile_seconds = round(self.compile_seconds + seconds, 3)

    def row(self, **more: Any) -> dict[str, Any]:
        """The counts as :func:`aoti_eager.stats` reports them, with ``more``."""
        return {**vars(self), **more}
