"""Eager PyTorch with AOTInductor kernels.

Selected aten ops are overridden at the CPU and CUDA dispatch keys. The first
call with a new input signature compiles the op with ``torch.export`` and
AOTInductor into a shared library kept in a per-user cache that every process
shares; every later call, in this or any other process, goes from the
dispatcher straight to the compiled kernel in C++.

Example::

    >>> import torch, aoti_eager
    >>> aoti_eager.enable(ops=["aten::abs", "aten::add.Tensor"])
    >>> x = torch.randn(128)
    >>> y = torch.abs(x)            # first call with this signature: compile, cache, run
    >>> y = torch.abs(x)            # from now on: the compiled kernel
    >>> aoti_eager.stats()["aten::abs"]["hits"]
    1
    >>> aoti_eager.disable()        # the original kernels are back
    >>> aoti_eager.enable(ops=aoti_eager.ops_reached(model, x))   # every op a model's forward reaches
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from aoti_eager import _background, _extension, _ops, _overrides, _prewarm, _regions, settings
from aoti_eager._ops import OpSpec
from aoti_eager._options import Compile, Options
from aoti_eager.cache import default_root
from aoti_eager.kernels import signature as _signature
from aoti_eager.manifest import Recorder
from aoti_eager._prewarm import prewarm
from aoti_eager._reach import ReachedOps, ops_reached
from aoti_eager.version import __version__

__all__ = ["ReachedOps", "cache_dir", "disable", "enable", "enabled", "fuse", "ops_reached", "prewarm", "stats", "unfuse", "wait"]

log = logging.getLogger("aoti_eager")

# kernels/ is a layer below the C++ extension's loader: the one answer it needs
# of the extension is handed down. The extension is built on first use, not here.
_signature.use_wrapped_number_test(lambda t: _extension.load().is_wrapped_number(t))

_root: Path | None = None


def cache_dir() -> Path:
    """The cache directory in use: the one given to :func:`enable`, else
    ``$AOTI_EAGER_CACHE_DIR``, else the platform's per-user cache dir."""
    return _root if _root is not None else default_root()


_prewarm.default_cache_dir = cache_dir


def _default_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def _fleet_url(remote: str | None) -> str | None:
    """``remote`` checked (None: ``$AOTI_EAGER_REMOTE``, if set, read where a cache is opened)."""
    if remote is None:
        return None
    try:
        return settings.URL.parse(str(remote))
    except ValueError:
        raise ValueError(f"aoti_eager: remote={remote!r} is not {settings.URL.expected}") from None


def _options(compile: str, cache_dir: str | os.PathLike | None, remote: str | None,
             record: str | os.PathLike | None) -> Options:
    """The options of the arguments ``enable`` and ``fuse`` share, checked once.
    Raises ValueError where ``compile``, ``remote`` or a setting is not one they
    take."""
    mode = Compile.checked(compile)
    settings.check_all()
    remote = _fleet_url(remote)
    if record is None:
        record = settings.record.get()
    root = Path(cache_dir).expanduser() if cache_dir is not None else _root if _root is not None else default_root()
    return Options(mode, root, remote, Recorder(record) if record is not None else None)


def _keep_root(options: Options, cache_dir: str | os.PathLike | None) -> None:
    """A ``cache_dir`` given to :func:`enable` or :func:`fuse` is the default of later calls (:func:`cache_dir`)."""
    global _root
    if cache_dir is not None:
        _root = options.root


def enable(
    ops: Iterable[OpSpec] | OpSpec,
    *,
    devices: Iterable[str] | None = None,
    cache_dir: str | os.PathLike | None = None,
    record: str | os.PathLike | None = None,
    compile: str = "now",
    remote: str | None = None,
) -> None:
    """Overrides ``ops`` with compiled kernels at the CPU and CUDA dispatch keys.

    A call of an enabled op with an input signature this process has not seen
    looks for its kernel in the cache, else compiles it (as ``compile`` says),
    checks it against eager and keeps it; every later call with that signature
    runs the kernel from C++. Anything a kernel does not cover runs the
    original kernel. Calling :func:`enable` again adds ops.

    Args:
        ops (str | OpOverload | OpOverloadPacket | Iterable): the ops, named
            ``"aten::add.Tensor"`` or ``"add.Tensor"`` (one overload),
            ``"aten::add"`` or ``"add"`` (every overload that can be
            overridden), or given as ``torch.ops.aten.add.Tensor`` or
            ``torch.ops.aten.add``; the list :func:`ops_reached` returns.
        devices (Iterable[str] | None): ``"cpu"`` and/or ``"cuda"``. Default:
            cpu, and cuda when available.
        cache_dir (str | PathLike | None): where kernels are kept. Default:
            :func:`cache_dir`.
        record (str | PathLike | None): a manifest (JSON Lines) to append every
            (op, device, input signature) that misses the cache to, once each,
            for :func:`prewarm`. Several processes may record into one
            manifest. Default: ``$AOTI_EAGER_RECORD``, else none.
        compile (str): ``"now"``: a miss compiles before the call returns;
            ``"background"``: a miss runs the original kernel and compiles in a
            worker process, and calls use the kernel once it is in the cache
            (the process that workers fork from is started here, so enable
            ahead of building a model); ``"never"``: a miss runs the original
            kernel (to record a run without compiling; kernels already in the
            cache are used). Default: ``"now"``.
        remote (str | None): the fleet cache, a Redis server behind the local
            cache (``"redis://host:6379/0"``). Entries are published there only
            signed (``$AOTI_EAGER_SIGNING_KEY``) and used only when a key of
            ``$AOTI_EAGER_TRUSTED_KEYS`` signed them. Default:
            ``$AOTI_EAGER_REMOTE``, else none.

    Returns:
        None. :func:`stats` tells what the enabled ops' calls did.

    Raises:
        ValueError: an op does not exist, or is a view, random or data-dependent
            op that cannot be overridden safely (the message says which and
            why); or ``devices``, ``compile`` or ``remote`` is not one the
            function takes.

    Examples::

        >>> import torch, aoti_eager
        >>> aoti_eager.enable(ops=["aten::gelu", torch.ops.aten._softmax.default])
        >>> aoti_eager.enable(ops=["aten::mul"], devices=["cpu"])   # adds mul
        >>> y = torch.nn.functional.gelu(torch.randn(64, 256))      # compiles, caches, runs
        >>> aoti_eager.enable(ops=["aten::gelu"], record="misses.jsonl", compile="background")
        >>> aoti_eager.enable(ops=["aten::gelu"], remote="redis://cache-host:6379/0")
    """
    options = _options(compile, cache_dir, remote, record)
    devices = list(devices) if devices is not None else _default_devices()
    for device in devices:
        if device not in _ops.DISPATCH_KEYS:
            raise ValueError(f"aoti_eager: devices are {sorted(_ops.DISPATCH_KEYS)}, not {device!r}")
    if "cuda" in devices and not torch.cuda.is_available():
        raise ValueError("aoti_eager: devices=['cuda'] was asked for, but torch.cuda.is_available() is False")
    _install(_ops.selected(ops), devices, options)
    _keep_root(options, cache_dir)


def _install(selected: list[torch._ops.OpOverload], devices: list[str], options: Options) -> None:
    """Overrides each of ``selected`` on each of ``devices``, as ``options`` say."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*previously registered kernel")
        for op in selected:
            for device in devices:
                _overrides.install(op, device, options)
    if options.compile == Compile.BACKGROUND:
        _background.prestart(devices)


def disable(ops: Iterable[OpSpec] | OpSpec | None = None) -> None:
    """Restores the original kernels of ``ops``, or of every enabled op.

    The cache keeps the kernels: enabling the ops again finds them there.

    Args:
        ops (str | OpOverload | OpOverloadPacket | Iterable | None): the ops to
            restore, named as :func:`enable` takes them. Default (None): every
            enabled op.

    Returns:
        None.

    Examples::

        >>> aoti_eager.enable(ops=["aten::abs", "aten::gelu"])
        >>> aoti_eager.disable("aten::abs")     # gelu stays enabled
        >>> aoti_eager.disable()                # every original kernel is back
    """
    if ops is None:
        _overrides.uninstall()
        return
    if isinstance(ops, (str, torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        ops = [ops]
    for spec in ops:
        for op in _ops.resolve(spec).overloads:
            _overrides.uninstall(op)


@contextlib.contextmanager
def enabled(ops: Iterable[OpSpec] | OpSpec, **kwargs: Any) -> Iterator[None]:
    """:func:`enable` for the duration of a ``with`` block.

    Ops that were already enabled before the block stay enabled after it; the
    others are restored as :func:`disable` restores them.

    Args:
        ops (str | OpOverload | OpOverloadPacket | Iterable): the ops, as
            :func:`enable` takes them.
        **kwargs: the other arguments of :func:`enable` (``devices``,
            ``cache_dir``, ``record``, ``compile``, ``remote``).

    Returns:
        A context manager; the ``with`` block gets None.

    Examples::

        >>> x = torch.randn(128)
        >>> with aoti_eager.enabled(ops=["aten::abs"], devices=["cpu"]):
        ...     y = torch.abs(x)            # the compiled kernel
        >>> y = torch.abs(x)                # the original kernel again
    """
    before = {(o.op, o.device) for o in _overrides.installed()}
    enable(ops, **kwargs)
    try:
        yield
    finally:
        for override in _overrides.installed():
            if (override.op, override.device) not in before:
                _overrides.uninstall(override.op, override.device)


def fuse(
    model: torch.nn.Module,
    modules: Iterable[Any] | None = None,
    *,
    ops: Iterable[OpSpec] | OpSpec | None = None,
    compile: str = "now",
    cache_dir: str | os.PathLike | None = None,
    remote: str | None = None,
    record: str | os.PathLike | None = None,
) -> torch.nn.Module:
    """Compiles each chosen submodule's forward whole: one library per region
    signature, shared by every instance, with the parameters and buffers as
    its inputs (changed weights need no compile). With ``ops``, also enables
    per-op kernels for what runs outside the regions: a model's one call.

    A call of a region with inputs this process has not seen looks for its
    kernel in the cache, else compiles it (``torch.export``, AOTInductor),
    checks it against the original forward and keeps it. Calls no kernel
    serves run the original forward, with one log line per region and
    reason: a forward that does not export (data-dependent control flow,
    inputs other than tensors, numbers, strings and None), autocast without
    autograd, or a kernel that disagrees with eager. Under autograd (grad
    enabled, parameters or inputs that require it; autocast too) a call runs a
    compiled forward and a compiled backward (a buffer update there runs the
    original forward).

    Args:
        model (torch.nn.Module): the model, whose submodules become regions.
        modules (Iterable | None): the submodule instances or classes to
            fuse. Default (None): the blocks whose class repeats (two or more
            instances, those of a layer list where some are; one kernel per
            structure where their parameters differ); never a leaf of
            torch.nn (a Linear, a norm, an activation) unless named, never a
            module inside another region.
        ops (str | OpOverload | OpOverloadPacket | Iterable | None): ops to
            enable as :func:`enable` takes them, typically
            ``ops_reached(model, x)``: those outside the regions (embeddings,
            a final norm, a head) run per-op kernels, and so do those inside
            a region whose calls run its original forward. They are enabled on
            cpu, and cuda when available, with this call's ``compile``,
            ``cache_dir``, ``remote`` and ``record``, and stay enabled until
            :func:`disable`, whatever :func:`unfuse` does. Default: none.
        compile (str): ``"now"``: a region's miss compiles before its call
            returns; in a forward of ``model``, the enabled ops' misses
            compile side by side in worker processes while their calls run
            the original kernels, and the forward returns once they have
            ended (an autotuned 16-bit CUDA matmul's goes on in the
            background, cuBLAS serving its calls until its kernel is in
            use); ``"background"``: a miss runs the original forward and
            queues the compile for a thread of this process, whose kernel
            the calls use once it is published (see :func:`wait`; a
            region's call under autograd runs eagerly);
            ``"never"``: a miss runs the original forward (kernels already
            in the cache are used). Default: ``"now"``.
        cache_dir (str | PathLike | None): where kernels are kept. Default:
            :func:`cache_dir`.
        remote (str | None): the fleet cache behind the local one, as
            :func:`enable` takes it: a miss looks there before it compiles,
            and a compiled region is published there (signed). Default:
            ``$AOTI_EAGER_REMOTE``, else none.
        record (str | PathLike | None): a manifest (JSON Lines) to append
            each region call that misses the cache to, once each, for
            ``prewarm(manifest, model=...)`` in a process that holds the
            model. Default: ``$AOTI_EAGER_RECORD``, else none.

    Returns:
        torch.nn.Module: ``model``, its regions' forwards replaced.
        :func:`stats` has a row per region (``"region::<module>.<class>"``)
        and per enabled op.

    Raises:
        ValueError: ``compile`` or ``remote`` is not one it takes, or an op
            of ``ops`` cannot be enabled (as :func:`enable` says).

    Examples::

        >>> model = aoti_eager.fuse(model)           # its repeated blocks
        >>> with torch.no_grad():
        ...     y = model(x)                         # one compile per block signature
        >>> aoti_eager.stats()["region::transformers.models.gpt2.modeling_gpt2.GPT2Block"]["hits"]
        12
        >>> aoti_eager.unfuse(model)                 # the original forwards are back

        >>> model = aoti_eager.fuse(model, ops=aoti_eager.ops_reached(model, x))   # blocks and the ops around them
        >>> with torch.no_grad():
        ...     y = model(x)                         # the ops compile side by side, the blocks at their call
        ...     y = model(x)                         # every call a kernel's
        >>> aoti_eager.stats()["aten::embedding"]["queued"]      # its signatures, compiled in workers
        2
        >>> aoti_eager.unfuse(model)                 # the blocks' forwards are back; the ops stay enabled
        >>> aoti_eager.disable()                     # the ops' original kernels are back
    """
    selected = _ops.selected(ops) if ops is not None else []
    options = _options(compile, cache_dir, remote, record)
    _regions.fuse(model, modules, options)
    _install(selected, _default_devices(), options)
    _keep_root(options, cache_dir)
    if selected and options.compile == Compile.NOW:
        # The ops' misses compile in workers beside the forward's (see compile=): they start now.
        _background.prestart(_default_devices())
    return model


def unfuse(model: torch.nn.Module) -> torch.nn.Module:
    """Restores the original forward of every region :func:`fuse` made in ``model``.

    Ops that ``fuse(model, ops=...)`` enabled stay enabled, as other models
    and :func:`enable` calls may use them too: :func:`disable` restores them.

    Args:
        model (torch.nn.Module): a model :func:`fuse` was given (or a copy of one).

    Returns:
        torch.nn.Module: ``model``.

    Examples::

        >>> aoti_eager.unfuse(aoti_eager.fuse(model)) is model
        True
        >>> model = aoti_eager.unfuse(aoti_eager.fuse(model, ops=["aten::embedding"]))
        >>> aoti_eager.disable()                     # aten::embedding's original kernels are back
    """
    _regions.unfuse(model)
    return model


def wait(timeout: float | None = None) -> bool:
    """Waits for the background compiles queued so far (``compile="background"``
    of :func:`enable` and :func:`fuse`) to end; the calls after it find their
    kernels published.

    Args:
        timeout (float | None): the most seconds to wait. Default: no limit.

    Returns:
        bool: whether every one ended within ``timeout``.

    Examples::

        >>> model = aoti_eager.fuse(model, compile="background")
        >>> y = model(x)                # eager's result; the blocks compile in the background
        >>> aoti_eager.wait()
        True
        >>> y = model(x)                # the compiled blocks
    """
    return _background.wait(timeout)


def stats() -> dict[str, dict[str, Any]]:
    """What the calls of each enabled op overload did in this process, summed
    over devices.

    Returns:
        A dict from each enabled overload's name (``"aten::add.Tensor"``) to a
        dict with the keys ``calls``; ``hits`` (the compiled kernel ran);
        ``misses`` (a signature not seen before); ``compiles``;
        ``cache_loads`` (kernels found in the cache); ``fallbacks`` (calls
        that ran the original kernel) and ``fallback_reason`` (the last
        reason, or None); ``compile_seconds``; ``queued`` (compiles started in
        the background) and ``compiling`` (background compiles still running:
        the calls waiting for them run the original kernel meanwhile).
        Each region of :func:`fuse` has its row too (``"region::<module>.<class>"``):
        ``calls``, ``hits``, ``compiles``, ``cache_loads``, ``fallbacks``,
        ``fallback_reason``, ``compile_seconds``, ``queued`` and ``compiling``.

    Examples::

        >>> aoti_eager.enable(ops=["aten::abs"])
        >>> x = torch.randn(128)
        >>> y, y = torch.abs(x), torch.abs(x)
        >>> row = aoti_eager.stats()["aten::abs"]
        >>> row["calls"], row["misses"]
        (2, 1)
        >>> sorted(row)
        ['cache_loads', 'calls', 'compile_seconds', 'compiles', 'compiling', 'fallback_reason', 'fallbacks', 'hits', 'misses', 'queued']
    """
    return {**_overrides.stats(), **_regions.stats()}


atexit.register(disable)
