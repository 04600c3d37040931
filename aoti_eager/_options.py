"""How :func:`aoti_eager.enable` and :func:`aoti_eager.fuse` compile and keep
kernels: one frozen value, checked once by the package's API and handed down
to the overrides (aoti_eager/_runtime.py) and the regions (aoti_eager/_regions.py)."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path

from aoti_eager.manifest import Recorder


class Compile(str, enum.Enum):
    """When a miss compiles: ``NOW`` before its call returns, ``BACKGROUND``
    beside the calls (which run eagerly meanwhile), ``NEVER`` (a kernel
    already in the cache is used)."""

    NOW = "now"
    BACKGROUND = "background"
    NEVER = "never"

    @classmethod
    def checked(cls, mode: str) -> Compile:
        try:
            return cls(mode)
        except ValueError:
            raise ValueError(f'aoti_eager: compile is "now", "background" or "never", not {mode!r}') from None


@dataclass(frozen=True)
class Options:
    compile: Compile
    root: Path  # the cache's root
    remote: str | None = None  # the fleet cache's URL; None: $AOTI_EAGER_REMOTE, if set
    recorder: Recorder | None = None  # where misses are recorded

    def kept_by_copies(self) -> Options:
        """These options less the recorder (a file lock), for a pickled copy of a fused module."""
        return dataclasses.replace(self, recorder=None)

    def same(self, other: Options) -> bool:
        """Whether ``other`` compiles and keeps alike: the same mode, cache, fleet cache and manifest."""
        path = lambda r: None if r is None else r.path  # noqa: E731
        return (self.compile, self.root, self.remote, path(self.recorder)) == (
            other.compile, other.root, other.remote, path(other.recorder))
