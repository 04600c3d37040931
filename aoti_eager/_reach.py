"""The aten overloads a callable reaches: what to enable to cover a model."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch._ops import OpOverload
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from aoti_eager import _ops, _overrides
from aoti_eager.kernels.signature import qualified_name


class ReachedOps(list):
    """The overloads :func:`ops_reached` found that :func:`aoti_eager.enable`
    accepts, in the order of their first call; a list of OpOverloads.

    Attributes:
        refused: the overloads it reached that cannot be enabled, by qualified
            name (``"aten::view"``), with the reason.
    """

    def __init__(self, ops: Iterable[OpOverload] = (), refused: dict[str, str] | None = None) -> None:
        super().__init__(ops)
        self.refused: dict[str, str] = dict(refused or {})

    @property
    def names(self) -> list[str]:
        """The qualified names of the overloads, e.g. ``"aten::addmm"``."""
        return [qualified_name(op) for op in self]

    def __repr__(self) -> str:
        return f"ReachedOps({self.names!r}, refused={self.refused!r})"


def ops_reached(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> ReachedOps:
    """Runs ``fn(*args, **kwargs)`` once, eagerly, and returns the aten
    overloads that reached a CPU or CUDA kernel, which :func:`aoti_eager.enable`
    takes as they are.

    ``fn`` runs as it would be called (autograd included), under a
    ``TorchDispatchMode``, which sees the calls that reach the device kernels,
    after autograd. Composite ops that decompose before a device kernel
    (``linear``, ``layer_norm``, ``softmax``) count as the ops they decompose
    into (``addmm``, ``native_layer_norm``, ``_softmax``), also under
    ``torch.inference_mode()``, where the mode would otherwise see them whole.
    The result is in the order of each overload's first call, without
    repeats; the overloads that ``enable()`` would refuse, or that ran only on
    other devices (``meta``), are left out and listed in its ``refused``
    attribute with the reason.

    Ops already enabled are observed too, and nothing is compiled because of
    ``fn``'s calls: a signature that is not yet decided runs the original
    kernel and is decided at its next call outside ``ops_reached`` (the calls
    count in :func:`aoti_eager.stats`). The result of ``fn`` is dropped.

    Args:
        fn (Callable): the callable to run, e.g. a model (an ``nn.Module``) or
            a ``lambda: model(x)``.
        *args: positional arguments for ``fn``.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        A :class:`ReachedOps`: a list of ``torch._ops.OpOverload`` that
        :func:`aoti_eager.enable` takes, with ``names`` (their qualified
        names) and a ``refused`` dict (qualified name -> reason).

    Examples::

        >>> import torch, aoti_eager
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16))
        >>> x = torch.randn(4, 8)
        >>> ops = aoti_eager.ops_reached(model, x)
        >>> ops.names
        ['aten::addmm', 'aten::gelu', 'aten::native_layer_norm']
        >>> ops.refused
        {'aten::t': 'it is a view or aliasing op (its output shares storage with an input)'}
        >>> aoti_eager.enable(ops=ops)    # the model's ops, compiled at their first call
        >>> y = model(x)
    """
    observer = _Observer()
    with _overrides.misses_held_back(), observer:
        fn(*args, **kwargs)
    return observer.reached()


class _Observer(TorchDispatchMode):
    """Each overload that reaches a device kernel, and its verdict there."""

    _DECOMPOSES = "decomposes"

    def __init__(self) -> None:
        super().__init__()
        self._verdicts: dict[tuple[OpOverload, str], str | None] = {}  # (op, device) -> reason, None, or _DECOMPOSES
        self._eligible: dict[OpOverload, None] = {}  # an insertion-ordered set
        self._refused: dict[str, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not isinstance(func, OpOverload):
            return func(*args, **kwargs)
        key = (func, _device_type(args, kwargs))
        if key not in self._verdicts:
            self._verdicts[key] = self._first_seen(*key)
        if self._verdicts[key] is self._DECOMPOSES:
            # Seen whole only where autograd is off (inference mode): the ops
            # it decomposes into are the ones that reach a kernel.
            with self:
                return func.decompose(*args, **kwargs)
        return func(*args, **kwargs)

    def _first_seen(self, op: OpOverload, device: str) -> str | None:
        if device in _ops.DISPATCH_KEYS and _ops.decomposes(op, (_ops.DISPATCH_KEYS[device],)):
            return self._DECOMPOSES
        reason = _refusal(op, device)
        if reason is None:
            self._eligible.setdefault(op, None)
        else:
            self._refused.setdefault(qualified_name(op), reason)
        return reason

    def reached(self) -> ReachedOps:
        eligible = list(self._eligible)
        names = {qualified_name(op) for op in eligible}
        # An op refused on one device (meta) and eligible on another is eligible.
        return ReachedOps(eligible, {name: why for name, why in self._refused.items() if name not in names})


def _device_type(args: tuple, kwargs: dict) -> str:
    """The device whose kernel a call reaches: its tensors' (CUDA before CPU,
    as the dispatcher orders them), else its ``device=``, else the default."""
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    if tensors:
        types = {t.device.type for t in tensors}
        return "cuda" if "cuda" in types else "cpu" if "cpu" in types else sorted(types)[0]
    device = kwargs.get("device")
    return torch.device(device).type if device is not None else torch.get_default_device().type


def _refusal(op: OpOverload, device: str) -> str | None:
    """Why ``enable()`` would not serve ``op``'s calls on ``device``, or None."""
    reason = _ops.refusal(op)
    if reason is None and device not in _ops.DISPATCH_KEYS:
        reason = f"it ran on the {device} device; aoti_eager overrides {' and '.join(_ops.DISPATCH_KEYS)} kernels only"
    elif reason is None and not torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), _ops.DISPATCH_KEYS[device]):
        reason = f"it has no {device} kernel to override"
    return reason
