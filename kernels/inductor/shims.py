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
implicit fallback), and ``torch._inductor.lowering.fallback_handler`` and
``torch._inductor.select_algorithm.ExternKernelChoice`` for
:func:`declared_only`. Where one has moved, no op is said to be proxy-only: its
compile finds out, as it did before.

A torch build may call a C shim that its headers do not declare (torch 2.11
lowers CUDA's ``_grouped_mm`` to an ATen choice named after a shim its header
lacks; a header may gate a listed shim on a later torch): the wrapper would
not compile. Within :func:`declared_only`, such an op goes to the proxy
executor instead, as an op without a shim does; the headers are read from
``torch/include/torch/csrc/inductor/aoti_torch/generated``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import torch

from torch._C import DispatchKey
from torch._ops import OpOverload

from aoti_eager.cache import layout
from aoti_eager.kernels.inductor.internals import InternalMoved, resolve

INTERNALS = (
    "torchgen.aoti.fallback_ops.inductor_fallback_ops",
    "torch._inductor.decomposition.select_decomp_table()",
    "torch._inductor.lowering.lowerings",
    "torch._inductor.lowering.fallback_handler",
    "torch._inductor.select_algorithm.ExternKernelChoice",
)
_SHIMS, _DECOMPOSITIONS, _LOWERINGS, _FALLBACK, _CHOICE = INTERNALS


@lru_cache(maxsize=None)
def proxy_only(op: OpOverload) -> bool:
    """Whether AOTInductor's kernel of ``op`` would only call ``op`` through
    its proxy executor, whatever the inputs: no C shim, no decomposition, no
    lowering but a fallback (see :func:`_inductor_tables`)."""
    if op.namespace != "aten" or op._schema.is_mutable:
        return False  # functionalized into other ops before lowering (custom ops have shims of their own)
    if any(key != DispatchKey.Meta for key in getattr(op, "py_kernels", {DispatchKey.Autograd: None})):
        return False  # a Python kernel above the backend (upsample_bilinear2d's) decomposes it while it is traced
    try:
        if str(op) in resolve(_SHIMS):
            return False
    except InternalMoved:
        return False
    tables = _inductor_tables()
    return tables is not None and str(op) not in tables[0] and str(op) not in tables[1]


@lru_cache(maxsize=None)
def _inductor_tables() -> tuple[frozenset[str], frozenset[str]] | None:
    """The aten ops Inductor decomposes, and those it lowers to code of its
    own (not to a fallback), by name; None where an internal has moved. Read
    once per torch build and remembered in the user's private directory:
    importing Inductor's lowerings would otherwise weigh on every enable() of
    a warm start (BENCHMARKS.md, Model zoo)."""
    build = [torch.__version__, torch.version.git_version, _DECOMPOSITIONS, _LOWERINGS]
    name = f"inductor-tables-{hashlib.sha256(json.dumps(build).encode()).hexdigest()[:16]}.json"
    record = None
    try:  # a private directory that is not safe to use (PermissionError) only costs the reading
        record = layout.machine_record(name)
        data = json.loads(record.read_text())
        return frozenset(data["decomposed"]), frozenset(data["lowered"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        decomposed = sorted(map(str, resolve(_DECOMPOSITIONS)()))
        lowered = sorted(str(op) for op, lowering in resolve(_LOWERINGS).items() if not getattr(lowering, "_is_fallback_handler", False))
    except InternalMoved:
        return None
    if record is not None:
        with contextlib.suppress(OSError):
            layout.atomic_write_text(record, json.dumps({"decomposed": decomposed, "lowered": lowered}))
    return frozenset(decomposed), frozenset(lowered)


_HEADERS = Path(torch.__file__).parent / "include/torch/csrc/inductor/aoti_torch/generated"


_GATE = re.compile(r"#if TORCH_FEATURE_VERSION >= TORCH_VERSION_(\d+)_(\d+)_(\d+)")


@lru_cache(maxsize=None)
def declared_shims(device_type: str) -> frozenset[str] | None:
    """The C shims this torch's headers declare for ``device_type`` (and for
    every device), by name, those gated on a later torch version left out;
    None where the headers are not there to read."""
    try:
        lines = [line for name in (device_type, "aten") for line in (_HEADERS / f"c_shim_{name}.h").read_text().splitlines()]
    except OSError:
        return None
    version = tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:3])
    declared, gates = set(), []  # gates: for each open #if, whether it hides what it holds
    for line in lines:
        if line.startswith("#if"):
            gate = _GATE.match(line)
            gates.append(gate is not None and tuple(map(int, gate.groups())) > version)
        elif line.startswith("#endif") and gates:
            gates.pop()
        elif not any(gates):
            declared.update(re.findall(r"\b(aoti_torch_\w+)\s*\(", line))
    return frozenset(declared)


def _shim_names(op_name: str, device_type: str) -> tuple[str, str]:
    """The names torchgen gives ``op_name``'s (``aten.name.overload``) C shim on ``device_type`` and on every device."""
    _, name, overload = op_name.split(".", 2)
    function = name if overload == "default" else f"{name}_{overload}"
    return f"aoti_torch_{device_type}_{function}", f"aoti_torch_aten_{function}"


@contextlib.contextmanager
def declared_only(device_type: str, declared: frozenset[str] | None) -> Iterator[None]:
    """Within the block, Inductor calls through a C shim only where it is
    ``declared`` for ``device_type`` (:func:`declared_shims`; None: the
    headers were not there to read, and nothing changes): an op whose shim is missing goes to the
    proxy executor instead of a call that does not compile. Two places name
    shims: Inductor's list of fallbacks with one, and the ATen choices of its
    matmul and convolution lowerings (torch 2.11's ``_grouped_mm``), whose
    lowerings become fallbacks here."""
    try:
        shims, lowerings, fallback, choice = (resolve(name) for name in (_SHIMS, _LOWERINGS, _FALLBACK, _CHOICE))
    except InternalMoved:
        shims = lowerings = None
    if declared is None or not isinstance(shims, dict) or not isinstance(lowerings, dict):
        yield
        return
    undeclared = lambda name: not declared.intersection(_shim_names(name, device_type))  # noqa: E731
    missing_ops = {name: shims.pop(name) for name in list(shims) if name.startswith("aten.") and undeclared(name)}
    lowered = {op: lowerings[op] for op in _lowered_by_choices(choice, undeclared) if op in lowerings}
    lowerings.update({op: fallback(op, add_to_fallback_set=False) for op in lowered})
    try:
        yield
    finally:
        shims.update(missing_ops)
        lowerings.update(lowered)


def _lowered_by_choices(choice: type, undeclared: Callable[[str], bool]) -> list[OpOverload]:
    """The ops whose lowerings may call an ATen ``choice`` whose C shim is
    ``undeclared``: ``mm``'s for ``mm.out``, ``_grouped_mm``'s for itself."""
    chosen = {getattr(value, "op_overload", None) for name, module in list(sys.modules.items())
              if name.startswith("torch._inductor.kernel") for value in vars(module).values() if isinstance(value, choice)}
    ops = []
    for op in (op for op in chosen if isinstance(op, OpOverload)):
        if op.namespace == "aten" and undeclared(str(op)):
            functional = op._overloadname.removesuffix("out").removesuffix("_") or "default"
            ops.extend(getattr(op.overloadpacket, name) for name in [functional] if name in op.overloadpacket.overloads())
    return ops
