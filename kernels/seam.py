"""A default that a test swaps for a block, as Triton's knobs have ``scope()``:
what the pipeline compiles with (:class:`aoti_eager.kernels.pipeline.Compiler`)
and what the toolchain answers (:class:`aoti_eager.kernels.toolchain.Toolchain`).

    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Answers:
    ...     isa: str = "avx2"
    >>> answers = Seam(Answers())
    >>> with answers.scope(isa="avx512"):
    ...     answers.current().isa
    'avx512'
    >>> answers.current().isa
    'avx2'
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Generic, Iterator, TypeVar

T = TypeVar("T")


class Seam(Generic[T]):
    """Holds a frozen dataclass that every thread reads with :meth:`current`."""

    def __init__(self, default: T):
        self._current = default

    def current(self) -> T:
        """The one in effect."""
        return self._current

    @contextlib.contextmanager
    def scope(self, **fields: Any) -> Iterator[T]:
        """Within the block, the named fields of :meth:`current` are the given
        values, in every thread (a module-level value, not a context
        variable: a compile thread the runtime started earlier sees it too)."""
        saved, self._current = self._current, dataclasses.replace(self._current, **fields)
        try:
            yield self._current
        finally:
            self._current = saved
