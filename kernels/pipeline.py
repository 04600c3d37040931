"""One signature's compile, from a miss to a published cache entry.

Eager runs first, on copies of the call: its result is what the kernel must
match, and its error is the caller's. Then ``torch.export`` and AOTInductor
(kernels/compile.py), the new kernel on fresh copies against eager's result
(kernels/validate.py), its time against eager's (kernels/speed.py), and the
entry published in the store: the kernel, or eager where eager was measured
faster or the kernel failed. Nobody loads a library this did not check.

The runtime holds the signature's lock around :func:`compile_signature` and
turns its outcome into the call's decision; what it needs of ``_C`` (loading a
library as a kernel) it passes in. What makes, checks and times a kernel is a
:class:`Compiler`, which a test gives with :func:`scope`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Union

import torch
import torch.utils._pytree as pytree

from aoti_eager import settings
from aoti_eager.cache.entry_store import Entry, EntryStore
from aoti_eager.kernels import matmul, quiet
from aoti_eager.kernels.dynamic import NotDynamic, ShapeFamily
from aoti_eager.kernels.compile import Artifact, CompileError, call_op, compile_call, compile_module, compile_options, sidecar_files
from aoti_eager.kernels.seam import Seam
from aoti_eager.kernels.signature import CallSignature, clone_args, qualified_name
from aoti_eager.kernels.speed import Timer, Timing, measured, time_against_eager, time_region_against_eager
from aoti_eager.kernels.toolchain import vec_isas_for
from aoti_eager.kernels.validate import Mismatch, check_matches_eager, compare

log = logging.getLogger("aoti_eager")

# Loads a library as a kernel: (library, output counts) -> a CompiledKernel
# (csrc/compiled_kernel.h), checked against the signature's inputs.
Loader = Callable[[Path, list[int]], Any]


@dataclass(frozen=True)
class Published:
    """An entry for the signature is in the store: a kernel, or eager where
    eager was measured faster. ``key`` is the entry's key; ``family`` the
    dynamic kernel's dims and guards."""

    seconds: float
    stages: dict[str, float]  # stage name -> seconds (export, compile, load, ...)
    key: str
    family: ShapeFamily | None = None


@dataclass(frozen=True)
class NotCompiled:
    """No kernel, and why. ``recorded``: an eager entry in the store says so
    to every process. ``eager_raised``: eager itself rejects the call (its
    error reaches the caller). ``compiler_error``: what the C++ compiler said,
    where it is the compiler that failed (the machine's problem, not
    recorded)."""

    reason: str
    recorded: bool = False
    eager_raised: bool = False
    compiler_error: str | None = None
    any_values: bool = False  # it holds for every value of the call's numbers (recorded so)


Outcome = Union[Published, NotCompiled]


@dataclass(frozen=True)
class Compiler:
    """What :func:`compile_signature` makes, checks and times a kernel with:
    ``compile`` as :func:`~aoti_eager.kernels.compile.compile_call` (raises
    CompileError), ``check`` as :func:`~aoti_eager.kernels.validate.check_matches_eager`
    (raises Mismatch), ``timer`` as :func:`~aoti_eager.kernels.speed.time_against_eager`,
    ``region_timer`` as :func:`~aoti_eager.kernels.speed.time_region_against_eager`;
    a region's ``compile_module`` as :func:`~aoti_eager.kernels.compile.compile_module`,
    and ``compare`` (each of its results and written inputs against eager's) as
    :func:`~aoti_eager.kernels.validate.compare` (raises Mismatch). By
    default those; a test gives its own with :func:`scope`."""

    compile: Callable[..., Artifact] = compile_call
    check: Callable[..., None] = check_matches_eager
    timer: Timer = time_against_eager
    region_timer: Callable[..., Timing] = time_region_against_eager
    compile_module: Callable[..., Artifact] = compile_module
    compare: Callable[..., None] = compare


_compiler = Seam(Compiler())
# What compiles where compile_signature is given no compiler; scope(compile=...) swaps parts within a block.
current, scope = _compiler.current, _compiler.scope


def compile_signature(
    op: torch._ops.OpOverload,
    signature: CallSignature,
    store: EntryStore,
    load: Loader,
    family: ShapeFamily | None = None,
    seen: list[list[tuple[int, ...]]] | None = None,
    timer: Timer | None = None,
    compiler: Compiler | None = None,
) -> Outcome:
    """Compiles, validates, times and publishes the kernel of ``signature``.
    Another process's entry may have been published first: the store keeps
    the first, and the caller reads what it holds.

    With ``family``, a dynamic kernel whose ``family.dims`` are symbols: it is
    also checked against eager at the ``seen`` shapes (each tensor's sizes)
    its guards admit and at one further shape, and published under its
    family's key. A dynamic kernel that fails is not recorded: the caller
    compiles the shape statically instead. ``compiler`` makes, checks and
    times the kernel (default: :func:`current`); ``timer``, where given,
    times it instead of the compiler's.

    What it all prints is logged at DEBUG level, not shown (kernels/quiet.py)."""
    output: list[str] = []
    try:
        with quiet.captured(output):
            chosen = compiler or current()
            if timer is not None:
                chosen = dataclasses.replace(chosen, timer=timer)
            return _compile_signature(op, signature, store, load, family, seen, chosen)
    finally:
        if output:
            log.debug("aoti_eager: what compiling %s for (%s) printed:\n%s", qualified_name(op), signature.short(), "\n".join(output))


def _compile_signature(
    op: torch._ops.OpOverload,
    signature: CallSignature,
    store: EntryStore,
    load: Loader,
    family: ShapeFamily | None,
    seen: list[list[tuple[int, ...]]] | None,
    compiler: Compiler,
) -> Outcome:
    name = qualified_name(op)
    key = signature.key if family is None else family.entry_key(signature)
    example = signature if family is None else family.example(signature)
    if key is None or example is None:
        return NotCompiled("no dynamic-shape kernel for calls like this one")
    reference_args = clone_args(signature.args)
    try:
        expected = call_op(op, reference_args)
    except Exception as e:  # noqa: BLE001 - eager raises it again for the caller
        return NotCompiled(f"eager raised {type(e).__name__}", eager_raised=True)
    if not settings.keep_faster.get():
        # A verdict on speed, which the runtime passed over, makes way for the kernel.
        store.remove(name, key)
    start = time.perf_counter()
    try:
        artifact, family = _compile(compiler, example, signature, expected, store, family)
    except (CompileError, NotDynamic) as e:
        log.debug("aoti_eager: compiling %s failed", name, exc_info=e.__cause__)
        said = getattr(e, "compiler_error", None)
        if getattr(e, "any_values", False):
            publish_verdict(store, name, signature, signature.values_key, str(e))
            return _publish_eager(store, name, signature, str(e), any_values=True)
        if family is not None or said is not None:
            return NotCompiled(f"{e} (not recorded in the cache: a later process tries again)", compiler_error=said)
        return _publish_eager(store, name, signature, str(e))
    try:
        try:
            loading = time.perf_counter()
            kernel = load(artifact.library, artifact.output_counts)
            artifact.seconds["load"] = time.perf_counter() - loading
            compiler.check(kernel, signature, op, reference_args, expected)
            if signature.runtime_arguments:
                # It must follow its runtime numbers, not hold the values it was traced with.
                _check_other_numbers(compiler.check, kernel, op, signature)
            if family is not None:
                checked, family = _check_other_shapes(compiler.check, kernel, op, signature, family, seen or [])
                if not checked:
                    return NotCompiled("dynamic kernel: eager takes none of its further shapes, so it cannot be checked")
        except Exception as e:  # noqa: BLE001
            # One line: a C++ error holds the generated call and a frame dump.
            said = (str(e).strip().splitlines() or [""])[0][:300]
            failed = f"compiled kernel disagrees with eager: {said}" if isinstance(e, Mismatch) else f"compiled kernel failed to run: {type(e).__name__}: {said}"
            if family is not None:
                return NotCompiled(f"dynamic kernel: {failed}")
            return _publish_eager(store, name, signature, failed)
        seconds = time.perf_counter() - start
        timing = time_kernel(kernel, signature, op, compiler.timer)
        if _eager_kernels_kept(timing, artifact, signature.device):
            # On two measurements, as eager wins over a kernel (speed.measured).
            again = time_kernel(kernel, signature, op, compiler.timer)
            timing = max(timing, again or timing, key=lambda t: t.ratio)
        entry = _entry(name, signature, artifact, seconds, timing, family)
        store.publish(key, entry, sidecar_files(artifact) if entry.library else None)
    finally:
        artifact.workdir.cleanup()
    return Published(seconds, artifact.seconds, key, family)


def _compile(
    compiler: Compiler, example: CallSignature, signature: CallSignature, expected: Any, store: EntryStore,
    family: ShapeFamily | None,
) -> tuple[Artifact, ShapeFamily | None]:
    """The library of ``signature``'s kernel, exported from ``example``, and
    ``family`` with the guards it was compiled with. Raises CompileError or
    NotDynamic."""
    artifact = compiler.compile(
        example, expected, {**compile_options(signature.device.type), **matmul.inductor_options(signature)},
        shared_dir=store.shared_directory(),
        vec_isas=vec_isas_for(signature.device.type), dynamic_shapes=family.export_shapes(example) if family else None,
    )
    if family is None:
        return artifact, None
    try:
        guarded = family.with_guards(example, artifact.input_shapes, artifact.input_strides, artifact.range_constraints)
        if guarded.symbol_values(signature) is None:
            raise NotDynamic("its guards do not admit the call it was compiled for")
    except NotDynamic:
        artifact.workdir.cleanup()
        raise
    return artifact, guarded


def _check_other_numbers(check: Callable[..., None], kernel: Any, op: torch._ops.OpOverload, signature: CallSignature) -> None:
    """Checks a kernel with runtime numbers against eager at other values of
    them (raises Mismatch): the first that eager takes. Eager may refuse one
    (``topk``'s k one past the size); where it takes none, the kernel's own
    checks refuse such values at run time, and the call runs eagerly."""
    for other in (signature.with_other_numbers(), signature.with_other_numbers(lower=True)):
        if _check_at(check, kernel, op, other):
            return


def _check_other_shapes(
    check: Callable[..., None], kernel: Any, op: torch._ops.OpOverload, signature: CallSignature, family: ShapeFamily,
    seen: list[list[tuple[int, ...]]],
) -> tuple[int, ShapeFamily]:
    """Checks a dynamic kernel against eager at its further shapes (raises
    Mismatch): the number of shapes eager took, and the family with each
    symbol admitted from 1 where a call with it at 1 agreed with eager, else
    from 2 (export traced 0 and 1 size-obliviously; see kernels/compile.py)."""
    checked = sum(_check_at(check, kernel, op, other) for other in _other_shapes(signature, family, seen))
    own = family.symbol_values(signature) or {}
    lows = []
    for symbol, (low, high) in enumerate(family.ranges):
        at_one = family.resized(signature, {**own, symbol: 1}) if low <= 1 <= high else None
        try:
            agrees = at_one is not None and (own.get(symbol) == 1 or _check_at(check, kernel, op, at_one))
        except Mismatch as e:
            log.debug("aoti_eager: %s's dynamic kernel is not used at size 1 of s%d: %s", qualified_name(op), symbol, e)
            agrees = False
        lows.append(1 if agrees else 2)
    return checked, family.from_size(lows)


def _check_at(check: Callable[..., None], kernel: Any, op: torch._ops.OpOverload, call: CallSignature) -> bool:
    """Checks ``kernel`` against eager at ``call`` with ``check`` (raises Mismatch); False
    where eager rejects it. A resized call keeps the values of the tensors
    whose sizes do not move (the indices of ``embedding``), which may be out
    of range at another size: eager's error there checks nothing."""
    if not _eager_takes_on_cpu(op, call):
        return False
    reference = clone_args(call.args)
    try:
        expected = call_op(op, reference)
    except Exception:  # noqa: BLE001 - see above
        return False
    check(kernel, call, op, reference, expected)
    return True


def _eager_takes_on_cpu(op: torch._ops.OpOverload, call: CallSignature) -> bool:
    """Whether eager may run ``call`` on its device. On a GPU an index out of
    range is a device-side assert, which ends the process's CUDA context
    instead of raising: a call with integer tensors (indices) is first made
    on CPU copies, where eager raises instead."""
    tensors = [a for a in pytree.tree_leaves(list(call.args)) if isinstance(a, torch.Tensor)]
    if call.device.type == "cpu" or all(t.is_floating_point() or t.is_complex() or t.dtype == torch.bool for t in tensors):
        return True
    try:
        call_op(op, pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), list(call.args)))
    except Exception:  # noqa: BLE001 - eager's own rejection of these values
        return False
    return True


def _other_shapes(signature: CallSignature, family: ShapeFamily, seen: list[list[tuple[int, ...]]]) -> Iterator[CallSignature]:
    """The further calls a dynamic kernel is checked on: the seen shapes its
    guards admit and one shape none of them had."""
    # A size of 1 is checked on its own (see _check_other_shapes).
    admitted = [v for v in map(family.symbol_values_of_sizes, seen) if v is not None and min(v.values(), default=2) >= 2]
    for values in [*admitted, family.further_values(admitted + [family.symbol_values(signature) or {}])]:
        resized = family.resized(signature, values)
        if resized is not None:
            yield resized


def _entry(
    name: str, signature: CallSignature, artifact: Artifact, seconds: float, timing: Timing | None, family: ShapeFamily | None
) -> Entry:
    entry = Entry(
        op=name,
        signature=signature.to_json(),
        compile_seconds=round(seconds, 3),
        timing=timing.to_json() if timing is not None else None,
        dynamic=family.to_json() if family is not None else None,
    )
    entry.reason = speed_verdict(timing, artifact, signature.device)
    if entry.reason is None:
        entry.output_counts, entry.library = artifact.output_counts, artifact.library
    return entry


def _eager_kernels_kept(timing: Timing | None, artifact: Artifact, device: torch.device) -> bool:
    """Whether a kernel that only calls eager's kernels, timed so, is kept:
    behind AOTInductor's runner they are never faster on CUDA, where a model
    is bound by the host; on CPU, faster only by where their outputs' memory
    comes from, so only where clearly faster (Timing.clearly_faster)."""
    return timing is not None and artifact.generated_kernels == 0 and device.type == "cpu" and timing.clearly_faster


def speed_verdict(timing: Timing | None, artifact: Artifact, device: torch.device) -> str | None:
    """Why the calls of a kernel timed so on ``device`` stay eager; None where the kernel is kept."""
    if timing is not None and artifact.generated_kernels == 0 and not _eager_kernels_kept(timing, artifact, device):
        return f"eager is faster: Inductor generated no kernel of its own, only calls of eager's ({timing.ratio:.2f}x eager's time)"
    if timing is not None and timing.eager_faster:
        return f"eager is faster: kernel {timing.ratio:.2f}x eager's time (measured at compile)"
    return None


def time_kernel(kernel: Any, signature: CallSignature, op: torch._ops.OpOverload, timer: Timer | None = None) -> Timing | None:
    """``kernel``'s time against eager's at ``signature``'s call
    (:func:`measured`, with ``timer`` or the current compiler's); None where
    timing is off or failed."""
    return timed(qualified_name(op), signature.short(), lambda: measured(kernel, signature, op, timer or current().timer))


def timed(name: str, call: str, measure: Callable[[], Timing]) -> Timing | None:
    """``measure()``, the timing of ``name``'s kernel for ``call`` against
    eager; None where timing is off or failed."""
    if not settings.keep_faster.get():
        return None
    try:
        timing = measure()
    except Exception as e:  # noqa: BLE001 - the kernel passed validation: keep it
        log.debug("aoti_eager: timing %s against eager failed; keeping the kernel", name, exc_info=e)
        return None
    log.debug("aoti_eager: %s for (%s): kernel %.1f us, eager %.1f us", name, call,
              timing.kernel_seconds * 1e6, timing.eager_seconds * 1e6)
    return timing


def _publish_eager(store: EntryStore, name: str, signature: CallSignature, reason: str, any_values: bool = False) -> NotCompiled:
    publish_verdict(store, name, signature, signature.key, reason)
    return NotCompiled(reason, recorded=True, any_values=any_values)


def publish_verdict(store: EntryStore, name: str, signature: CallSignature, key: str, reason: str) -> None:
    """Records under ``key`` that calls like ``signature`` run eagerly, and why."""
    store.publish(key, Entry(op=name, signature=signature.to_json(), reason=reason))
