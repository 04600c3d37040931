"""An op's call as a compile :class:`~aoti_eager.kernels.target.Target`.

The module exported is the op called on the call's tensors
(kernels/compile.py's ``compile_call``), checked against the original
kernel's result, returns and written arguments (kernels/validate.py), and
timed against it (kernels/speed.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch
import torch.utils._pytree as pytree

from aoti_eager.kernels import matmul
from aoti_eager.kernels.compile import Artifact, call_op, compile_options
from aoti_eager.kernels.dynamic import NotDynamic, ShapeFamily, family_key
from aoti_eager.kernels.signature import CallSignature, clone_args, qualified_name
from aoti_eager.kernels.speed import Timing, measured
from aoti_eager.kernels.target import EagerRaised
from aoti_eager.kernels.toolchain import vec_isas_for


@dataclass(frozen=True)
class OpReference:
    """What eager returned, and the copies it ran on as it left them (an in-place op's)."""

    args: list[Any]
    expected: Any


@dataclass
class OpTarget:
    """One call of ``op`` (its :class:`CallSignature`)."""

    op: torch._ops.OpOverload
    signature: CallSignature
    # ShapeFamily -> the call it is exported from (its dims at sizes export keeps symbolic).
    _examples: dict[ShapeFamily, CallSignature | None] = field(default_factory=dict, repr=False)

    keyed_whole = True

    @property
    def name(self) -> str:
        return qualified_name(self.op)

    @property
    def device(self) -> torch.device:
        return self.signature.device

    def short(self) -> str:
        return self.signature.short()

    def to_json(self) -> list[dict[str, Any]]:
        return self.signature.to_json()

    def key(self, family: ShapeFamily | None) -> str | None:
        if family is None:
            return self.signature.key
        return family.entry_key(self.signature) if self._example(family) is not None else None

    def family_key(self) -> str:
        return family_key(self.signature)

    def admitted_by(self, family: ShapeFamily, key: str) -> bool:
        return family.admits(self.signature, key)

    def values_key(self) -> str | None:
        return self.signature.values_key

    def compiling(self) -> ContextManager[Any]:
        return contextlib.nullcontext()

    def reference(self) -> OpReference:
        args = clone_args(self.signature.args)
        try:
            return OpReference(args, call_op(self.op, args))
        except Exception as e:  # noqa: BLE001 - eager raises it again for the caller
            raise EagerRaised(f"eager raised {type(e).__name__}") from e

    def export(self, compiler: Any, reference: OpReference, family: ShapeFamily | None, shared_dir: Path) -> Artifact:
        example = self.signature if family is None else self._example(family)
        device = self.signature.device.type
        return compiler.compile(
            example, reference.expected, {**compile_options(device), **matmul.inductor_options(self.signature)},
            shared_dir=shared_dir, vec_isas=vec_isas_for(device),
            dynamic_shapes=family.export_shapes(example) if family else None,
        )

    def guarded(self, family: ShapeFamily, artifact: Artifact) -> ShapeFamily:
        guarded = family.with_guards(self._example(family), artifact.input_shapes, artifact.input_strides,
                                     artifact.range_constraints)
        if guarded.symbol_values(self.signature) is None:
            raise NotDynamic("its guards do not admit the call it was compiled for")
        return guarded

    def check(self, compiler: Any, kernel: Any, reference: OpReference) -> None:
        compiler.check(kernel, self.signature, self.op, reference.args, reference.expected)

    def further(self) -> Iterator["OpTarget"]:
        # A kernel with runtime numbers must follow them, not hold the values it was traced with. Eager may
        # refuse one (topk's k one past the size); where it takes none, the kernel's own checks refuse such values.
        if self.signature.runtime_arguments:
            for other in (self.signature.with_other_numbers(), self.signature.with_other_numbers(lower=True)):
                if self._eager_takes_on_cpu(other):
                    yield OpTarget(self.op, other)

    def symbol_values(self, family: ShapeFamily) -> dict[int, int] | None:
        return family.symbol_values(self.signature)

    def resized(self, family: ShapeFamily, values: dict[int, int]) -> "OpTarget | None":
        resized = family.resized(self.signature, values)
        return OpTarget(self.op, resized) if resized is not None and self._eager_takes_on_cpu(resized) else None

    def measure(self, compiler: Any, kernel: Any, dynamic: bool) -> Timing:
        return measured(kernel, self.signature, self.op, compiler.timer)

    def result_structure(self, reference: OpReference) -> None:
        return None

    def _example(self, family: ShapeFamily) -> CallSignature | None:
        if family not in self._examples:
            self._examples[family] = family.example(self.signature)
        return self._examples[family]

    def _eager_takes_on_cpu(self, call: CallSignature) -> bool:
        """Whether eager may run ``call`` on its device. On a GPU an index out
        of range is a device-side assert, which ends the process's CUDA
        context instead of raising: a call with integer tensors (indices) is
        first made on CPU copies, where eager raises instead."""
        tensors = [a for a in pytree.tree_leaves(list(call.args)) if isinstance(a, torch.Tensor)]
        if call.device.type == "cpu" or all(t.is_floating_point() or t.is_complex() or t.dtype == torch.bool for t in tensors):
            return True
        try:
            call_op(self.op, pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), list(call.args)))
        except Exception:  # noqa: BLE001 - eager's own rejection of these values
            return False
        return True
