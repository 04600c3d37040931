"""The aten overloads whose AOTInductor kernel could only call the eager op
back, known before any compile from Inductor's own tables.

Inductor lowers an op to its own code, or decomposes it first, or leaves it
to a fallback kernel: the eager op, called through the op's C shim where
torchgen made one, else through AOTInductor's proxy executor, which converts
every argument and calls the dispatcher. An overload that is itself such a
fallback, with no C shim, compiles into nothing but that call, on every
device (the list of C shims is one for all devices: a device whose shim
header lacks an op fails to compile, it does not fall to the proxy executor).
Ops that reach a fallback only through a decomposition (Inductor's, or a
Python kernel of the op's, ``OpOverload.py_kernels``, that runs while it is
traced), or only for some inputs (complex ones), are left to their compile to
find out.

Torch internals it reads (:data:`INTERNALS`), checked with torch 2.11, 2.13
and 2.14.1: ``torchgen.aoti.fallback_ops.inductor_fallback_ops``, the ops with
a C shim, which ``FallbackKernel.codegen`` looks up by ``str(op)``;
``torch._inductor.decomposition.select_decomp_table``, the decompositions
Inductor applies before lowering; and ``torch._inductor.lowering.lowerings``,
whose fallbacks carry ``_is_fallback_handler`` (an op with no lowering is an
implicit fallback). Where one has moved, no op is said to be proxy-only: its
compile finds out, as it did before.
"""

from __future__ import annotations

from functools import lru_cache

from torch._C import DispatchKey
from torch._ops import OpOverload

from aoti_eager.kernels.inductor.internals import InternalMoved, resolve

INTERNALS = (
    "torchgen.aoti.fallback_ops.inductor_fallback_ops",
    "torch._inductor.decomposition.select_decomp_table()",
    "torch._inductor.lowering.lowerings",
)
_SHIMS, _DECOMPOSITIONS, _LOWERINGS = INTERNALS


@lru_cache(maxsize=None)
def proxy_only(op: OpOverload) -> bool:
    """Whether AOTInductor's kernel of ``op`` would only call ``op`` through
    its proxy executor, whatever the inputs. Inductor's lowerings (most of a
    second to import) are read only for an op with no C shim and no decomposition."""
    if op.namespace != "aten" or op._schema.is_mutable:
        return False  # functionalized into other ops before lowering (custom ops have shims of their own)
    if any(key != DispatchKey.Meta for key in getattr(op, "py_kernels", {DispatchKey.Autograd: None})):
        return False  # a Python kernel above the backend (upsample_bilinear2d's) decomposes it while it is traced
    try:
        if str(op) in resolve(_SHIMS) or op in resolve(_DECOMPOSITIONS)():
            return False
        lowering = resolve(_LOWERINGS).get(op)
    except InternalMoved:
        return False
    return lowering is None or getattr(lowering, "_is_fallback_handler", False)
