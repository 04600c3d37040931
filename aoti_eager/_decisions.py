"""What calls of a signature run: the miss path's answer to the C++ side.

The decision is one of :class:`UseKernel`, :class:`RetryLater` and
:class:`RunEagerly`. The C++ side reads every one the same way, through its
attributes: ``remember`` (bool: keep the decision for the signature's key, or
run this call eagerly and ask again on the next call, or, with a
``retry_after`` in seconds, on the first call after it), ``kernel`` (the
CompiledKernel to run, or None for the original kernel), ``dynamic`` (the
shape family it also holds for), ``judged`` (the dynamic kernel that was
judged against eager for the call's range of sizes only, or None) and, of an
eager decision, ``numbers``: the calls beyond the signature it holds for
(csrc/op_override.h: set_miss_handler).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Union

from aoti_eager.kernels.dynamic import ShapeFamily
from aoti_eager.kernels.signature import Position


@dataclass(frozen=True)
class UseKernel:
    """Calls of the signature run ``kernel``; with ``dynamic``, also every
    later call of its shape family that the kernel's guards admit."""

    kernel: Any  # a CompiledKernel (csrc/compiled_kernel.h); the C++ side keys it without its runtime numbers' values
    dynamic: ShapeFamily | None = None
    # With ``dynamic``: judged for the call's range of sizes only; other ranges ask again.
    per_range: bool = False
    remember: ClassVar[bool] = True

    @property
    def judged(self) -> Any:
        return self.kernel if self.per_range else None


@dataclass(frozen=True)
class RunEagerly:
    """Calls of the signature run the original kernel, for good in this
    process; with ``dynamic``, every call of its shape family that it admits;
    with ``numbers`` (positions, as :attr:`CallSignature.runtime_arguments`
    gives them), every call that differs from it only in their values."""

    reason: str
    dynamic: ShapeFamily | None = None
    numbers: tuple[Position, ...] = ()
    # With ``dynamic``: the dynamic kernel that eager beat in the call's range
    # of sizes; eager holds for that range only.
    judged: Any = None
    kernel: ClassVar[None] = None
    remember: ClassVar[bool] = True


@dataclass(frozen=True)
class RetryLater:
    """This call runs the original kernel; the next call of the signature asks again
    (a compile elsewhere has not ended, or a CUDA graph is being captured), or,
    with ``retry_after``, the first call after that many seconds: calls
    meanwhile run the original kernel straight from C++."""

    reason: str
    retry_after: float = 0.0
    kernel: ClassVar[None] = None
    dynamic: ClassVar[None] = None
    judged: ClassVar[None] = None
    remember: ClassVar[bool] = False


Decision = Union[UseKernel, RunEagerly, RetryLater]

# How long the calls of a signature that compiles in the background run the
# original kernel before one asks whether its kernel is ready. Asking on every
# call made a tiny call cost tens of times eager's (BENCHMARKS.md, "Background
# compiles"); a kernel takes over at most this much later.
BACKGROUND_RETRY_SECONDS = 0.1
