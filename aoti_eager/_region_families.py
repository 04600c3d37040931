"""Which kernel a region's miss compiles across its call's sizes: the policy of one region family.

A region family's first shape compiles a static kernel. Its second (a batch
size or sequence length that moved) compiles a dynamic kernel of the dims
that changed (kernels/region_shapes.py), which serves every later call its
guards admit. A shape no dynamic kernel admits compiles a wider dynamic
kernel where dims moved that none of them takes, else a static kernel of its
own: a guard that refused it (dims export found equal, given unequal; a size
out of range) holds for a wider kernel too. Where a dynamic kernel failed
(in this process, or recorded in the cache), every shape compiles alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from aoti_eager import settings
from aoti_eager.kernels.dynamic import ShapeFamily, changed_sizes


@dataclass
class RegionFamily:
    """What this process knows of one region family."""

    # Sizes of the call's tensors of the family's shapes that missed here, most recent last.
    seen: list[list[tuple[int, ...]]] = field(default_factory=list)
    # Entry key -> its dynamic kernel's family (None: not a dynamic entry of this family).
    published: dict[str, ShapeFamily | None] = field(default_factory=dict)
    # Entry key -> what the calls its kernel serves run (shared by every shape it admits).
    decided: dict[str, Any] = field(default_factory=dict)
    # Why its shapes compile alone (its dynamic kernel failed), or None.
    static: str | None = None
    compiles: int = 0  # kernels compiled here for its shapes, static and dynamic together

    SEEN = 8

    def see(self, sizes: list[tuple[int, ...]]) -> None:
        if sizes not in self.seen:
            self.seen = [*self.seen, sizes][-self.SEEN:]

    def dynamic(self) -> list[tuple[str, ShapeFamily]]:
        """Its dynamic kernels, narrowest first."""
        known = [(key, family) for key, family in self.published.items() if family is not None]
        return sorted(known, key=lambda item: sum(map(len, item[1].dims)))

    def over_limit(self) -> str | None:
        """Why a new shape of the family runs eagerly instead of compiling
        (``max_shape_compiles`` reached), or None: the compile is counted."""
        limit = settings.max_shape_compiles.get()
        if self.compiles >= limit:
            return (f"{self.compiles} kernels already compiled for shapes of this family "
                    f"({settings.max_shape_compiles.name}={limit}); further shapes run eagerly")
        self.compiles += 1
        return None

    def to_compile(self, sizes: list[tuple[int, ...]]) -> ShapeFamily | None:
        """The dynamic kernel a miss of a call with tensors of ``sizes``
        compiles (none of the family's kernels admits it); None for a static one."""
        if self.static is not None or not settings.dynamic_shapes.get():
            return None
        known = [family.dims for _, family in self.dynamic()]
        changed = changed_sizes(sizes, self.seen)
        # A known kernel's dims too, but not at 0 or 1 here: export would fix them.
        dims = tuple(tuple(d for d in sorted(set(c).union(*(k[i] for k in known))) if sizes[i][d] >= 2) for i, c in enumerate(changed))
        if not any(changed) or any(all(set(d) <= set(k) for d, k in zip(dims, kernel)) for kernel in known):
            return None
        return ShapeFamily(dims)
