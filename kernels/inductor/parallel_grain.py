"""Dynamic CPU kernels split a loop across threads only where eager would.

A dynamic-shape kernel does not know its sizes when Inductor decides whether a
loop nest runs on several threads, so with ``cpp.dynamic_threads`` every loop
nest opens an OpenMP parallel region. ATen runs a loop serially below
``at::internal::GRAIN_SIZE`` elements; the region's fork and join then cost
more than a decode step's op (add 2.21x the static kernel at 8 rows of 1024 on
16 cores; generation 1.57x eager on a loaded 2-core machine). While
:func:`parallel_above_grain` is active, each region Inductor writes takes as
many threads as ``at::parallel_for`` would give the loop nest's element
count: one per grain, so a call below the grain runs on the calling thread.

This patches two private pieces of Inductor's C++ code generation; where a
PyTorch release lacks them, kernels are generated as Inductor writes them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

# at::internal::GRAIN_SIZE (ATen/Parallel.h).
GRAIN_SIZE = 32768

_PARALLEL_PRAGMA = "#pragma omp parallel"

# The C expression of the element count of the loop nest being generated.
_loop_nest = threading.local()


def _patch_points():
    try:
        from torch._inductor.codegen import cpp
    except ImportError:
        return None
    worksharing = getattr(cpp, "WorkSharing", None)
    proxy = getattr(cpp, "CppKernelProxy", None)
    if worksharing is None or proxy is None or not hasattr(proxy, "codegen_loops_impl") or not hasattr(worksharing, "parallel"):
        return None
    return cpp, worksharing, proxy


@contextlib.contextmanager
def parallel_above_grain() -> Iterator[None]:
    points = _patch_points()
    if points is None:
        yield
        return
    cpp, worksharing, proxy = points
    codegen_loops_impl, parallel = proxy.codegen_loops_impl, worksharing.parallel

    def loops_with_work(kernel, loop_nest, code, sharing):
        ranges = getattr(kernel, "call_ranges", None)
        _loop_nest.elements = (
            cpp.cexpr_index(kernel.rename_indexing(cpp.sympy_product(ranges))) if ranges else None
        )
        try:
            return codegen_loops_impl(kernel, loop_nest, code, sharing)
        finally:
            _loop_nest.elements = None

    def parallel_if_enough(sharing, threads):
        lines = sharing.code._lines
        written = len(lines)
        parallel(sharing, threads)
        elements = getattr(_loop_nest, "elements", None)
        if elements is None:
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
