"""A region's call as a compile :class:`~aoti_eager.kernels.target.Target`.

The module exported is :class:`~aoti_eager.kernels.region.RegionModule`,
whose forward calls the instance with its state as inputs; it is checked
against the instance's original forward on the same inputs, each tensor of
its result and each input it writes into, and timed against it. The key
holds the state's structure, not its values: a kernel that disagrees with
eager is refused for the instance's key in this process, never recorded
(another block of the structure, with other weights, may agree).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from aoti_eager.kernels import region_caches, region_shapes, region_values
from aoti_eager.cache.store import LIBRARY_FILE
from aoti_eager.kernels.compile import Artifact, CompileError, compile_options
from aoti_eager.kernels.dynamic import ShapeFamily
from aoti_eager.kernels.region import (
    NotARegion, Outputs, ReadsMore, RegionCall, RegionModule, original_forward, writable, written,
)
from aoti_eager.kernels.signature import clone_args
from aoti_eager.kernels.speed import Timing, measured
from aoti_eager.kernels.target import EagerRaised, Unfit
from aoti_eager.kernels.toolchain import vec_isas_for
from aoti_eager.kernels.validate import check_fresh_memory, upcast_run


@dataclass(frozen=True)
class RegionReference:
    """The original forward's result on copies of the call, its structure,
    and the copies of the call's tensors as the forward left them."""

    expected: Any
    outputs: Outputs
    passed: list[torch.Tensor]


class RegionTarget:
    """One call of a fused ``instance`` (its :class:`RegionCall`). After
    :meth:`reference`, :attr:`outputs` is the structure of its result, which
    the calls its kernel serves rebuild."""

    keyed_whole = False

    def __init__(self, instance: torch.nn.Module, call: RegionCall, twin: Callable[[str, Path], dict | None] | None = None):
        self.instance, self.call, self.twin = instance, call, twin
        self.outputs: Outputs | None = None
        # After export, where asked about twins: the digest of each library's program, by its file in the entry.
        self.graphs: dict[str, str] = {}

    @property
    def name(self) -> str:
        return self.call.name

    @property
    def device(self) -> torch.device:
        return self.call.device

    def short(self) -> str:
        return self.call.short()

    def to_json(self) -> list[dict[str, Any]]:
        return self.call.to_json()

    def key(self, family: ShapeFamily | None) -> str:
        return self.call.key if family is None else region_shapes.entry_key(self.call, family)

    def family_key(self) -> str:
        return region_shapes.family_key(self.call)

    def admitted_by(self, family: ShapeFamily, key: str) -> bool:
        return region_shapes.admits(family, key, self.call)

    def values_key(self) -> None:
        return None

    def compiling(self) -> contextlib.ExitStack:
        # Eager's reference and the checks draw random numbers (dropout in training): the caller's stream stays as it was.
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad())
        stack.enter_context(torch.random.fork_rng(devices))
        return stack

    def reference(self) -> RegionReference:
        """Eager's result, recording what the forward reads: raises ReadsMore
        (nothing published) where it read attributes the call's key does not
        hold, for the caller to key its next call with them."""
        instance, call = self.instance, self.call
        try:
            (expected, writes, copies), reads = region_values.recorded(instance, self._on_copies)
        except region_values.UnkeyedValue as e:
            raise Unfit(str(e), lasting=False) from None
        except region_caches.Refused as e:
            raise Unfit(str(e)) from None
        except Exception as e:  # noqa: BLE001 - the original forward raises it again for the caller
            raise EagerRaised(f"eager raised {type(e).__name__}") from e
        if not reads <= call.reads:
            raise ReadsMore(reads, reads - call.reads)
        passed = copies[len(call.tensors):]
        try:
            outputs = Outputs.of(expected, passed, writes)
            aliased(outputs.tensors(expected), copies)
        except NotARegion as e:
            raise Unfit(str(e)) from None
        self.outputs = outputs
        return RegionReference(expected, outputs, passed)

    def export(self, compiler: Any, reference: RegionReference, family: ShapeFamily | None, shared_dir: Path) -> Artifact:
        call, device = self.call, self.device.type
        try:
            artifact = compiler.compile_module(
                RegionModule(self.instance, call, reference.outputs), tuple(clone_args(call.inputs())), device,
                compile_options(device), shared_dir=shared_dir, vec_isas=vec_isas_for(device),
                dynamic_shapes=region_shapes.export_shapes(call, family) if family else None,
                writable=writable(call, reference.outputs), **({"twin": self.twin} if self.twin else {}),
            )
        except CompileError as e:
            # Export names the inputs L['flat'][i]; the region's are its state's names and the call's paths.
            raise CompileError(region_shapes.named_inputs(str(e), call), e.compiler_error, e.any_values) from e.__cause__
        if artifact.graph is not None:
            self.graphs[LIBRARY_FILE] = artifact.graph
        return artifact

    def guarded(self, family: ShapeFamily, artifact: Artifact) -> ShapeFamily:
        return region_shapes.guarded(self.call, family, artifact)

    def check(self, compiler: Any, kernel: Any, reference: RegionReference) -> None:
        """Runs ``kernel`` on fresh copies of the call's inputs and compares
        the tensors of its result with eager's (out of their dtype's
        tolerance, against the forward on upcast copies too), and the call's
        tensors the forward wrote into as eager left them."""
        call, outputs = self.call, reference.outputs
        inputs = clone_args(call.inputs())
        fresh = kernel.run(inputs)
        check_fresh_memory(inputs, fresh)
        compiler.compare("the region's result", list(fresh), outputs.tensors(reference.expected), self._upcast_result)
        state = len(call.tensors)
        for i in outputs.writes:
            compiler.compare(f"its input tensor {i} as the forward wrote it", [inputs[state + i]], [reference.passed[i]])

    def further(self) -> Iterator["RegionTarget"]:
        return iter(())  # its numbers are compiled in

    def symbol_values(self, family: ShapeFamily) -> dict[int, int] | None:
        return family.symbol_values_of_sizes(region_shapes.call_sizes(self.call))

    def resized(self, family: ShapeFamily, values: dict[int, int]) -> "RegionTarget | None":
        call = region_shapes.resized(self.call, family, values)
        return None if call is None else RegionTarget(self.instance, call, self.twin)

    def measure(self, compiler: Any, kernel: Any, dynamic: bool) -> Timing | None:
        """The kernel timed against the instance's original forward, both on
        copies of the call's tensors."""
        if dynamic:
            # A family's calls move between sizes, which one timing does not judge (an op's dynamic
            # kernel is judged again in each range of sizes; a region's is kept as it was checked).
            return None
        call, instance = self.call, self.instance
        inputs = [*call.tensors, *clone_args(call.inputs()[len(call.tensors):])]
        args, kwargs = call.arguments(iter(inputs[len(call.tensors):]))

        def eager() -> Any:
            # A cache layer of the call's: a new cache holding it for each call, as its update grows it.
            given, named, _ = region_caches.with_layers(args, kwargs)
            with original_forward():
                return type(instance).forward(instance, *given, **named)

        return measured(kernel, inputs, eager, compiler.region_timer)

    def result_structure(self, reference: RegionReference) -> dict[str, Any] | None:
        return reference.outputs.to_json()

    def _on_copies(self) -> tuple[Any, tuple[int, ...], list[torch.Tensor]]:
        """The original forward run on copies of the call's inputs (a forward
        that writes into its state or inputs leaves the caller's alone): its
        result, the call's tensors it wrote into, and the copies as it left them."""
        copies = clone_args(self.call.inputs())
        state = len(self.call.tensors)
        expected, writes = written(copies[state:], lambda: RegionModule(self.instance, self.call)(*copies))
        return expected, writes, copies

    def _upcast_result(self) -> list[torch.Tensor] | None:
        """The result's tensors of the original forward run on upcast copies
        of the state and the call's floating tensors (:func:`upcast_run`)."""
        result = upcast_run(lambda inputs: RegionModule(self.instance, self.call)(*inputs), list(self.call.inputs()))
        return None if result is None else self.outputs.tensors(result)


def aliased(result: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """Raises NotARegion where a tensor of ``result`` (those a kernel would
    return) shares memory with one of ``inputs`` (the state, then the call's
    tensors) or with another of ``result``: a kernel returns fresh tensors,
    and a write into the result would no longer reach what eager's aliases."""
    owners = {t.untyped_storage().data_ptr(): f"its input {i}" for i, t in enumerate(inputs) if t.numel()}
    for i, t in enumerate(result):
        if not t.numel():
            continue
        storage = t.untyped_storage().data_ptr()
        if storage in owners:
            raise NotARegion(f"its result's tensor {i} shares memory with {owners[storage]} (a view of it, or a "
                             "parameter itself), which a kernel's fresh outputs would not")
        owners[storage] = f"its result's tensor {i}"
