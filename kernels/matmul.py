"""CUDA matmuls in 16-bit floats compile to Triton kernels.

Left to its defaults, Inductor lowers a matmul to a call of ATen's, which
calls cuBLAS: the kernel is eager's, and so is its cost on the host, more
than a Triton launch's (``addmm`` asks cuBLASLt for a heuristic on every
call; BENCHMARKS.md, "Models at real sizes"). A model whose layers are
op-sized is bound by its host on a GPU, so a 16-bit ``mm``, ``addmm`` (with a bias per column) or ``bmm`` on
CUDA compiles with Inductor's Triton templates instead, each autotuned at
the call's sizes. The speed verdict (kernels/speed.py) keeps eager where
cuBLAS is still faster; float32 is left to cuBLAS, which Triton does not
match without TF32.

A template's tiles are chosen for its reduction and column sizes, and a
kernel that reads those at run time loses to one tuned for them. So they
stay compiled in: they are part of the call's shape family
(kernels/dynamic.py), whose first kernel is static, and a dynamic kernel
takes only rows, and a ``bmm``'s batch, at any size. Past
``AOTI_EAGER_MAX_MATMUL_SIZES`` such families of one op, further sizes
run eagerly (aoti_eager/_planner.py).

Example::

    >>> import torch
    >>> from aoti_eager.kernels.signature import CallSignature
    >>> call = CallSignature.of(torch.ops.aten.addmm.default, "cpu", [torch.ones(3), torch.ones(4, 2), torch.ones(2, 3)])
    >>> fixed_dims(call), inductor_options(call)  # float32 on the CPU: no template
    (frozenset(), {})
"""

from __future__ import annotations

from typing import Any

from aoti_eager.kernels.signature import CallSignature, tensor_args

_TEMPLATE_DTYPES = {"bfloat16", "float16"}

# For each op, the (tensor, dim) pairs its kernel may take at any size, of its
# tensor arguments in schema order: a matrix's rows, a batch.
_MOVING_DIMS: dict[str, frozenset[tuple[int, int]]] = {
    "aten::mm": frozenset({(0, 0)}),
    "aten::addmm": frozenset({(1, 0)}),
    "aten::bmm": frozenset({(0, 0), (0, 1), (1, 0)}),
}


def is_template_matmul(signature: CallSignature) -> bool:
    """Whether ``signature`` compiles to an autotuned Triton matmul."""
    op = signature.op
    if signature.device.type != "cuda" or op._overloadname != "default" or op._schema.name not in _MOVING_DIMS:
        return False
    tensors = tensor_args(signature)
    # A bias of whole rows would move with the rows: left to cuBLAS, as before.
    bias_per_column = op._schema.name != "aten::addmm" or len(tensors[0].sizes) == 1
    return bias_per_column and all(t.dtype in _TEMPLATE_DTYPES for t in tensors)


def fixed_dims(signature: CallSignature) -> frozenset[tuple[int, int]]:
    """The (tensor, dim) pairs of ``signature``'s tensor arguments that its
    kernels compile in at every size: none but a template matmul's."""
    if not is_template_matmul(signature):
        return frozenset()
    moving = _MOVING_DIMS[signature.op._schema.name]
    return frozenset((i, d) for i, t in enumerate(tensor_args(signature)) for d in range(len(t.sizes)) if (i, d) not in moving)


def inductor_options(signature: CallSignature) -> dict[str, Any]:
    """The Inductor options ``signature`` compiles with besides its device's
    (kernels/compile.py's ``compile_options``, which names the templates'
    backend)."""
    return {"max_autotune_gemm": True} if is_template_matmul(signature) else {}
