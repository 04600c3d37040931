"""Dynamic CPU kernels split a loop across threads only where eager would.

A dynamic-shape kernel does not know its sizes when Inductor decides whether a
loop nest runs on several threads, so with ``cpp.dynamic_threads`` every loop
nest opens an OpenMP parallel region. ATen runs a loop serially below
``at::internal::GRAIN_SIZE`` elements; the region's fork and join then cost
more than a decode step's op (an ``add`` of 8 rows of 1024 took twice the
static kernel's time on 16 cores, and generation was slower than eager). While
:func:`parallel_above_grain` is active, each region Inductor writes takes as
many threads as ``at::parallel_for`` would give the loop nest's element
count: one per grain, so a call below the grain runs on the calling thread.

Torch internals it touches (:data:`INTERNALS`), checked with torch 2.11, 2.13
and 2.14.1: ``torch._inductor.codegen.cpp.CppKernelProxy.codegen_loops_impl``
and ``torch._inductor.codegen.cpp.WorkSharing.parallel``, replaced within
:func:`parallel_above_grain`; ``torch._inductor.codegen.cpp.cexpr_index`` and
``torch._inductor.codegen.cpp.sympy_product``, which write the loop nest's
element count from its kernel's ``call_ranges`` and ``rename_indexing``; the
lines of the ``WorkSharing``'s code buffer (``torch._inductor.utils.IndentedBuffer``),
where the pragma is rewritten. Where one of them has moved (``missing(INTERNALS)``),
or a kernel or buffer lacks what is read of it, kernels are generated as
Inductor writes them: a dynamic kernel then forks its threads below the
grain too, slower but the same results.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from aoti_eager.kernels.inductor.internals import missing

# at::internal::GRAIN_SIZE (ATen/Parallel.h).
GRAIN_SIZE = 32768

_PARALLEL_PRAGMA = "#pragma omp parallel"

# The C expression of the element count of the loop nest being generated.
_loop_nest = threading.local()


INTERNALS = (
    "torch._inductor.codegen.cpp.CppKernelProxy.codegen_loops_impl(self, loop_nest, code, worksharing)",
    "torch._inductor.codegen.cpp.WorkSharing.parallel(self, threads)",
    "torch._inductor.codegen.cpp.cexpr_index()",
    "torch._inductor.codegen.cpp.sympy_product()",
    "torch._inductor.utils.IndentedBuffer",
)


@contextlib.contextmanager
def parallel_above_grain() -> Iterator[None]:
    """Within the block, each parallel region Inductor writes for a CPU
    kernel takes one thread per grain of its loop nest's work; where an
    internal has moved (``missing(INTERNALS)``), the block changes nothing."""
    if missing(INTERNALS):
        yield
        return
    from torch._inductor.codegen import cpp

    worksharing, proxy = cpp.WorkSharing, cpp.CppKernelProxy
    codegen_loops_impl, parallel = proxy.codegen_loops_impl, worksharing.parallel

    def loops_with_work(kernel, loop_nest, code, sharing):
        ranges = getattr(kernel, "call_ranges", None)
        rename = getattr(kernel, "rename_indexing", None)
        _loop_nest.elements = cpp.cexpr_index(rename(cpp.sympy_product(ranges))) if ranges and rename else None
        try:
            return codegen_loops_impl(kernel, loop_nest, code, sharing)
        finally:
            _loop_nest.elements = None

    def parallel_if_enough(sharing, threads):
        lines = getattr(getattr(sharing, "code", None), "_lines", None)
        written = len(lines) if isinstance(lines, list) else None
        parallel(sharing, threads)
        elements = getattr(_loop_nest, "elements", None)
        if elements is None or written is None:
            return
        for i in range(written, len(lines)):
            line = lines[i]
            if isinstance(line, str) and line.strip() == _PARALLEL_PRAGMA:
                threads = f"std::min<int64_t>(omp_get_max_threads(), (({elements}) + {GRAIN_SIZE - 1}) / {GRAIN_SIZE})"
                lines[i] = line.replace(_PARALLEL_PRAGMA, f"{_PARALLEL_PRAGMA} num_threads(std::max<int64_t>(1, {threads}))")

    proxy.codegen_loops_impl, worksharing.parallel = loops_with_work, parallel_if_enough
    try:
        yield
    finally:
        proxy.codegen_loops_impl, worksharing.parallel = codegen_loops_impl, parallel
