"""A region's joint forward-backward graph, cut into the two modules its
training kernel compiles (kernels/region_training.py).

AOTAutograd traces the joint graph with Inductor's decompositions and cuts
it with the min-cut partitioner, as torch.compile does for training; this
takes its two halves as they are cut (the partitioner is wrapped, the
compilers do nothing) and says how they connect (:class:`Plan`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from aoti_eager.kernels.compile import CompileError

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class Plan:
    """How a region's forward and backward libraries connect."""

    outputs: int  # the result's tensors, the forward library's first outputs
    # The backward's first inputs: ("input", i) the call's input i, ("output", j) the forward library's output j.
    saved: tuple[tuple[str, int], ...]
    tangents: tuple[int, ...]  # the result's tensors whose gradients the backward takes next, in order
    grads: tuple[int, ...]  # the inputs whose gradients the backward returns, in order

    def to_json(self) -> dict[str, Any]:
        return {"outputs": self.outputs, "saved": [list(s) for s in self.saved],
                "tangents": list(self.tangents), "grads": list(self.grads)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Plan":
        """Raises KeyError, TypeError or ValueError for data that is not one."""
        saved = tuple((str(kind), int(i)) for kind, i in data["saved"])
        if any(kind not in ("input", "output") for kind, _ in saved):
            raise ValueError(f"a saved tensor of an unknown kind: {saved}")
        return cls(int(data["outputs"]), saved, tuple(map(int, data["tangents"])), tuple(map(int, data["grads"])))


@dataclass(frozen=True)
class Joint:
    """The two modules, the backward's example inputs, and their plan."""

    forward: torch.nn.Module  # the inputs -> the result's tensors, then the saved tensors it computes
    backward: torch.nn.Module  # the saved tensors, the result's gradients -> the inputs' gradients (plan.grads)
    backward_example: tuple[torch.Tensor, ...]
    plan: Plan
    random: bool  # the forward draws random numbers (dropout in training)


def autocast_state() -> tuple[str, ...]:
    """The devices autocast is on for, each with the dtype it casts to (``cuda:bfloat16``)."""
    return tuple(f"{device}:{str(torch.get_autocast_dtype(device)).removeprefix('torch.')}"
                 for device in _AUTOCAST_DEVICES if torch.is_autocast_enabled(device))


def autocast_on() -> bool:
    return any(map(torch.is_autocast_enabled, _AUTOCAST_DEVICES))


def without_autocast() -> contextlib.ExitStack:
    """Autocast off: a graph traced under it holds its casts, which running
    or tracing it again under autocast would cast again."""
    stack = contextlib.ExitStack()
    for device in _AUTOCAST_DEVICES:
        stack.enter_context(torch.autocast(device, enabled=False))
    return stack


class _Returning(torch.nn.Module):
    """``graph``'s outputs at ``kept``, as a tuple."""

    def __init__(self, graph: torch.fx.GraphModule, kept: list[int]):
        super().__init__()
        self.graph_module, self.kept = graph, kept

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = self.graph_module(*inputs)
        return tuple(outputs[i] for i in self.kept)


def partitioned(module: torch.nn.Module, inputs: list[torch.Tensor], grads: tuple[int, ...]) -> Joint:
    """The forward and backward of ``module`` (a RegionModule: flat tensors
    in, a tuple of tensors out) at ``inputs``, of which those at ``grads``
    require grad. Raises CompileError for a forward whose graph AOTAutograd
    gives more than its result (a write into an input, a parameter or a
    buffer), or a backward that needs numbers the forward computes."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.compilers import nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    cut: dict[str, Any] = {}

    def partition(joint: torch.fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        cut["random"] = [n.target for n in joint.graph.nodes if _draws(n)]
        cut["forward"], cut["backward"] = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        cut["outputs"] = kwargs["num_fwd_outputs"]
        return cut["forward"], cut["backward"]

    traced = aot_function(module, fw_compiler=nop, bw_compiler=nop, partition_fn=partition,
                          decompositions=select_decomp_table())
    result = list(traced(*inputs))
    forward, backward, outputs = cut["forward"], cut["backward"], cut["outputs"]
    if outputs != len(result):
        raise CompileError("under autograd, its forward writes into its inputs, parameters or buffers (BatchNorm's "
                           "running statistics in training): compiled only without grad")
    primals = {node: i for i, node in enumerate(n for n in forward.graph.nodes if n.op == "placeholder")}
    saved = forward.graph.output_node().args[0][outputs:]
    if not all(isinstance(node.meta.get("val"), torch.Tensor) for node in saved):
        raise CompileError("under autograd, its backward needs numbers its forward computes (sizes), which no kernel returns")
    kept = [*range(outputs), *(outputs + k for k, node in enumerate(saved) if node not in primals)]
    plan = Plan(
        outputs,
        tuple(("input", primals[node]) if node in primals else ("output", kept.index(outputs + k)) for k, node in enumerate(saved)),
        tuple(i for i, t in enumerate(result) if t.requires_grad),
        tuple(i for i, grad in enumerate(backward.graph.output_node().args[0]) if grad is not None),
    )
    tangents = [n for n in backward.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    if len(tangents) != len(plan.tangents) or not set(plan.grads) <= set(grads):
        raise CompileError(f"AOTAutograd's backward takes {len(tangents)} gradients of its result, which has "
                           f"{len(plan.tangents)} tensors that require grad")
    with torch.no_grad(), without_autocast():
        # The graph holds the casts autocast made while tracing it.
        produced = forward(*inputs)
        example = [inputs[i].detach() if kind == "input" else produced[kept[i]] for kind, i in plan.saved]
        example += [torch.randn_like(result[i]) for i in plan.tangents]
    return Joint(_Returning(forward, kept), _Returning(backward, list(plan.grads)), tuple(example), plan, bool(cut["random"]))


def _draws(node: torch.fx.Node) -> bool:
    """Whether ``node`` draws from a random generator (dropout, rand_like;
    not an attention at dropout 0, which its op's tag does not tell apart)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for i, argument in enumerate(target._schema.arguments):
        if argument.name in ("dropout_p", "p"):
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name, argument.default_value)
            return value != 0
    return True
