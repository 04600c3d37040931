"""From one op call to an AOTInductor library.

The call becomes a small module whose inputs are the call's tensors and whose
other arguments are constants; ``torch.export`` traces it and AOTInductor
compiles the exported program into a shared library. In-place and ``out=``
ops stay mutating: the library writes into the given tensors.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json

import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch._inductor import metrics as inductor_metrics
from torch._prims_common import (
    compute_elementwise_output_logical_to_physical_perm, is_non_overlapping_and_dense_or_false, make_contiguous_strides_for,
)
from torch.fx.experimental import _config as fx_config

from aoti_eager.cache.store import LIBRARY_FILE, SIDECAR_FILES
from aoti_eager.kernels import toolchain
from aoti_eager.kernels.inductor import headers, scratch, shims
from aoti_eager.kernels.inductor.parallel_grain import parallel_above_grain
from aoti_eager.kernels.inductor.vec_isa import known_vec_isas
from aoti_eager.kernels.inductor.wrapper_split import split_wrapper_builds
from aoti_eager.kernels.signature import (
    Arg, CallSignature, ListArg, NumberArg, RuntimeNumberArg, TensorArg, clone_args, kernel_inputs,
)
from aoti_eager.kernels.toolchain import cpp_compiler, linker


# Inductor's defaults, changed where an op-sized kernel differs from a model.
# Every device: no line tables (-g1), which the library is stripped of anyway
# (see _strip): they only cost compile and link time.
# CPU: a loop is split across threads only above ATen's grain size (as eager
# does), so that a small op does not pay for an OpenMP fork and join.
# CUDA: the library carries its kernels' binaries, as it is moved into the cache,
# and its outputs have eager's strides (no padding for alignment). A matmul that
# autotunes (kernels/matmul.py) chooses among Triton kernels only: cuBLAS is eager's.
_INDUCTOR_OPTIONS: dict[str, dict[str, Any]] = {
    "cpu": {"cpp.min_chunk_size": 32768},
    "cuda": {"aot_inductor.embed_kernel_binary": True, "shape_padding": False, "comprehensive_padding": False,
             "max_autotune_gemm_backends": "TRITON"},
}


def compile_options(device_type: str) -> dict[str, Any]:
    """The Inductor options kernels for ``device_type`` are compiled with (part of the cache key)."""
    from torch._inductor import config as inductor_config

    options = {**_INDUCTOR_OPTIONS.get(device_type, {}), "cpp.cxx": (None, cpp_compiler())}
    # torch 2.11 has no such option: Inductor's patch would refuse every compile.
    if hasattr(inductor_config.aot_inductor, "enable_line_tables"):
        options["aot_inductor.enable_line_tables"] = False
    return options


class CompileError(Exception):
    """torch.export or AOTInductor failed on a call; the call runs eagerly.

    ``compiler_error`` holds the first lines of what the C++ compiler said when
    it is the compiler that failed. That can be the machine (a full disk, a
    killed compiler, a precompiled header another process was writing), so
    such a failure is not ``lasting``: it is not recorded in the cache.
    """

    def __init__(self, message: str, compiler_error: str | None = None, any_values: bool = False):
        super().__init__(message)
        self.compiler_error = compiler_error
        # The failure is the op's, not its numbers': other values fail the same way.
        self.any_values = any_values

    @property
    def lasting(self) -> bool:
        return self.compiler_error is None


def compiler_error(error: BaseException | None, lines: int = 3) -> str | None:
    """The first lines of the C++ compiler's own output (its errors first) if
    ``error`` is, or was caused by, Inductor's CppCompileError; else None."""
    while error is not None:
        if type(error).__name__ == "CppCompileError":
            output = [l.strip() for l in str(getattr(error, "output", "") or "").splitlines() if l.strip()]
            errors = [l for l in output if "error" in l.lower()]
            return " | ".join(line[:240] for line in (errors or output)[:lines]) or "no output"
        error = getattr(error, "inner_exception", None) or error.__cause__
    return None


@dataclass
class Artifact:
    """A compiled library and how to call it."""

    library: Path
    output_counts: list[int]
    seconds: dict[str, float] = field(default_factory=dict)
    workdir: tempfile.TemporaryDirectory | None = None
    # Of a dynamic-shape compile: the exported program's input shapes (kernel
    # input order; symbolic sizes as SymInts) and its range constraints.
    input_shapes: list[tuple[Any, ...]] = field(default_factory=list)
    input_strides: list[tuple[Any, ...]] = field(default_factory=list)
    range_constraints: dict[Any, Any] = field(default_factory=dict)
    # Kernels Inductor generated for it; none: it only calls eager's own (an
    # extern matmul, say), with AOTInductor's cost on top of eager's.
    generated_kernels: int | None = None
    # Of a module asked about its twins: the digest of its exported program (graph_digest).
    graph: str | None = None
    # Of a twin: the timing of the entry whose library it copied (Timing.to_json; empty where none was taken).
    timing: dict[str, float] | None = None


def mutated_arguments(op: torch._ops.OpOverload) -> list[int]:
    """Indices of the arguments the op writes into."""
    return [i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def return_alias_indices(op: torch._ops.OpOverload) -> list[int | None]:
    """For each return: the index of the argument it hands back, or None."""
    arguments = op._schema.arguments
    indices: list[int | None] = []
    for r in op._schema.returns:
        index = None
        if r.alias_info is not None and r.alias_info.is_write:
            index = next(
                i for i, a in enumerate(arguments) if a.alias_info is not None and a.alias_info.before_set == r.alias_info.before_set
            )
        indices.append(index)
    return indices


def split_arguments(op: torch._ops.OpOverload, args: list[Any] | tuple[Any, ...]) -> tuple[list[Any], dict[str, Any]]:
    """``args`` in schema order as the op takes them: positional ones, and keyword-only ones by name."""
    positional, keywords = [], {}
    for schema_arg, value in zip(op._schema.arguments, args):
        if schema_arg.kwarg_only:
            keywords[schema_arg.name] = value
        else:
            positional.append(value)
    return positional, keywords


def call_op(op: torch._ops.OpOverload, args: list[Any] | tuple[Any, ...]) -> Any:
    """Calls ``op`` with its arguments in schema order, keyword-only ones by name."""
    positional, keywords = split_arguments(op, args)
    return op(*positional, **keywords)


def flat_tensor_inputs(signature: CallSignature, args: tuple[Any, ...] | list[Any] | None = None) -> list[torch.Tensor]:
    """The kernel's inputs from ``args`` (default: the call's): their tensors
    and runtime numbers, in the order the arguments flatten (see
    :func:`~aoti_eager.kernels.signature.kernel_inputs`)."""
    inputs = kernel_inputs(signature.args if args is None else args, signature.described)
    return [runtime_number_input(v) if isinstance(d, RuntimeNumberArg) else v for v, d in inputs]


def runtime_number_input(value: int | float | torch.Tensor) -> torch.Tensor:
    """A runtime number as the kernel takes it: a 0-d CPU tensor, int64 for a
    Python int and float64 for a float or a wrapped number (the kernel reads
    it on the host, as eager reads a Python number), matching what
    csrc/op_override.cpp passes.

        >>> runtime_number_input(7).dtype, runtime_number_input(0.5).dtype
        (torch.int64, torch.float64)
    """
    if type(value) is int:
        return torch.tensor(value, dtype=torch.int64)
    return torch.tensor(float(value), dtype=torch.float64)


def per_item_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The ``.Scalar`` overload of a ``_foreach_*.ScalarList`` op, which
    Inductor lowers (it has no lowering of a list of scalars, and leaves
    such a call to a proxy executor that the runtime's kernels cannot call);
    None for any other op."""
    name = op._schema.name
    if op._schema.overload_name != "ScalarList" or not name.startswith("aten::_foreach_"):
        return None
    return getattr(getattr(torch.ops.aten, name.removeprefix("aten::")), "Scalar", None)


# cuBLAS's fast kernels read and write rows 16-byte aligned; an odd vocabulary leaves a matmul's output rows unaligned.
_ALIGNED_BYTES = 16
# Multiply-adds below which a matmul is not worth the copies that pad it (pad_mm's is_mm_compute_bound, roughly).
_PADDED_MIN_WORK = 1 << 24


def _padded_matmul(op: torch._ops.OpOverload, args: list[Any]) -> Any:
    """``mm``, ``addmm`` or ``bmm`` on CUDA with an unaligned inner or output
    dim, traced on operands zero-padded to aligned sizes and sliced back: what
    Inductor's pad_mm does, but before the output's layout is fixed, so that
    the kernel copies the result into eager's. None for any other call.
    (The kernel is timed against eager's as any other.)"""
    if op.name() not in ("aten::mm", "aten::addmm", "aten::bmm"):
        return None
    bias, a, b = (args[0], args[1], args[2]) if op.name() == "aten::addmm" else (None, args[0], args[1])
    if a.device.type != "cuda" or a.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    k, n = a.shape[-1], b.shape[-1]
    if not all(isinstance(d, int) and d > 0 for d in (*a.shape, *b.shape)) or a.numel() * n < _PADDED_MIN_WORK:
        return None  # a dynamic dim, an empty or a small matmul
    align = _ALIGNED_BYTES // a.element_size()
    pad_k, pad_n = -k % align, -n % align
    if pad_k == pad_n == 0:
        return None
    a = torch.nn.functional.pad(a, (0, pad_k))
    b = torch.nn.functional.pad(b, (0, pad_n, 0, pad_k))
    if bias is None:
        return call_op(op, [a, b, *args[2:]])[..., :n]
    if bias.dim() > 0 and bias.shape[-1] == n:
        bias = torch.nn.functional.pad(bias, (0, pad_n))
    return call_op(op, [bias, a, b, *args[3:]])[..., :n]


def traced_call(op: torch._ops.OpOverload, args: list[Any]) -> Any:
    """Calls ``op`` as a kernel traces it: a ``_foreach_*.ScalarList`` op as
    one call of its ``.Scalar`` overload per item, which computes what the
    op's own CPU and CUDA kernels do for tensors of one dtype and device."""
    per_item = per_item_overload(op)
    if per_item is None:
        padded = _padded_matmul(op, args)
        return call_op(op, args) if padded is None else padded
    def nth(argument: torch._C.Argument, value: Any, item: int) -> Any:
        if not isinstance(argument.type, torch._C.ListType):
            return value
        # A list of tensors stays a list (of one); the list of scalars gives its scalar.
        return value[item] if isinstance(argument.type.getElementType(), torch._C.NumberType) else [value[item]]

    results = [
        call_op(per_item, [nth(a, value, item) for a, value in zip(op._schema.arguments, args)])
        for item in range(len(args[0]))
    ]
    return [t for r in results for t in r] if op._schema.returns else None


def dense_order(t: Any) -> tuple[int, ...] | None:
    """The dims of ``t`` outermost first in memory, if it is dense (a
    permutation of a contiguous tensor); None for anything else."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or not is_non_overlapping_and_dense_or_false(t):
        return None
    perm, _ = compute_elementwise_output_logical_to_physical_perm(t)
    return tuple(perm)


def in_order(t: Any, order: tuple[int, ...] | None) -> Any:
    """``t`` laid out densely with its dims in ``order``, outermost first.
    Inductor drops the copy where ``t`` already is (a copy between equal
    layouts is one of its no-ops), and keeps it where dropping it would hand
    back an input's memory."""
    if order is None:
        return t
    strides = [0] * t.dim()
    for d, stride in zip(order, make_contiguous_strides_for([t.shape[d] for d in order])):
        strides[d] = stride
    # Not empty_permuted: export makes it a permuted view, and the copy would
    # then not be the output, which Inductor checks for aliasing an input.
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


class _OpCall(torch.nn.Module):
    """``forward(*tensors)`` calls the op with every other argument fixed.

    Its outputs have eager's layout: the order of dims in memory of
    ``eager_result``'s dense tensors. Inductor keeps the strides its own
    decompositions give an output, which are not always eager's (``cat`` of
    one non-empty tensor is its ``clone``, in the input's layout, where eager
    returns a contiguous tensor); where they are eager's, the copy into
    eager's layout costs nothing (see :func:`in_order`)."""

    def __init__(self, signature: CallSignature, eager_result: Any = None):
        super().__init__()
        self.op = signature.op
        self.signature = signature
        # Returns that hand back a mutated argument (in-place, out=).
        self.aliased = [i is not None for i in return_alias_indices(signature.op)]
        self.orders = [dense_order(t) for t in self._outputs(eager_result)] if eager_result is not None else None

    def _arguments(self, tensors: list[torch.Tensor]) -> list[Any]:
        it = iter(tensors)

        def rebuild(value: Any, described: Arg) -> Any:
            if isinstance(described, RuntimeNumberArg):
                return next(it).item()  # traced as a number read at run time (an unbacked SymInt for an int)
            if isinstance(described, TensorArg):
                return next(it)
            if isinstance(described, NumberArg):
                return described.value  # a Python number, also where a wrapped number was given
            if isinstance(described, ListArg):
                return [rebuild(v, d) for v, d in zip(value, described.items)]
            return value

        return [rebuild(v, d) for v, d in zip(self.signature.args, self.signature.described)]

    def forward(self, *tensors: torch.Tensor):
        outputs = self._outputs(traced_call(self.op, self._arguments(list(tensors))))
        return tuple(in_order(t, order) for t, order in zip(outputs, self.orders or itertools.repeat(None)))

    def _outputs(self, result: Any) -> list[Any]:
        """The returns of ``result`` the kernel gives back, flat."""
        results = result if isinstance(result, tuple) else (result,)
        if not self.op._schema.returns:
            results = ()
        outputs = []
        for aliased, r in zip(self.aliased, results):
            if aliased:
                continue  # the library mutates the argument in place
            if isinstance(r, (list, tuple)):
                outputs.extend(r)
            else:
                outputs.append(r)
        return outputs

    def output_counts(self, eager_result: Any) -> list[int]:
        results = eager_result if isinstance(eager_result, tuple) else (eager_result,)
        if not self.op._schema.returns:
            results = ()
        return [0 if aliased else (len(r) if isinstance(r, (list, tuple)) else -1) for aliased, r in zip(self.aliased, results)]


def _dynamic_options(device_type: str, dynamic_shapes: tuple[Any, ...] | None) -> dict[str, Any]:
    """Options of a dynamic-shape kernel beyond its environment's. On CPU,
    Inductor decides whether a loop is split across threads from the sizes it
    compiles at: a kernel made at a few rows would run every later size on one
    thread (4-16x a static kernel's time at 512 and 8192 rows of 1024 on 16
    cores). With dynamic threads every loop nest has a parallel region, and
    OpenMP sizes it when the kernel runs; below ATen's grain it runs on one
    thread (:mod:`aoti_eager.kernels.inductor.parallel_grain`)."""
    if dynamic_shapes is None or device_type != "cpu":
        return {}
    return {"cpp.dynamic_threads": True}


def _size_oblivious(dynamic: bool) -> Any:
    """A dynamic-shape kernel is traced and lowered with sizes 0 and 1
    size-oblivious: its code does not branch on them, so one kernel also serves a batch of
    one (kernels/dynamic.py admits 1 only where a check at 1 agreed with
    eager). Without it, export fixes every dim that is 1 in a later call's
    family to a kernel of its own."""
    if not dynamic:
        return contextlib.nullcontext()
    return fx_config.patch(backed_size_oblivious=True)


@contextlib.contextmanager
def _without_whole_graph_patterns(device_type: str) -> Iterator[None]:
    """Within the block, Inductor does not build the pattern tables it builds
    once per process for whole graphs, beside those its imports register.
    The joint graph's (attention fusion, matmul padding, which CUDA compiles
    turn off, and randperm indexing) rewrite sequences of ops that one op's
    graph does not have; on CPU, the post-grad ones fuse oneDNN calls on
    prepacked weights, which only freezing a model makes. CUDA's post-grad
    tables stay: their online softmax rewrites softmax's own decomposition.
    Building the tables skipped here was a large share of a process's first
    compile, and each CUDA worker built them with CUDA tensors
    (BENCHMARKS.md, "Compile time of a new signature").

    A ``torch.compile`` later in the process builds them as usual; tables one
    built earlier apply to the op's graph as to any other.
    """
    from torch._inductor.fx_passes import joint_graph, post_grad

    passes = [joint_graph] if device_type == "cuda" else [joint_graph, post_grad]
    passes = [module for module in passes if hasattr(module, "lazy_init")]
    saved = [module.lazy_init for module in passes]
    for module in passes:
        module.lazy_init = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for module, lazy_init in zip(passes, saved):
            module.lazy_init = lazy_init


def compile_call(
    signature: CallSignature,
    eager_result: Any,
    options: dict[str, Any],
    workdir: tempfile.TemporaryDirectory | None = None,
    shared_dir: Path | None = None,
    vec_isas: dict[str, list[str]] | None = None,
    dynamic_shapes: tuple[Any, ...] | None = None,
) -> Artifact:
    """Compiles ``signature``'s call with the Inductor ``options`` (see
    :func:`compile_options`) into a library in ``workdir`` (default: a new
    directory of :mod:`aoti_eager.kernels.inductor.scratch`), which the artifact then owns. ``shared_dir`` keeps
    what compiles with the same options share (see
    :mod:`aoti_eager.kernels.inductor.wrapper_split`); without it, nothing is shared.
    ``vec_isas``: the vector ISAs Inductor found usable here before (see
    :func:`aoti_eager.kernels.inductor.vec_isa.known_vec_isas`); without them, it probes.

    ``eager_result`` is what the original kernel returned for the call; it fixes
    the structure of the outputs (e.g. the length of a returned Tensor[]).
    ``dynamic_shapes``, as ``torch.export.export`` takes it, makes dims
    symbolic (see :mod:`aoti_eager.kernels.dynamic`).
    Raises CompileError with the stage and cause on failure.
    """
    module = _OpCall(signature, eager_result)
    # Fresh copies: tracing an in-place op must not touch the caller's tensors.
    example = tuple(flat_tensor_inputs(signature, clone_args(signature.args)))
    dynamic = _dynamic_options(signature.device.type, dynamic_shapes)
    artifact, exported = _export_and_compile(
        module, example, signature.device.type, {**options, **dynamic}, workdir, shared_dir, vec_isas, dynamic_shapes,
        whole_graph=False,
    )
    artifact.output_counts = module.output_counts(eager_result)
    if dynamic_shapes is not None:
        _keep_exported_inputs(artifact, exported)
    return artifact


def _keep_exported_inputs(artifact: Artifact, exported: torch.export.ExportedProgram) -> None:
    """Keeps in ``artifact`` what a dynamic-shape kernel's guards are read
    from: the exported program's input shapes and strides and its range constraints."""
    inputs = {node.name: node for node in exported.graph.nodes if node.op == "placeholder"}
    artifact.input_shapes = [tuple(inputs[name].meta["val"].shape) for name in exported.graph_signature.user_inputs]
    artifact.input_strides = [tuple(inputs[name].meta["val"].stride()) for name in exported.graph_signature.user_inputs]
    artifact.range_constraints = dict(exported.range_constraints)


def compile_module(
    module: torch.nn.Module,
    example: tuple[torch.Tensor, ...],
    device_type: str,
    options: dict[str, Any],
    shared_dir: Path | None = None,
    vec_isas: dict[str, list[str]] | None = None,
    dynamic_shapes: tuple[Any, ...] | None = None,
    writable: frozenset[int] = frozenset(),
    twin: Callable[[str, Path], dict | None] | None = None,
) -> Artifact:
    """Compiles ``module``, whose forward takes the tensors ``example`` and
    returns a tuple of tensors, as :func:`compile_call` compiles an op's call.
    Its library returns one tensor per output (output counts all -1). A
    module that writes into its inputs is refused, but into those of
    ``writable`` (indices of ``example``), which the library writes as the
    module does. ``dynamic_shapes`` as :func:`compile_call` takes it.
    ``twin(digest, library)``: copies a library built from an exported
    program of that :func:`graph_digest` to ``library``, which then stands
    for AOTInductor's, and returns the timing of the entry it copied (None:
    nothing copied). Raises CompileError with the stage and cause on failure."""
    dynamic = _dynamic_options(device_type, dynamic_shapes)
    artifact, exported = _export_and_compile(
        module, example, device_type, {**options, **dynamic}, None, shared_dir, vec_isas, dynamic_shapes, whole_graph=True,
        check_exported=functools.partial(_refuse_mutations, writable=writable), twin=twin,
    )
    outputs = exported.graph_signature.user_outputs
    artifact.output_counts = [-1] * len(outputs)
    if dynamic_shapes is not None:
        _keep_exported_inputs(artifact, exported)
    return artifact


def _refuse_mutations(exported: torch.export.ExportedProgram, writable: frozenset[int]) -> None:
    """Raises CompileError where the program writes into one of its inputs
    (or a view of one) but those of ``writable``: the exported graph keeps
    in-place ops as they are."""
    for node in exported.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for argument, value in zip(schema.arguments, node.args):
            written = _input_of(value) if argument.alias_info is not None and argument.alias_info.is_write else None
            index = None if written is None else exported.graph_signature.user_inputs.index(written)
            if index is not None and index not in writable:
                raise CompileError(
                    f"torch.export failed: the forward writes into its input {index} (inputs: its parameters and "
                    f"buffers, then the call's tensors) with {node.target}, which a compiled module does not keep",
                    any_values=True,
                )


def _input_of(value: Any) -> str | None:
    """The placeholder that ``value`` (a graph node) is, or is a view of; None for another value."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function":
        schema = getattr(value.target, "_schema", None)
        returns = schema.returns if schema is not None else []
        if not (returns and returns[0].alias_info is not None and value.args):
            return None  # new memory, not a view
        value = value.args[0]
    return value.name if isinstance(value, torch.fx.Node) and value.op == "placeholder" else None


def _export_and_compile(
    module: torch.nn.Module,
    example: tuple[Any, ...],
    device_type: str,
    inductor_options: dict[str, Any],
    workdir: tempfile.TemporaryDirectory | None,
    shared_dir: Path | None,
    vec_isas: dict[str, list[str]] | None,
    dynamic_shapes: tuple[Any, ...] | None,
    whole_graph: bool,
    check_exported: Any = None,
    twin: Callable[[str, Path], dict | None] | None = None,
) -> tuple[Artifact, Any]:
    """``torch.export`` of ``module`` at ``example``, then AOTInductor: the
    artifact (its output counts left to the caller) and the exported program.
    ``whole_graph``: a module's graph, not one op's: Inductor builds its
    pattern tables for it (see :func:`_without_whole_graph_patterns`), and it
    may leave some of its ops to the proxy executor.
    ``check_exported`` may refuse the exported program (raises CompileError)."""
    if workdir is None:
        workdir = scratch.compile_directory()
    library = Path(workdir.name) / LIBRARY_FILE
    seconds: dict[str, float] = {}
    stage = "torch.export"
    from torch._inductor import config as inductor_config

    try:
        # Inductor's settings and vector ISAs hold from the start, for the header
        # checks that run beside the export (see kernels/inductor/headers.py).
        with warnings.catch_warnings(), scratch.compiling(), inductor_config.patch(inductor_options), \
                known_vec_isas(vec_isas), headers.checked_ahead(shared_dir), _size_oblivious(dynamic_shapes is not None):
            # Deprecation notices from PyTorch internals are not the user's concern.
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            exported = torch.export.export(module, example, dynamic_shapes=dynamic_shapes, strict=False)
            seconds["export"] = time.perf_counter() - start
            if check_exported is not None:
                check_exported(exported)
            graph = None if twin is None else graph_digest(exported, example, inductor_options)
            if graph is not None and (timing := twin(graph, library)) is not None:
                seconds["twin"] = time.perf_counter() - start - seconds["export"]
                return Artifact(library, [], seconds, workdir, graph=graph, timing=timing), exported
            stage = "AOTInductor"
            start = time.perf_counter()
            generated_before = _generated_kernels()
            # Dynamic threads: a dynamic-shape kernel (see _dynamic_options).
            grain = parallel_above_grain() if inductor_options.get("cpp.dynamic_threads") else contextlib.nullcontext()
            patterns = contextlib.nullcontext() if whole_graph else _without_whole_graph_patterns(device_type)
            with split_wrapper_builds(shared_dir, seconds, linker()), grain, patterns, shims.declared_only(device_type, toolchain.current().declared_shims(device_type)):
                torch._inductor.aot_compile(
                    exported.module(), example,
                    options={**inductor_options, "aot_inductor.output_path": str(library)},
                )
            seconds["lowering"] = time.perf_counter() - start - sum(t for s, t in seconds.items() if s != "export")
            generated = None if generated_before is None else _generated_kernels() - generated_before
            _strip(library)
            # Ops that AOTInductor leaves to the dispatcher are described in a
            # JSON file, which the runner looks for beside the library.
            for path in library.parent.glob("*.json"):
                if not path.name.endswith("_metadata.json") and path != library.with_suffix(".json"):
                    shutil.copyfile(path, library.with_suffix(".json"))
    except CompileError:
        workdir.cleanup()
        raise
    except Exception as e:  # noqa: BLE001 - any failure means "run eagerly"
        workdir.cleanup()
        said = compiler_error(e)
        if said is not None:
            raise CompileError(f"{stage} failed: the C++ compiler said: {said}", compiler_error=said) from e
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CompileError(f"{stage} failed: {type(e).__name__}: {message[:300]}") from e
    # A module's graph keeps what it fuses around such a call (its check and
    # speed verdict judge it); an op's kernel would be nothing but the call.
    left = [] if whole_graph else left_to_proxy_executor(library.with_suffix(".json"))
    if left:
        workdir.cleanup()
        raise CompileError(
            f"AOTInductor leaves {', '.join(left)} to its proxy executor (it has no C shim): the kernel would only "
            "call the eager op, at a cost", any_values=True,
        )
    return Artifact(library, [], seconds, workdir, generated_kernels=generated, graph=graph), exported


def graph_digest(exported: torch.export.ExportedProgram, example: tuple[Any, ...], options: dict[str, Any]) -> str:
    """What AOTInductor builds a library from: the exported graph's code, its
    inputs' metadata (symbolic sizes too) and signature, its constants'
    values, the example's layout and Inductor's options. Two programs of
    one digest are one library (a decoder's layers, whose index selects only
    their cache layer)."""
    digest = hashlib.sha256()
    placeholders = [node.meta.get("val") for node in exported.graph.nodes if node.op == "placeholder"]
    described = [(tuple(v.shape), tuple(v.stride()), str(v.dtype), str(v.device)) if isinstance(v, torch.Tensor) else repr(v)
                 for v in placeholders]
    layout = [(tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device)) if isinstance(t, torch.Tensor) else repr(t)
              for t in example]
    # Every graph's code: a higher-order op's subgraphs (cond's branches, flex attention's score_mod) are modules of their own.
    graphs = [f"{name}:{m.code}" for name, m in exported.graph_module.named_modules() if isinstance(m, torch.fx.GraphModule)]
    for part in (*graphs, str(exported.graph_signature), repr(described), repr(layout),
                 repr(sorted(exported.range_constraints.items(), key=str)), repr(sorted(options.items(), key=str))):
        digest.update(part.encode())
    for name, value in sorted(exported.constants.items()):
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().contiguous()
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        else:
            digest.update(repr(value).encode())
    return digest.hexdigest()


def _generated_kernels() -> int | None:
    """How many kernels Inductor generated in this process (a counter its own
    tests read); None where a torch keeps no such count."""
    return getattr(inductor_metrics, "generated_kernel_count", None)


def left_to_proxy_executor(extern_nodes: Path) -> list[str]:
    """The ops that a library calls through AOTInductor's proxy executor, as
    its extern-node file beside it names them (none without one). Such a
    kernel calls the eager op through the dispatcher, converting every
    argument on the way, and some (a list of scalars) the proxy executor
    cannot convert at all: it fails on every call."""
    try:
        nodes = json.loads(extern_nodes.read_text()).get("nodes") or []
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError):
        return ["ops it does not describe"]
    targets = [str(node.get("node", {}).get("target", "an op")) if isinstance(node, dict) else "an op" for node in nodes]
    return sorted(set(targets))


def _strip(library: Path) -> None:
    """Drops what only a debugger reads: symbol tables and debug sections are
    about 80% of an op-sized library. The loader's dynamic symbols stay; without
    a ``strip`` tool the library is kept as it is."""
    strip = shutil.which("strip")
    if strip is not None:
        subprocess.run([strip, "--strip-unneeded", str(library)], capture_output=True, timeout=120)


def sidecar_files(artifact: Artifact) -> dict[str, Path]:
    """The files the library needs at run time, by their name in a cache entry."""
    # The library is named as in an entry, the files beside it too (kernel.json: its ops left to the dispatcher).
    files = [artifact.library, *(artifact.library.with_name(name) for name in SIDECAR_FILES)]
    return {path.name: path for path in files if path.exists()}
