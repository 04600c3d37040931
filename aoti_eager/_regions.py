"""Fused regions: a model's repeated blocks, each call one compiled library.

:func:`fuse` replaces the ``forward`` of each chosen instance with
:meth:`_Instance.forward` (an instance attribute; :func:`unfuse` deletes it).
A call describes itself (kernels/region.py), finds what its key runs in this
process, else in the cache, else compiles it (as ``compile`` says), and runs
the library on the instance's state and the call's tensors. Calls no kernel
serves run the original forward, with one log line per region and reason.

The parts, each importing only those before it:

- :mod:`aoti_eager._region_state`: what the process knows of its regions,
  in one object (``regions``), and the types of its decisions;
- :mod:`aoti_eager._region_misses`: the miss policy, what a call that no
  decision serves runs (the cache, a family's dynamic kernel, a compile,
  eager), and prewarming a recorded call;
- :mod:`aoti_eager._region_calls`: the hit path, a fused instance and its calls;
- this module: choosing the instances, fusing and unfusing them, the stats.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from typing import Any, Iterable

import torch

from aoti_eager import _background
from aoti_eager._options import Compile, Options
# _fused_again too: a model pickled by an earlier version names it here (_Instance.__reduce__).
from aoti_eager._region_calls import _fused_again, _Instance  # noqa: F401
from aoti_eager._region_misses import compiling, prewarm  # noqa: F401 - prewarm: what aoti_eager._prewarm calls
from aoti_eager._region_state import _log_eager_once, regions
from aoti_eager.kernels.region import NotARegion, code_digest, region_name


def _fused(module: torch.nn.Module) -> _Instance | None:
    forward = module.__dict__.get("forward")
    owner = getattr(forward, "__self__", None)
    return owner if isinstance(owner, _Instance) else None


def _has_forward(module: torch.nn.Module) -> bool:
    return type(module).forward is not torch.nn.Module.forward


def _is_block(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a block that a region is made of by default: a
    forward of its own, of a class outside torch.nn or over two submodules or
    more. A leaf of torch.nn (a Linear, a norm, an activation, a dropout)
    gains little compiled alone, and is a region only where named."""
    if not _has_forward(module):
        return False
    return not type(module).__module__.startswith("torch.nn.") or next(itertools.islice(module.modules(), 2, None), None) is not None


def _listed(model: torch.nn.Module) -> set[type]:
    """The classes of the modules that ``model``'s layer lists (ModuleList, Sequential, ModuleDict) hold."""
    lists = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
    return {type(c) for m in model.modules() if isinstance(m, lists) for c in m.children()}


def chosen(model: torch.nn.Module, modules: Iterable[Any] | None) -> list[torch.nn.Module]:
    """The instances ``fuse`` makes regions of: those of ``modules`` (module
    instances or classes), else the blocks whose class repeats (two or more
    instances outside each other, whatever their parameters: one kernel per
    structure); never one inside another chosen one."""
    if modules is not None:
        wanted = list(modules)
        picks = lambda m: any(m is w or (isinstance(w, type) and isinstance(m, w)) for w in wanted)  # noqa: E731
    else:
        counts = collections.Counter(type(m) for m in model.modules() if m is not model and _is_block(m))
        repeated = {cls for cls, n in counts.items() if n >= 2}
        # The unit of a layer list where there is one (T5's blocks, not its encoder and decoder stacks).
        repeated = (repeated & _listed(model)) or repeated
        picks = lambda m: m is not model and type(m) in repeated and _is_block(m)  # noqa: E731
    result: list[torch.nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():  # outer modules first
        if id(m) in inside or not picks(m):
            continue
        result.append(m)
        inside.update(id(sub) for sub in m.modules())
    if modules is None:
        # A class that repeats only inside the regions (a final block like the blocks' own) is no region of its own.
        left = collections.Counter(type(m) for m in result)
        result = [m for m in result if left[type(m)] >= 2]
    return result


def fuse(model: torch.nn.Module, modules: Iterable[Any] | None, options: Options) -> list[str]:
    """Makes regions of the instances :func:`chosen` picks, compiling and
    keeping their kernels as ``options`` say; the regions' names."""
    names = []
    for module in chosen(model, modules):
        if _fused(module) is not None:
            continue
        name = region_name(module)
        instance = _Instance(weakref.ref(module), name, options, regions.stats_of(name), replaced=module.__dict__.get("forward"))
        instance.refused = _refusal(module)
        if instance.refused is not None:
            _log_eager_once(instance.name, instance.refused)
        module.forward = instance.forward
        regions.live[instance.name].add(module)
        names.append(instance.name)
    if options.compile == Compile.NOW and not _compiles_together(model):
        model.register_forward_pre_hook(_begin_together)
        model.register_forward_hook(_end_together, always_call=True)
    return names


# On the model fuse() was given, with compile="now": the op misses of its
# forward compile side by side in workers, and the forward returns once all
# have ended (_background.begin_together); a region's compiles where it is
# called, its kernel serving that call. Functions of the module, which a pickled model names.
def _begin_together(model: torch.nn.Module, args: Any) -> None:
    if not torch.compiler.is_compiling():
        _background.begin_together(model)


def _end_together(model: torch.nn.Module, args: Any, result: Any) -> None:
    if not torch.compiler.is_compiling():
        _background.end_together(model)


def _compiles_together(model: torch.nn.Module) -> bool:
    return _begin_together in model._forward_pre_hooks.values()


def _refusal(module: torch.nn.Module) -> str | None:
    """Why no call of ``module`` is compiled, or None."""
    if "forward" in module.__dict__:
        return "its forward is replaced on the instance, which its class's code does not describe"
    try:
        code_digest(module)
    except NotARegion as e:
        return str(e)
    return None


def forget() -> None:
    """Drops what this process decided of region calls and learnt of their
    families: calls of instances fused from now on decide again from the
    cache, as in a new process (an instance's own memo stays with it)."""
    regions.forget()


def unfuse(model: torch.nn.Module) -> None:
    """Restores the original forward of every fused instance in ``model``."""
    for module in model.modules():
        if (instance := _fused(module)) is not None:
            del module.__dict__["forward"]
            regions.live[instance.name].discard(module)
    for hooks in (model._forward_pre_hooks, model._forward_hooks):
        for handle in [h for h, hook in hooks.items() if hook in (_begin_together, _end_together)]:
            del hooks[handle]
            model._forward_hooks_always_called.pop(handle, None)


def stats() -> dict[str, dict[str, Any]]:
    """The :class:`~aoti_eager._stats.Stats` row of each region with fused modules alive."""
    return {name: s.row(compiling=compiling(name)) for name, s in regions.stats.items() if regions.live[name]}


def fused_instances(model: torch.nn.Module) -> dict[tuple[str, str], list[_Instance]]:
    """The fused instances of ``model`` whose calls may compile, by (region
    name, state structure): what a recorded region request is matched with
    (the values their forwards read tell them apart, :func:`prewarm`)."""
    found: dict[tuple[str, str], list[_Instance]] = {}
    for module in model.modules():
        instance = _fused(module)
        if instance is None or instance.refused is not None:
            continue
        try:
            found.setdefault((instance.name, instance.state().structure), []).append(instance)
        except NotARegion:
            continue
    return found
