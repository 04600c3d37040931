"""One compile, from a miss to a published cache entry, for any :class:`~aoti_eager.kernels.target.Target`.

Eager runs first, on copies of the call: its result is what the kernel must
match, and its error is the caller's. Then ``torch.export`` and AOTInductor
(kernels/compile.py), the new kernel on fresh copies against eager's result
(kernels/validate.py), its time against eager's (kernels/speed.py), and the
entry published in the store: the kernel, or eager where eager was measured
faster or the kernel failed. Nobody loads a library this did not check. An
op's call (kernels/op_target.py) and a region's (kernels/region.py) take the
same steps; what differs between them is the target's.

The runtime holds the key's lock around :func:`compile_target` and turns its
outcome into the call's decision; what it needs of ``_C`` (loading a library
as a kernel) it passes in. What makes, checks and times a kernel is a
:class:`Compiler`, which a test gives with :func:`scope`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import torch

from aoti_eager import settings
from aoti_eager.cache.entry_store import Entry, EntryStore
from aoti_eager.kernels import quiet
from aoti_eager.kernels.dynamic import NotDynamic, ShapeFamily
from aoti_eager.kernels.compile import Artifact, CompileError, compile_call, compile_module, sidecar_files
from aoti_eager.kernels.seam import Seam
from aoti_eager.kernels.op_target import OpTarget
from aoti_eager.kernels.signature import CallSignature, qualified_name
from aoti_eager.kernels.speed import Timer, Timing, measured, time_against_eager, time_region_against_eager
from aoti_eager.kernels.target import EagerRaised, Target, Unfit
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
    """What :func:`compile_target` makes, checks and times a kernel with:
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
    """:func:`compile_target` of ``op``'s call ``signature``; ``timer``, where
    given, times it instead of the compiler's."""
    chosen = compiler or current()
    if timer is not None:
        chosen = dataclasses.replace(chosen, timer=timer)
    return compile_target(OpTarget(op, signature), store, load, family, seen, chosen)


def compile_target(
    target: Target,
    store: EntryStore,
    load: Loader,
    family: ShapeFamily | None = None,
    seen: list[list[tuple[int, ...]]] | None = None,
    compiler: Compiler | None = None,
    in_background: bool = False,
) -> Outcome:
    """Compiles, validates, times and publishes the kernel of ``target``.
    Another process's entry may have been published first: the store keeps
    the first, and the caller reads what it holds.

    With ``family``, a dynamic kernel whose ``family.dims`` are symbols: it is
    also checked against eager at the ``seen`` sizes (each tensor's) its
    guards admit and at one further size, and published under its family's
    key. A dynamic kernel that fails is not recorded: the caller compiles the
    call's shape alone instead. ``compiler`` makes, checks and times the
    kernel (default: :func:`current`).

    What it all prints is logged at DEBUG level, not shown (kernels/quiet.py);
    ``in_background``: only what this thread prints."""
    output: list[str] = []
    try:
        with quiet.captured(output, this_thread_only=in_background), target.compiling():
            return _compile_target(target, store, load, family, seen or [], compiler or current())
    finally:
        if output:
            log.debug("aoti_eager: what compiling %s for (%s) printed:\n%s", target.name, target.short(), "\n".join(output))


def _compile_target(
    target: Target, store: EntryStore, load: Loader, family: ShapeFamily | None, seen: list[list[tuple[int, ...]]],
    compiler: Compiler,
) -> Outcome:
    key = target.key(family)
    if key is None:
        return NotCompiled("no dynamic-shape kernel for calls like this one")
    try:
        reference = target.reference()
    except EagerRaised as e:
        return NotCompiled(str(e), eager_raised=True)
    except Unfit as e:
        return _not_compiled(store, target, family, str(e), recorded=e.lasting)
    if not settings.keep_faster.get():
        # A verdict on speed, which the runtime passed over, makes way for the kernel.
        store.remove(target.name, key)
    start = time.perf_counter()
    try:
        artifact = target.export(compiler, reference, family, store.shared_directory())
    except CompileError as e:
        log.debug("aoti_eager: compiling %s failed", target.name, exc_info=e.__cause__)
        if e.any_values and (values_key := target.values_key()) is not None:
            publish_verdict(store, target.name, target, values_key, str(e))
            return _not_compiled(store, target, None, str(e), any_values=True)
        return _not_compiled(store, target, family, str(e), compiler_error=e.compiler_error)
    try:
        try:
            if family is not None:
                family = target.guarded(family, artifact)
            loading = time.perf_counter()
            kernel = load(artifact.library, artifact.output_counts)
            artifact.seconds["load"] = time.perf_counter() - loading
            target.check(compiler, kernel, reference)
            any(_check_at(compiler, kernel, other) for other in target.further())  # the first eager takes
            if family is not None:
                family = _check_other_sizes(compiler, kernel, target, family, seen)
        except Exception as e:  # noqa: BLE001
            # One line: a C++ error holds the generated call and a frame dump.
            said = (str(e).strip().splitlines() or [""])[0][:300]
            if isinstance(e, NotDynamic):
                failed = said
            elif isinstance(e, Mismatch):
                failed = f"compiled kernel disagrees with eager: {said}"
            else:
                failed = f"compiled kernel failed to run: {type(e).__name__}: {said}"
            return _not_compiled(store, target, family, failed, recorded=target.keyed_whole or not isinstance(e, Mismatch))
        seconds = time.perf_counter() - start
        timing = _timing(compiler, kernel, target, artifact, family is not None)
        entry = _entry(target, artifact, seconds, timing, family, target.result_structure(reference))
        store.publish(key, entry, sidecar_files(artifact) if entry.library else None)
    finally:
        artifact.workdir.cleanup()
    return Published(seconds, artifact.seconds, key, family)


def _not_compiled(
    store: EntryStore, target: Target, family: ShapeFamily | None, reason: str, recorded: bool = True,
    compiler_error: str | None = None, any_values: bool = False,
) -> NotCompiled:
    """No kernel, for ``reason``: recorded as the call's verdict where it
    holds for good (not for a dynamic kernel, whose shapes then compile alone;
    not where the machine's compiler failed)."""
    if family is not None:
        return NotCompiled(f"no dynamic kernel: {reason}", compiler_error=compiler_error)
    if compiler_error is not None:
        return NotCompiled(f"{reason} (not recorded in the cache: a later process tries again)", compiler_error=compiler_error)
    if not recorded:
        return NotCompiled(reason)
    publish_verdict(store, target.name, target, target.key(None), reason)
    return NotCompiled(reason, recorded=True, any_values=any_values)


def _check_other_sizes(
    compiler: Compiler, kernel: Any, target: Target, family: ShapeFamily, seen: list[list[tuple[int, ...]]],
) -> ShapeFamily:
    """Checks a dynamic kernel against eager at the ``seen`` sizes its guards
    admit (of 2 and up) and at one size none had (raises Mismatch, or
    NotDynamic where eager took none of them): the family with each symbol
    admitted from 1 where a call with it at 1 agreed with eager, else from 2
    (export traced 0 and 1 size-obliviously; see kernels/compile.py)."""
    own = target.symbol_values(family) or {}
    admitted = [v for v in map(family.symbol_values_of_sizes, seen) if v is not None and v != own and min(v.values(), default=2) >= 2]
    others = [target.resized(family, values) for values in [*admitted, family.further_values([*admitted, own])]]
    if not sum(_check_at(compiler, kernel, other) for other in others):
        raise NotDynamic("eager takes none of its further sizes, so it cannot be checked")
    lows, tied = [], _tied([own, *admitted])
    for symbol, (low, high) in enumerate(family.ranges):
        try:
            at_one = low <= 1 <= high and (own.get(symbol) == 1 or _check_at(
                compiler, kernel, target.resized(family, {**own, **{s: 1 for s in tied.get(symbol, [symbol])}})))
        except Exception as e:  # noqa: BLE001 - disagrees or fails to run there: admitted from 2
            log.debug("aoti_eager: %s's dynamic kernel is not used at size 1 of s%d: %s", target.name, symbol, e)
            at_one = False
        lows.append(1 if at_one else 2)
    return family.from_size(lows)


def _tied(calls: list[dict[int, int]]) -> dict[int, list[int]]:
    """Each symbol's fellows: the symbols of its size in every one of
    ``calls`` (a KV cache's keys and values), which a check resizes together
    (eager's flash attention reads past keys shorter than their values)."""
    symbols = set().union(*calls)
    return {s: [t for t in symbols if all(c.get(t) == c.get(s) for c in calls)] for s in symbols}


def _check_at(compiler: Compiler, kernel: Any, target: Target | None) -> bool:
    """Checks ``kernel`` against eager at ``target`` (raises Mismatch); False
    where there is none or eager rejects it. A resized call keeps the values
    of the tensors whose sizes do not move (the indices of ``embedding``),
    which may be out of range at another size: eager's error there checks nothing."""
    if target is None:
        return False
    try:
        reference = target.reference()
    except Exception:  # noqa: BLE001 - see above
        return False
    target.check(compiler, kernel, reference)
    return True


def _timing(compiler: Compiler, kernel: Any, target: Target, artifact: Artifact, dynamic: bool) -> Timing | None:
    """The kernel's time against eager's; taken again where it only calls
    eager's kernels and beats them, as eager wins over a kernel (speed.measured).
    A twin's is the entry's whose library it copied: the same program, timed there."""
    def measure() -> Timing | None:
        if artifact.timing:
            return timed(target.name, target.short(), lambda: Timing.of_json(artifact.timing))
        return timed(target.name, target.short(), lambda: target.measure(compiler, kernel, dynamic))

    timing = measure()
    if _eager_kernels_kept(timing, artifact, target.device):
        timing = max(timing, measure() or timing, key=lambda t: t.ratio)
    return timing


def _entry(
    target: Target, artifact: Artifact, seconds: float, timing: Timing | None, family: ShapeFamily | None,
    result_structure: dict[str, Any] | None,
) -> Entry:
    entry = Entry(
        op=target.name,
        signature=target.to_json(),
        compile_seconds=round(seconds, 3),
        timing=timing.to_json() if timing is not None else None,
        dynamic=family.to_json() if family is not None else None,
    )
    entry.reason = speed_verdict(timing, artifact, target.device)
    if entry.reason is None:
        entry.output_counts, entry.library = artifact.output_counts, artifact.library
        entry.result_structure = result_structure
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


def timed(name: str, call: str, measure: Callable[[], Timing | None]) -> Timing | None:
    """``measure()``, the timing of ``name``'s kernel for ``call`` against
    eager; None where timing is off, failed or was not taken."""
    if not settings.keep_faster.get():
        return None
    try:
        timing = measure()
    except Exception as e:  # noqa: BLE001 - the kernel passed validation: keep it
        log.debug("aoti_eager: timing %s against eager failed; keeping the kernel", name, exc_info=e)
        return None
    if timing is None:
        return None
    log.debug("aoti_eager: %s for (%s): kernel %.1f us, eager %.1f us", name, call,
              timing.kernel_seconds * 1e6, timing.eager_seconds * 1e6)
    return timing


def publish_verdict(store: EntryStore, name: str, call: Any, key: str, reason: str) -> None:
    """Records under ``key`` that calls like ``call`` (a :class:`Target` or a
    :class:`CallSignature`) of ``name`` run eagerly, and why."""
    store.publish(key, Entry(op=name, signature=call.to_json(), reason=reason))
