"""A region's call under autograd: its forward and its backward, two libraries of one entry.

A fused block called with grad enabled and tensors that require grad (its
parameters in training, or its input) is a :class:`TrainingTarget`. Its
compile takes the joint forward-backward graph of
:class:`~aoti_eager.kernels.region.RegionModule` from AOTAutograd, cut in two
by the partitioner torch.compile uses (min-cut: it saves what is dear to
recompute, recomputes the rest in the backward)::

    forward(state..., call's tensors...)  -> result's tensors..., saved...
    backward(saved..., result's gradients...) -> gradients of the inputs that require them

Each half is exported and compiled by AOTInductor as a region's module is;
the backward's library lies beside the forward's in the entry
(``backward.so``, under the entry's digests and signature), and how the two
connect, a :class:`Plan`, in the entry's result structure. Saved tensors
that are the call's inputs themselves (a weight) are not returned by the
forward: the backward takes them from the inputs, saved as autograd saves
them (an in-place change before the backward is an error, as in eager).

:class:`TrainingKernel` runs the pair as one ``torch.autograd.Function``:
gradients reach parameters and inputs as eager's do (``.grad`` accumulated,
tensor hooks, ``retain_graph``). Checked against eager's result and its
gradients for random gradients of the result, then timed forward and
backward against eager's.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from aoti_eager.cache.store import LIBRARY_FILE
from aoti_eager.kernels.compile import Artifact, CompileError, compile_options
from aoti_eager.kernels.dynamic import ShapeFamily
from aoti_eager.kernels.region import RegionModule
from aoti_eager.kernels.region_joint import Joint, Plan, autocast_on, partitioned, without_autocast
from aoti_eager.kernels.region_target import RegionReference, RegionTarget
from aoti_eager.kernels.signature import clone_args, clone_exact
from aoti_eager.kernels.speed import Timing, measured
from aoti_eager.kernels.target import Unfit
from aoti_eager.kernels.toolchain import vec_isas_for
from aoti_eager.kernels.validate import Mismatch, close_in_norm, upcast_run

# The seed of the random gradients a check gives a result, and of a check's random ops.
_SEED = 0
# The backward's library and what it leaves to the dispatcher, beside the forward's in an entry.
BACKWARD_FILES = ("backward.so", "backward.json")


def requiring_grad(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    """The indices of ``tensors`` (a call's inputs) whose gradients a
    backward would want: none where grad is disabled."""
    if not torch.is_grad_enabled():
        return ()
    return tuple(i for i, t in enumerate(tensors) if t.requires_grad)


def undecidable_here() -> str | None:
    """Why a call under autograd is not decided where it is made, else None:
    inside ``torch.utils.checkpoint`` (saved tensors hooks), whose recompute
    must save what the forward saved, or inside a backward pass (a
    reentrant checkpoint's recompute), where a check cannot take gradients.
    Such a call runs the original forward unless a kernel was decided for it
    outside."""
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return "inside torch.utils.checkpoint or saved tensors hooks (a kernel is decided outside them)"
    if torch._C._current_graph_task_id() != -1:
        return "inside a backward pass (a reentrant checkpoint's recompute; a kernel is decided outside one)"
    return None


class TrainingKernel:
    """A region's forward and backward libraries as one autograd node:
    :meth:`run` takes the kernel's inputs (the state's tensors, the call's)
    as ``CompiledKernel.run`` does and returns the result's tensors, which
    carry the backward where an input requires grad."""

    def __init__(self, forward: Any, backward: Any, plan: Plan):
        self.forward, self.backward, self.plan = forward, backward, plan

    @property
    def num_outputs(self) -> int:
        return self.plan.outputs

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return list(_Region.apply(self, *inputs))


class _Region(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, kernel: TrainingKernel, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        plan = kernel.plan
        with without_autocast() if autocast_on() else contextlib.nullcontext():
            produced = kernel.forward.run(list(inputs))
        result = produced[:plan.outputs]
        ctx.kernel = kernel
        ctx.save_for_backward(*(inputs[i] if kind == "input" else produced[i] for kind, i in plan.saved))
        ctx.mark_non_differentiable(*(t for i, t in enumerate(result) if i not in plan.tangents))
        # What the backward's library was compiled for: each gradient in its result's layout.
        ctx.layouts = [(result[i].shape, result[i].stride()) for i in plan.tangents]
        return tuple(result)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan = ctx.kernel.plan
        tangents = [_laid_out(grads[i], *layout) for i, layout in zip(plan.tangents, ctx.layouts)]
        with without_autocast() if autocast_on() else contextlib.nullcontext():
            computed = iter(ctx.kernel.backward.run([*ctx.saved_tensors, *tangents]))
        inputs = ctx.needs_input_grad[1:]
        given = {i: next(computed) for i in plan.grads}
        return (None, *(given.get(i) if needed else None for i, needed in enumerate(inputs)))


def _laid_out(grad: torch.Tensor, shape: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
    """``grad`` with ``stride`` (a copy where it has others: an expanded gradient of a sum)."""
    if grad.stride() == stride or grad.numel() <= 1:
        return grad
    return torch.empty_strided(shape, stride, dtype=grad.dtype, device=grad.device).copy_(grad)


@dataclass(frozen=True)
class TrainingReference(RegionReference):
    """Eager's result and the gradients of its inputs for ``tangents``, the
    gradients of its tensors that require grad."""

    tangents: tuple[torch.Tensor, ...] = ()
    grads: tuple[torch.Tensor | None, ...] = ()


class TrainingTarget(RegionTarget):
    """A region's call with the inputs ``call.grads`` requiring grad: one
    shape per kernel (no dynamic family), compiled as a forward and a backward."""

    def __init__(self, instance: torch.nn.Module, call: Any, twin: Callable[[str, Path], dict | None] | None = None,
                 ahead: Callable[[Path, list[int]], None] | None = None):
        super().__init__(instance, call, twin)
        self.ahead = ahead  # given the forward's library while the backward compiles (its load's probe)
        self.plan: Plan | None = None  # after export
        self.drawn: _Expected | None = None  # after export, where its graph draws random numbers

    def key(self, family: ShapeFamily | None) -> str | None:
        return self.call.key if family is None else None

    def compiling(self) -> contextlib.ExitStack:
        stack = super().compiling()
        stack.enter_context(torch.enable_grad())
        return stack

    def reference(self) -> TrainingReference:
        with torch.no_grad():
            base = super().reference()
        if base.outputs.writes:
            raise Unfit("under autograd, its forward writes into its input (compiled only without grad)")
        inputs = self._leaves()
        result = list(RegionModule(self.instance, self.call, base.outputs)(*inputs))
        differentiable = [i for i, t in enumerate(result) if t.requires_grad]
        generator = torch.Generator(result[0].device if result else "cpu").manual_seed(_SEED)
        tangents = tuple(torch.empty_like(result[i]).normal_(generator=generator) for i in differentiable)
        try:
            grads = self._grads([result[i] for i in differentiable], inputs, tangents)
        except RuntimeError as e:  # autograd refuses here (inside a backward pass); the forward ran
            raise Unfit(f"eager's gradients could not be taken to check a kernel: {str(e)[:200]}", lasting=False) from e
        return TrainingReference(base.expected, base.outputs, base.passed, tangents, grads)

    def export(self, compiler: Any, reference: TrainingReference, family: ShapeFamily | None, shared_dir: Path) -> Artifact:
        device = self.device.type
        inputs = self._leaves()
        try:
            joint = partitioned(RegionModule(self.instance, self.call, reference.outputs), inputs, self.call.grads)
        except CompileError:
            raise
        except Exception as e:  # noqa: BLE001 - AOTAutograd's errors are many
            raise CompileError(f"AOTAutograd failed on its joint graph: {type(e).__name__}: {str(e)[:200]}") from e
        # Random ops call eager's (drawing from the generators eager draws from), which the check seeds.
        options = {"device_type": device, "options": {**compile_options(device), "fallback_random": True}, "shared_dir": shared_dir,
                   "vec_isas": vec_isas_for(device)}
        if self.twin is not None:
            options["twin"] = self.twin
        with without_autocast():
            forward = compiler.compile_module(joint.forward, tuple(clone_args(inputs)), **options)
            if self.ahead is not None:
                self.ahead(forward.library, forward.output_counts)
            backward = compiler.compile_module(joint.backward, tuple(joint.backward_example), **options)
        self.graphs = {name: a.graph for name, a in ((LIBRARY_FILE, forward), (BACKWARD_FILES[0], backward)) if a.graph}
        try:
            for name, suffix in zip(BACKWARD_FILES, (".so", ".json")):
                if (source := backward.library.with_suffix(suffix)).exists():
                    shutil.copyfile(source, forward.library.with_name(name))
        finally:
            backward.workdir.cleanup()
        for stage, seconds in backward.seconds.items():
            forward.seconds[f"backward {stage}"] = seconds
        if backward.timing is None:  # a pair's timing is its twin's only where both libraries are copies
            forward.timing = None
        if forward.generated_kernels is not None and backward.generated_kernels is not None:
            forward.generated_kernels += backward.generated_kernels
        self.plan = joint.plan
        if joint.random:
            self.drawn = self._drawn(joint, inputs, reference.tangents)
        return forward

    def check(self, compiler: Any, kernel: Any, reference: TrainingReference) -> None:
        """Runs ``kernel`` forward and backward on fresh copies and compares its
        result and its gradients with eager's (out of their dtype's tolerance,
        against float64's); where its graph draws random numbers, with its
        graph's run on eager's kernels, from the same seed."""
        expected = self.drawn or self._eager(reference)
        inputs = self._leaves()
        if self.drawn is not None:
            torch.manual_seed(_SEED)
        result = kernel.run(inputs)
        self._compare(compiler, "the region's result", [t.detach() for t in result], expected.result,
                      lambda: None if (wide := expected.upcast()) is None else wide[0])
        differentiable = [t for t in result if t.requires_grad]
        if len(differentiable) != len(reference.tangents):
            raise Mismatch(f"{len(differentiable)} of its result's tensors require grad, eager's {len(reference.tangents)}")
        grads = {i: g for i, g in zip(self.call.grads, self._grads(differentiable, inputs, reference.tangents)) if g is not None}
        if set(grads) != set(expected.grads):
            raise Mismatch(f"its inputs {sorted(grads)} have gradients, eager's {sorted(expected.grads)}")
        order = sorted(grads)
        self._compare(compiler, "the gradients of its inputs", [grads[i] for i in order], [expected.grads[i] for i in order],
                      lambda: None if (wide := expected.upcast()) is None else [wide[1].get(i) for i in order])

    def _compare(self, compiler: Any, what: str, actual: list[torch.Tensor], expected: list[torch.Tensor],
                 upcast: Callable[[], Any]) -> None:
        """``compiler.compare``; where the graph draws random numbers and has no
        float64 run to judge by (CUDA's attention with dropout), each tensor
        within its dtype's tolerance in norm is accepted (validate.close_in_norm)."""
        try:
            compiler.compare(what, actual, expected, upcast)
        except Mismatch:
            if self.drawn is None or upcast() is not None or not all(map(close_in_norm, actual, expected)):
                raise

    def _eager(self, reference: TrainingReference) -> "_Expected":
        """Eager's result and gradients, and the same on float64 copies."""
        def upcast() -> tuple[list[torch.Tensor], dict[int, torch.Tensor]] | None:
            result, grads = self._upcast_result(), self._upcast_grads(reference.tangents)
            return None if result is None or grads is None else (result, dict(zip(self.call.grads, grads)))

        grads = {i: g for i, g in zip(self.call.grads, reference.grads) if g is not None}
        return _Expected(reference.outputs.tensors(reference.expected), grads, functools.cache(upcast))

    def _drawn(self, joint: Joint, inputs: list[torch.Tensor], tangents: tuple[torch.Tensor, ...]) -> "_Expected":
        """The result and gradients of ``joint``'s graphs run on eager's
        kernels from the seed the check gives the kernel (a graph that draws
        random numbers: the kernel calls eager's random ops, which then draw
        the same), and the same on float64 copies."""
        def run(given: tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
            inputs, tangents = given
            plan = joint.plan
            with torch.no_grad(), without_autocast():
                torch.manual_seed(_SEED)
                produced = joint.forward(*inputs)
                saved = [inputs[i] if kind == "input" else produced[i] for kind, i in plan.saved]
                return list(produced[:plan.outputs]), dict(zip(plan.grads, joint.backward(*saved, *tangents)))

        given = ([t.detach() for t in inputs], tangents)
        result, grads = run(given)
        return _Expected(result, grads, functools.cache(lambda: upcast_run(run, given)))

    def resized(self, family: ShapeFamily, values: dict[int, int]) -> None:
        return None

    def measure(self, compiler: Any, kernel: Any, dynamic: bool) -> Timing | None:
        """A step's forward and backward timed against eager's, both on the
        call's tensors (the state's own, the inputs copied) with gradients of ones."""
        inputs = self._leaves()
        module = RegionModule(self.instance, self.call, self.outputs)

        def step(forward: Any) -> Any:
            with torch.enable_grad():
                result = [t for t in forward() if t.requires_grad]
                wanted = [t for t in inputs if t.requires_grad]
                return torch.autograd.grad(result, wanted, [torch.ones_like(t) for t in result], allow_unused=True)

        timed = _Both(lambda: step(lambda: kernel.run(inputs)), lambda: step(lambda: module(*inputs)))
        return measured(timed, inputs, timed.eager, compiler.region_timer)

    def result_structure(self, reference: TrainingReference) -> dict[str, Any] | None:
        kept = reference.outputs.to_json()
        return None if kept is None or self.plan is None else {**kept, "training": self.plan.to_json()}

    def _leaves(self) -> list[torch.Tensor]:
        """Fresh copies of the call's inputs as leaves, those of ``call.grads`` requiring grad."""
        grads = set(self.call.grads)
        return [clone_exact(t).detach().requires_grad_(i in grads) for i, t in enumerate(self.call.inputs())]

    def _grads(self, result: list[torch.Tensor], inputs: list[torch.Tensor], tangents: Any) -> tuple[Any, ...]:
        wanted = [inputs[i] for i in self.call.grads]
        if not result:
            return tuple(None for _ in wanted)
        return torch.autograd.grad(result, wanted, list(tangents), allow_unused=True)

    def _upcast_grads(self, tangents: tuple[torch.Tensor, ...]) -> list[torch.Tensor | None] | None:
        """The gradients of eager's forward run on float64 copies (:func:`upcast_run`)."""
        module = RegionModule(self.instance, self.call, self.outputs)

        def run(upcast: tuple[list[torch.Tensor], list[torch.Tensor]]) -> list[torch.Tensor | None]:
            inputs, wide = upcast
            with torch.enable_grad():
                inputs = [t.requires_grad_(i in self.call.grads) for i, t in enumerate(inputs)]
                result = [t for t in module(*inputs) if t.requires_grad]
                return list(self._grads(result, inputs, wide))

        return upcast_run(run, (list(self.call.inputs()), list(tangents)))


@dataclass(frozen=True)
class _Expected:
    """What a training kernel's result and gradients (by input) are compared
    with, and ``upcast()``: the same computed on float64 copies, or None."""

    result: list[torch.Tensor]
    grads: dict[int, torch.Tensor]
    upcast: Callable[[], tuple[list[torch.Tensor], dict[int, torch.Tensor]] | None]


@dataclass(frozen=True)
class _Both:
    """A forward and backward step as :func:`measured` times a kernel against eager."""

    kernel: Any
    eager: Any

    def run(self, inputs: list[torch.Tensor]) -> Any:
        return self.kernel()
