"""What the pipeline compiles: a :class:`Target`, one call of something eager runs.

Two kinds implement it: an op's call (kernels/op_target.py) and a region's,
one module's forward (kernels/region.py). The pipeline (kernels/pipeline.py)
takes either through the same steps, and knows no more of it than this
protocol says::

    target.key(family)            the entry it is published under
    target.family_key()           what its family's entry keys begin with
    target.admitted_by(family, k) whether the dynamic kernel published under k serves it
    target.reference()            eager's result, on copies          -> EagerRaised, Unfit
    target.export(compiler, ...)  torch.export and AOTInductor       -> CompileError
    target.guarded(family, ...)   a dynamic kernel's guards          -> NotDynamic
    target.check(compiler, ...)   the kernel against the reference   -> Mismatch
    target.further()              other calls it is checked at (other values of its numbers)
    target.resized(family, ...)   the call at other sizes, for a dynamic kernel's checks
    target.measure(compiler, ...) its time against eager's

A new kind of target (a decode step, a forward and backward pair) is a new
implementation of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager, Iterator, Protocol

import torch

from aoti_eager.kernels.compile import Artifact
from aoti_eager.kernels.dynamic import ShapeFamily
from aoti_eager.kernels.speed import Timing


class EagerRaised(Exception):
    """Eager itself rejects the call: its error is the caller's, and nothing is recorded."""


class Unfit(Exception):
    """No kernel can serve the call, for the reason given (a result a kernel
    cannot return); ``lasting``: it holds for every call of the key, and is
    recorded in the cache."""

    def __init__(self, reason: str, lasting: bool = True):
        super().__init__(reason)
        self.lasting = lasting


class Target(Protocol):
    """One call to compile a kernel for."""

    name: str  # what the cache lists its entries under: aten::abs, region::m.Block
    device: torch.device
    # A kernel that disagrees with eager is recorded so only where the key
    # holds all the result depends on (a region's weights are not in its key).
    keyed_whole: bool

    def short(self) -> str:
        """The call in a log line: ``self=float32[8, 8]``."""

    def to_json(self) -> list[dict[str, Any]]:
        """The call's inputs as a cache entry lists them."""

    def key(self, family: ShapeFamily | None) -> str | None:
        """The entry its kernel is published under: its own, or (``family``)
        the dynamic kernel's for calls like it; None where no kernel of
        ``family`` is made from this call."""

    def family_key(self) -> str:
        """What the keys of its shape family's dynamic kernels begin with (then ``-``)."""

    def admitted_by(self, family: ShapeFamily, key: str) -> bool:
        """Whether the dynamic kernel of ``family`` published under ``key`` serves this call."""

    def values_key(self) -> str | None:
        """Where a verdict that holds at every value of its numbers is
        recorded; None where it is recorded under its key alone."""

    def compiling(self) -> ContextManager[Any]:
        """What its compile and checks run within (the caller's random stream kept, autograd off)."""

    def reference(self) -> Any:
        """Eager's result, on copies of the call, as :meth:`check` takes it.
        Raises EagerRaised or Unfit."""

    def export(self, compiler: Any, reference: Any, family: ShapeFamily | None, shared_dir: Path) -> Artifact:
        """Its library (``family``: with those dims dynamic), made by
        ``compiler`` (kernels/pipeline.py's Compiler). Raises CompileError."""

    def guarded(self, family: ShapeFamily, artifact: Artifact) -> ShapeFamily:
        """``family`` with the guards ``artifact`` was exported with. Raises
        NotDynamic where they do not admit this call, or fixed a dim that moves."""

    def check(self, compiler: Any, kernel: Any, reference: Any) -> None:
        """Runs ``kernel`` on fresh copies of the call and compares it with
        ``reference`` through ``compiler.check`` or ``compiler.compare``. Raises Mismatch."""

    def further(self) -> Iterator["Target"]:
        """The calls a kernel of this key is checked at besides this one, in
        order: the first that eager takes is checked (other values of numbers
        the kernel takes at run time)."""

    def symbol_values(self, family: ShapeFamily) -> dict[int, int] | None:
        """The size of each of ``family``'s symbols in this call; None where its guards do not admit it."""

    def resized(self, family: ShapeFamily, values: dict[int, int]) -> "Target | None":
        """The call with ``family``'s symbols at ``values``; None where it
        cannot be built (or eager cannot be run safely on it)."""

    def measure(self, compiler: Any, kernel: Any, dynamic: bool) -> Timing | None:
        """``kernel``'s time against eager's at this call (``dynamic``: a dynamic kernel's); None: not timed."""

    def result_structure(self, reference: Any) -> dict[str, Any] | None:
        """What a cache entry keeps of the result's structure besides its tensors (a region's), or None."""
