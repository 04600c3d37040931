"""A block's KV cache as its kernel's input and output.

transformers hands each decoder block the model's cache object
(``DynamicCache``, the default of ``generate()`` and of a causal LM's plain
forward); the block's attention appends the step's keys and values to its
layer (``cache.update(k, v, self.layer_idx)``) and attends over the whole.
No kernel takes the object, so a call that holds one is adapted:

- :func:`adapted` puts a :class:`CacheLayer` in its place: the index of
  the layer the block updates and that layer's tensors, which the call's
  key describes and the kernel takes as inputs;
- the compiled module (``region.RegionModule``) gives the block a cache
  holding those tensors alone, and returns the layer's
  tensors after the block's update beside its result
  (:func:`with_layers`); the one layer is all the stand-in holds, and it
  refuses every other use, so a block that reads more of its cache is
  refused rather than compiled against a cache unlike the real one;
- the hit path writes the kernel's new tensors into the caller's cache as
  ``update()`` would (:meth:`Adapted.written`).

Other caches (a ``StaticCache``, an encoder-decoder's, sliding-window or
offloaded layers) are refused with the reason: their calls run eagerly.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree


class Refused(Exception):
    """A cache this module does not adapt; the message says why."""


@dataclass
class CacheLayer:
    """One layer of a ``DynamicCache`` as a call's key describes it: the
    index the block updates, and the layer's keys and values (None before
    its first update)."""

    index: int
    keys: torch.Tensor | None
    values: torch.Tensor | None


pytree.register_dataclass(CacheLayer, serialized_type_name="aoti_eager.CacheLayer")


def _dynamic_cache() -> tuple[type, type] | None:
    """transformers' ``DynamicCache`` and ``DynamicLayer``, where it is imported (never imported here)."""
    module = sys.modules.get("transformers.cache_utils")
    return None if module is None else (module.DynamicCache, module.DynamicLayer)


def layer_index(module: torch.nn.Module) -> int:
    """The cache layer ``module`` updates: the ``layer_idx`` its attention
    holds, one value in its tree. Raises Refused."""
    found = {m.layer_idx for m in module.modules() if isinstance(getattr(m, "layer_idx", None), int)}
    if len(found) != 1:
        raise Refused(f"its modules hold {'no' if not found else 'several'} layer_idx values "
                      f"({sorted(found)}), so the cache layer it updates is not known")
    return found.pop()


@dataclass(frozen=True)
class Adapted:
    """A call whose cache object is replaced by its layer (:func:`adapted`)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    caches: tuple[Any, ...]  # the cache objects replaced (one)
    index: int  # the layer the block updates
    where: tuple[int | str, ...]  # their positions in args, or names in kwargs

    def plain(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call with each :class:`CacheLayer` as a tuple of its fields,
        which the C++ side keys (with :attr:`where`) and takes tensors from
        in the order pytree flattens the layer."""
        def fields(v: Any) -> Any:
            return (v.index, v.keys, v.values) if isinstance(v, CacheLayer) else v

        return tuple(fields(v) for v in self.args), {k: fields(v) for k, v in self.kwargs.items()}

    def shapeless(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call with each :class:`CacheLayer` as its index and its tensors'
        dtype, device and sizes but their length (dim -2, which ``update``
        grows): what the steps of one generation share."""
        def fields(v: Any) -> Any:
            if not isinstance(v, CacheLayer):
                return v
            return v.index, *(None if t is None else (str(t.dtype), str(t.device), *t.shape[:-2], t.shape[-1])
                              for t in (v.keys, v.values))

        return tuple(fields(v) for v in self.args), {k: fields(v) for k, v in self.kwargs.items()}

    def layer_tensors(self) -> list[torch.Tensor]:
        """The cache layers' tensors the call holds."""
        return [t for v in (*self.args, *self.kwargs.values()) if isinstance(v, CacheLayer)
                for t in (v.keys, v.values) if t is not None]

    def paired(self, result: Any) -> tuple[Any, tuple[tuple[torch.Tensor, torch.Tensor], ...]]:
        """Eager's ``result`` with the layer as its update left it: what the kernel returns."""
        layers = [cache.layers[self.index] if self.index < len(cache.layers) else None for cache in self.caches]
        return result, tuple((None, None) if layer is None else (layer.keys, layer.values) for layer in layers)

    def written(self, pair: tuple[Any, tuple[tuple[torch.Tensor, torch.Tensor], ...]]) -> Any:
        """The result of the kernel's ``pair``, its layer's tensors written into
        the caller's cache as ``DynamicCache.update`` leaves them (a layer
        the block did not update: as it was)."""
        result, layers = pair
        for cache, (keys, values) in zip(self.caches, layers):
            if keys is None:
                continue
            while len(cache.layers) <= self.index:
                cache.layers.append(cache.layer_class_to_replicate())
            layer = cache.layers[self.index]
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        return result


def holds_cache(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a transformers cache object is among ``args`` and ``kwargs``."""
    return any(_is_cache(v) for v in args) or any(_is_cache(v) for v in kwargs.values())


def _is_cache(value: Any) -> bool:
    cls = type(value)
    return cls.__name__.endswith("Cache") and cls.__module__.startswith("transformers.")


def adapted(index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Adapted:
    """The call with its cache object replaced by its layer ``index`` (a :class:`CacheLayer`). Raises Refused."""
    caches: list[Any] = []
    where: list[int | str] = []

    def adapt(position: int | str, value: Any) -> Any:
        if not _is_cache(value):
            return value
        caches.append(value)
        where.append(position)
        return _layer_of(value, index)

    args = tuple(adapt(i, v) for i, v in enumerate(args))
    kwargs = {k: adapt(k, v) for k, v in kwargs.items()}
    if len(caches) > 1:
        raise Refused("its call holds several cache objects")
    return Adapted(args, kwargs, tuple(caches), index, tuple(where))


def _layer_of(cache: Any, index: int) -> CacheLayer:
    known = _dynamic_cache()
    if known is None or type(cache) is not known[0]:
        raise Refused(f"its cache is of type {type(cache).__name__} (of transformers' caches, a DynamicCache's "
                      "layers are taken)")
    if cache.offloading:
        raise Refused("its DynamicCache offloads layers")
    if index >= len(cache.layers):
        if cache.layer_class_to_replicate is not known[1]:
            raise Refused(f"its DynamicCache adds layers of type {getattr(cache.layer_class_to_replicate, '__name__', None)}")
        return CacheLayer(index, None, None)
    layer = cache.layers[index]
    if type(layer) is not known[1]:
        raise Refused(f"its cache's layer {index} is of type {type(layer).__name__} (a DynamicLayer is taken)")
    if not layer.is_initialized:
        return CacheLayer(index, None, None)
    return CacheLayer(index, layer.keys, layer.values)


def growing_dims(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[int, ...], ...]:
    """For each tensor of a call (in the order pytree flattens it), the dims
    that every decode step grows: the length of a cache layer's keys and
    values (where it is 2 or more), which a dynamic kernel takes from the first step."""
    leaves = pytree.tree_leaves((args, kwargs), is_leaf=lambda v: isinstance(v, CacheLayer))
    dims: list[tuple[int, ...]] = []
    for leaf in leaves:
        if isinstance(leaf, CacheLayer):
            dims.extend((t.dim() - 2,) if t.shape[-2] >= 2 else () for t in (leaf.keys, leaf.values) if t is not None)
        elif isinstance(leaf, torch.Tensor):
            dims.append(())
    return tuple(dims)


def with_layers(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, ...]]:
    """``(args, kwargs)`` with each :class:`CacheLayer` replaced by a stand-in
    cache that holds it alone (for the traced or reference forward), and the stand-ins."""
    standins: list[Any] = []

    def stand_in(value: Any) -> Any:
        if not isinstance(value, CacheLayer):
            return value
        standins.append(_one_layer(value))
        return standins[-1]

    return tuple(stand_in(v) for v in args), {k: stand_in(v) for k, v in kwargs.items()}, tuple(standins)


# What a block may use of the stand-in: its update of the one layer (and what update itself reads).
_USED = frozenset({"update", "layers", "layer_class_to_replicate", "offloading", "index", "updated", "after"})


def _one_layer(layer: CacheLayer) -> Any:
    """A ``DynamicCache`` holding ``layer`` alone, whose only use is ``update`` of that layer, once."""
    cache_type, layer_type = _dynamic_cache()
    standin = _one_layer_class(cache_type)()
    standin.layers.extend(layer_type() for _ in range(layer.index + 1))
    object.__setattr__(standin, "index", layer.index)
    object.__setattr__(standin, "updated", False)
    if layer.keys is not None:
        held = standin.layers[layer.index]
        held.lazy_initialization(layer.keys, layer.values)
        held.keys, held.values = layer.keys, layer.values
    return standin


@functools.cache
def _one_layer_class(cache_type: type) -> type:
    return type("OneLayerDynamicCache", (cache_type,), {
        "__getattribute__": _guarded_attribute, "update": _update_once, "after": _after,
    })


def _guarded_attribute(self: Any, name: str) -> Any:
    # Unguarded while DynamicCache's __init__ builds it (it holds no index yet).
    if name.startswith("__") or name in _USED or "index" not in object.__getattribute__(self, "__dict__"):
        return object.__getattribute__(self, name)
    raise Refused(f"its forward uses its cache's {name!r}, beyond updating its own layer")


def _update_once(self: Any, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if layer_idx != self.index or self.updated:
        raise Refused(f"its forward updates its cache's layer {layer_idx} "
                      f"{'again' if self.updated else f'(the block holds layer_idx {self.index})'}")
    object.__setattr__(self, "updated", True)
    return type(self).__mro__[1].update(self, key_states, value_states, layer_idx, *args, **kwargs)


def _after(self: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The layer as the block's update left it."""
    layer = self.layers[self.index]
    return layer.keys, layer.values
