"""Dynamic shapes of regions: one kernel for every batch size or sequence length.

Calls of one region that differ only in the sizes and strides of the call's
tensors (never its parameters' or buffers') are one *region family*
(:func:`family_key`). As for ops (:mod:`aoti_eager.kernels.dynamic`), the
dims that moved between two calls of a family are exported as
``torch.export.Dim.DYNAMIC``; a :class:`ShapeFamily` over the call's tensors
(in the order the call flattens) holds the guards the exported program gives
(each dynamic dim a symbol within its range, dims export found equal one
symbol, the strides derived from sizes), and its kernel serves exactly the
calls those guards admit (:func:`admits`). The kernel is published under
:func:`entry_key`, which begins with the family key, so that every process
finds it by that prefix. Where export fixes a moved dim, fails with the dims
dynamic, or the kernel disagrees with eager at another size, the family is
recorded as static under :func:`static_key` and its shapes compile alone.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import torch
import torch.utils._pytree as pytree

from aoti_eager.cache.entry_store import Entry, EntryStore
from aoti_eager.kernels import quiet
from aoti_eager.kernels.compile import Artifact, CompileError, compile_options, sidecar_files
from aoti_eager.kernels.dynamic import NotDynamic, ShapeFamily, _form
from aoti_eager.kernels.pipeline import Loader, NotCompiled, Outcome, Published, current
from aoti_eager.kernels.region import Outputs, RegionCall, RegionModule, _digest, check_region, eager_result, writable
from aoti_eager.kernels.signature import NumberArg, TensorArg, clone_args
from aoti_eager.kernels.toolchain import vec_isas_for
from aoti_eager.kernels.validate import Mismatch

log = logging.getLogger("aoti_eager")


def call_tensors(call: RegionCall) -> list[TensorArg]:
    """The call's tensors as described, in the order the call flattens (the family's tensor indices)."""
    return [d for _, d in call.described if isinstance(d, TensorArg)]


def call_sizes(call: RegionCall) -> list[tuple[int, ...]]:
    return [t.sizes for t in call_tensors(call)]


def family_key(call: RegionCall) -> str:
    """What calls of one region family share: :attr:`RegionCall.key` without
    the sizes and strides of the call's tensors (of these, the order of their
    dims in memory)."""
    return _digest([call.structure, str(torch.get_default_dtype()), str(call.spec), [[p, _form(d, None)] for p, d in call.described]])


def values_key(call: RegionCall) -> str:
    """What calls that differ only in the numbers of their arguments share:
    :attr:`RegionCall.key` with each number's type instead of its value."""
    described = [[p, type(d.value).__name__ if isinstance(d, NumberArg) else d.to_json()] for p, d in call.described]
    return _digest([call.structure, str(torch.get_default_dtype()), str(call.spec), described])


def static_key(call: RegionCall) -> str:
    """The cache key of the verdict that the family of ``call`` has no dynamic kernel."""
    return f"{family_key(call)}-static"


def entry_key(call: RegionCall, family: ShapeFamily) -> str:
    """The cache key of ``family``'s kernel for calls like ``call``: the family
    key, then a digest of the sizes and strides the kernel fixes."""
    fixed = iter(family.dims)
    return f"{family_key(call)}-{_digest([_form(d, fixed) for _, d in call.described])[:16]}"


def admits(family: ShapeFamily, key: str, call: RegionCall) -> bool:
    """Whether the kernel published under ``key``, of ``family``, was compiled for ``call``."""
    tensors = call_tensors(call)
    return (
        len(tensors) == len(family.dims) and entry_key(call, family) == key and family.layout_admitted(tensors)
        and family.symbol_values_of_sizes([t.sizes for t in tensors]) is not None
    )


def export_shapes(call: RegionCall, family: ShapeFamily) -> tuple[Any, ...]:
    """``dynamic_shapes`` for exporting :class:`RegionModule` (its state's
    tensors, never dynamic, then the call's). A dim of size 1 stays 1."""
    dims = [{d: torch.export.Dim.DYNAMIC for d in dims if t.sizes[d] > 1} or None for dims, t in zip(family.dims, call_tensors(call))]
    return (tuple([None] * len(call.tensors) + dims),)


def guarded(call: RegionCall, family: ShapeFamily, artifact: Artifact) -> ShapeFamily:
    """``family`` with the guards of ``artifact``'s exported program. Raises
    NotDynamic where export fixed a dim that moved, or its guards do not admit
    the call it was compiled from."""
    n = len(call.tensors)
    result = family.with_tensor_guards(call_tensors(call), artifact.input_shapes[n:], artifact.input_strides[n:],
                                       artifact.range_constraints)
    paths = [p for p, d in call.described if isinstance(d, TensorArg)]
    for tensor, dim, symbol, size in result.guards:
        if symbol < 0:
            raise NotDynamic(f"export fixed dim {dim} of {paths[tensor]} to {size}")
    if result.symbol_values_of_sizes(call_sizes(call)) is None:
        raise NotDynamic("its guards do not admit the call it was compiled for")
    return result


def resized(call: RegionCall, family: ShapeFamily, values: dict[int, int]) -> RegionCall | None:
    """``call`` with each symbol of ``family`` at ``values``' size: new tensors
    where a dim moves (random values; integer tensors repeat their own), the
    others copied; None where the call cannot be rebuilt."""
    sizes = {(tensor, dim): values[symbol] for tensor, dim, symbol, _ in family.guards if symbol >= 0}
    tensors = call_tensors(call)
    shapes = family.shapes_with(tensors, sizes)
    index = iter(range(len(tensors)))
    try:
        leaves = [family.resized_tensor(next(index), v, d, shapes) if isinstance(d, TensorArg) else v
                  for v, (_, d) in zip(call.leaves, call.described)]
        args, kwargs = pytree.tree_unflatten(leaves, call.spec)
        return call.with_arguments(args, kwargs)
    except Exception:  # noqa: BLE001 - a call that cannot be rebuilt is not checked
        return None


def compile_family(
    instance: torch.nn.Module, call: RegionCall, family: ShapeFamily, seen: list[list[tuple[int, ...]]],
    store: EntryStore, load: Loader,
) -> tuple[Outcome, Outputs | None]:
    """Compiles the dynamic kernel of ``family``'s dims for calls like
    ``call`` (under the caller's lock), checks it against eager at ``call``,
    at the ``seen`` sizes its guards admit and at one further size, and
    publishes it under :func:`entry_key`: the outcome (its ``family`` with the
    guards) and the structure of the result. Where it fails for good, the
    family is recorded as static (:func:`static_key`)."""
    output: list[str] = []
    # The checks' random inputs leave the caller's random numbers as they were.
    devices = [call.device.index or 0] if call.device.type == "cuda" else []
    try:
        with quiet.captured(output), torch.no_grad(), torch.random.fork_rng(devices):
            return _compile_family(instance, call, family, seen, store, load)
    finally:
        if output:
            log.debug("aoti_eager: what compiling %s's dynamic kernel for (%s) printed:\n%s", call.name, call.short(), "\n".join(output))


def _compile_family(
    instance: torch.nn.Module, call: RegionCall, family: ShapeFamily, seen: list[list[tuple[int, ...]]],
    store: EntryStore, load: Loader,
) -> tuple[Outcome, Outputs | None]:
    try:
        expected, outputs, passed = eager_result(instance, call)
    except Exception as e:  # noqa: BLE001 - of this call's values, not the family's: the static path decides for it
        return NotCompiled(f"no dynamic kernel for this call: eager gave {type(e).__name__}", eager_raised=True), None
    start = time.perf_counter()
    try:
        artifact = current().compile_module(RegionModule(instance, call, outputs), tuple(clone_args(call.inputs())),
                                            call.device.type, compile_options(call.device.type),
                                            shared_dir=store.shared_directory(), vec_isas=vec_isas_for(call.device.type),
                                            dynamic_shapes=export_shapes(call, family), writable=writable(call, outputs))
    except CompileError as e:
        log.debug("aoti_eager: compiling %s's dynamic kernel failed", call.name, exc_info=e.__cause__)
        return _static(store, call, _named_inputs(str(e), call), recorded=e.lasting), outputs
    try:
        try:
            family = guarded(call, family, artifact)
            kernel = load(artifact.library, artifact.output_counts)
            check_region(kernel, call, outputs, expected, passed)
            family = _check_other_sizes(instance, kernel, call, family, seen)
        except Exception as e:  # noqa: BLE001 - one line, not the runtime's C++ error
            said = (str(e).strip().splitlines() or [""])[0][:300]
            if isinstance(e, Mismatch):
                said = f"its kernel disagrees with eager: {said}"
            elif not isinstance(e, NotDynamic):
                said = f"its kernel failed to run: {type(e).__name__}: {said}"
            return _static(store, call, said), outputs
        seconds = time.perf_counter() - start
        key = entry_key(call, family)
        entry = Entry(op=call.name, signature=call.to_json(), compile_seconds=round(seconds, 3),
                      output_counts=artifact.output_counts, library=artifact.library, dynamic=family.to_json())
        # A new process's first call it serves is then a hit, as a static entry's is.
        entry.result_structure = outputs.to_json()
        store.publish(key, entry, sidecar_files(artifact))
    finally:
        artifact.workdir.cleanup()
    return Published(seconds, artifact.seconds, key, family), outputs


def _check_other_sizes(
    instance: torch.nn.Module, kernel: Any, call: RegionCall, family: ShapeFamily, seen: list[list[tuple[int, ...]]]
) -> ShapeFamily:
    """Checks ``kernel`` against eager at the ``seen`` sizes its guards admit
    (of 2 and up) and at one size none had (raises Mismatch, or NotDynamic
    where eager took none of them): the family admitted from 1 for each
    symbol where a call with it at 1 agreed with eager, else from 2 (export
    traced 0 and 1 size-obliviously)."""
    own = family.symbol_values_of_sizes(call_sizes(call)) or {}
    admitted = [v for v in map(family.symbol_values_of_sizes, seen) if v and v != own and min(v.values()) >= 2]
    others = [*admitted, family.further_values([*admitted, own])]
    if not sum(_check_at(instance, kernel, resized(call, family, values)) for values in others):
        raise NotDynamic("eager takes none of its further sizes, so it cannot be checked")
    lows = []
    for symbol, (low, high) in enumerate(family.ranges):
        try:
            at_one = low <= 1 <= high and (own.get(symbol) == 1 or _check_at(instance, kernel, resized(call, family, {**own, symbol: 1})))
        except Exception as e:  # noqa: BLE001 - disagrees or fails to run there: admitted from 2
            log.debug("aoti_eager: %s's dynamic kernel is not used at size 1 of s%d: %s", call.name, symbol, e)
            at_one = False
        lows.append(1 if at_one else 2)
    return family.from_size(lows)


def _check_at(instance: torch.nn.Module, kernel: Any, call: RegionCall | None) -> bool:
    """Checks ``kernel`` against eager at ``call`` (raises Mismatch); False
    where there is no such call or eager rejects it."""
    if call is None:
        return False
    try:
        expected, outputs, passed = eager_result(instance, call)
    except Exception:  # noqa: BLE001 - eager's own rejection of these sizes checks nothing
        return False
    check_region(kernel, call, outputs, expected, passed)
    return True


def _named_inputs(message: str, call: RegionCall) -> str:
    """``message`` with export's names of the exported inputs (``L['flat'][7]``) as the region's own.

        >>> call = RegionCall.of("r", ("weight",), (torch.ones(2),), "s", (torch.ones(3),), {})
        >>> _named_inputs("Constraints violated (L['flat'][1].size()[0])!", call)
        'Constraints violated (args[0].size()[0])!'
    """
    names = [*call.names, *(p for p, d in call.described if isinstance(d, TensorArg))]
    return re.sub(r"L\['flat'\]\[(\d+)\]", lambda m: names[int(m[1])] if int(m[1]) < len(names) else m[0], message)


def _static(store: EntryStore, call: RegionCall, reason: str, recorded: bool = True) -> NotCompiled:
    """The family's shapes compile alone, for ``reason``: recorded in the cache
    for every process, unless it may pass in a later one (``recorded`` False)."""
    reason = f"no dynamic kernel: {reason}"
    if recorded:
        store.publish(static_key(call), Entry(op=call.name, signature=call.to_json(), reason=reason))
    return NotCompiled(reason, recorded=recorded)
