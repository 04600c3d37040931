"""Which kernel a miss compiles: the specialization policy of one op on one device.

The runtime (aoti_eager/_runtime.py) tells the planner what it learns of
the op's calls (a signature that missed, a kernel published or failed, the
cache's keys) and asks it what to do; the planner answers with a
:class:`CompileRequest`, an :class:`Eager` verdict or the keys to look up,
and never logs, locks, loads or touches the cache.

The policy, in the order a miss meets it:

- Ints (:class:`Ints`): a call's ints are compiled in until one moves; from
  then on a kernel takes it at run time, unless such a kernel failed.
- Shapes (:class:`Family`): a shape family's first shape compiles a static
  kernel; its second, a dynamic kernel of the dims that changed (a general
  one where only strides or sizes of 1 changed); after that, a general one.
  An op that compiled for calls of the same dtypes and ranks in another
  family starts a new family with a general kernel.
- Limits: past ``max_value_variants`` compiles for new values of a call's
  numbers, further values run eagerly; past ``max_shape_compiles`` compiles
  for a family, its further shapes do; past ``max_matmul_sizes`` families of
  a template matmul's sizes (kernels/matmul.py), further sizes do.
- Speed: a dynamic kernel is judged against eager once in each range of
  sizes (:meth:`ShapeFamily.size_range`), and eager kept where it is faster.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from aoti_eager import settings
from aoti_eager._decisions import Decision, RunEagerly, UseKernel
from aoti_eager.kernels import CallSignature, CompileRequest
from aoti_eager.kernels.dynamic import (
    ShapeFamily, changed_dims, changed_sizes, family_key, family_limit_key, grew_from_one, ints_key, kinds_key, tensor_args,
)
from aoti_eager.kernels.matmul import fixed_dims, is_template_matmul
from aoti_eager.kernels.signature import Position, qualified_name


@dataclass(frozen=True)
class Eager:
    """Calls run the original kernel, and why: calls of the signature
    (``scope`` "signature"), of it at every value of its numbers ("values"),
    or of every shape of its family ("family"). ``record``: the cache key to
    record the verdict under, so that other processes do not compile to find
    out again (None: not recorded)."""

    reason: str
    scope: str = "signature"
    record: str | None = None


@dataclass
class Family:
    """What this process knows of one shape family (kernels/dynamic.py): an
    op's, or a region's (kernels/region_shapes.py), whose policy is
    :meth:`moved_dims`."""

    # Tensor sizes of the family's shapes that missed here, most recent last.
    seen: list[list[tuple[int, ...]]] = field(default_factory=list)
    # Entry key -> its dynamic kernel's family (None: not a dynamic entry of this family).
    published: dict[str, ShapeFamily | None] = field(default_factory=dict)
    # Entry key -> what the calls its kernel serves run (an op's Decision; a region's own), shared by every shape it admits.
    decisions: dict[str, Any] = field(default_factory=dict)
    # (entry key, ShapeFamily.size_range) -> why eager is faster there, or
    # None where the dynamic kernel is not slower: each range judged once.
    verdicts: dict[tuple[str, tuple[int, ...]], str | None] = field(default_factory=dict)
    compiles: int = 0  # kernels compiled here for its shapes, static and dynamic together
    dynamic_failed: str | None = None  # why a dynamic kernel of it failed (here, or recorded in the cache)
    # Keys of the calls seen: one seen again (its entry damaged, or its
    # compile retried) is not a shape that moved.
    keys: set[str] = field(default_factory=set)

    SEEN = 8

    def see(self, signature: CallSignature) -> None:
        self.saw([t.sizes for t in tensor_args(signature)], signature.key)

    def saw(self, sizes: list[tuple[int, ...]], key: str) -> None:
        """A call of ``key`` whose tensors have ``sizes`` missed."""
        self.keys.add(key)
        if sizes not in self.seen:
            self.seen = [*self.seen, sizes][-self.SEEN:]

    def dynamic(self) -> list[tuple[str, ShapeFamily]]:
        """Its dynamic kernels, narrowest first."""
        known = [(key, family) for key, family in self.published.items() if family is not None]
        return sorted(known, key=lambda item: sum(map(len, item[1].dims)))

    def over_limit(self) -> str | None:
        """Why a new shape of the family runs eagerly instead of compiling
        (``max_shape_compiles`` reached), or None: the compile is counted."""
        limit = settings.max_shape_compiles.get()
        if self.compiles >= limit:
            return (f"{self.compiles} kernels already compiled for shapes of this family "
                    f"({settings.max_shape_compiles.name}={limit}); further shapes run eagerly")
        self.compiles += 1
        return None

    def moved_dims(self, sizes: list[tuple[int, ...]]) -> ShapeFamily | None:
        """The dynamic kernel a region's miss of a call with tensors of
        ``sizes`` compiles, none of the family's kernels admitting it: the
        dims that moved, and those of its kernels (a guard that refused the
        call, dims export found equal or a size out of range, holds for a
        wider kernel too); None for a static kernel."""
        if self.dynamic_failed is not None or not settings.dynamic_shapes.get():
            return None
        known = [family.dims for _, family in self.dynamic()]
        changed = changed_sizes(sizes, self.seen)
        # A known kernel's dims too, but not at 0 or 1 here: export would fix them.
        dims = tuple(tuple(d for d in sorted(set(c).union(*(k[i] for k in known))) if sizes[i][d] >= 2) for i, c in enumerate(changed))
        if not any(changed) or any(all(set(d) <= set(k) for d, k in zip(dims, kernel)) for kernel in known):
            return None
        return ShapeFamily(dims)


@dataclass
class Ints:
    """What this process knows of the ints given to one op's calls of one
    shape family, whatever their numbers (:func:`ints_key`), by position
    (:attr:`CallSignature.int_arguments`).

    The first call compiles its ints in, unless the cache holds a kernel that
    takes them at run time (another process saw them move). Once an int
    moves, kernels take it as a runtime int: one kernel for every later
    positive value, instead of one per value (``arange``'s end, a batch
    size, the ``n`` of a pad ``[0, n]``; the 0 stays compiled in). An int
    whose kernel fails (export cannot trace an int used as a dim index, the
    kernel disagrees with eager) is compiled in from then on.
    """

    first: dict[Position, int]  # the values of the first call that missed
    runtime: frozenset[Position] = frozenset()  # taken as runtime ints
    constant: frozenset[Position] = frozenset()  # compiled in: their runtime kernel failed

    def to_take(self, signature: CallSignature) -> frozenset[Position]:
        """The ints a kernel for ``signature`` takes at run time: those that
        moved and have not failed; none where one of them cannot be an input
        in this call (a value of 0 or below, a device that reads no runtime
        numbers)."""
        values = signature.int_arguments
        moved = {i for i, value in values.items() if value != self.first.get(i, value)}
        wanted = (self.runtime | moved) - self.constant
        return frozenset(wanted) if wanted and signature.can_take_runtime_ints(wanted) else frozenset()

    def failed(self, tried: frozenset[Position]) -> None:
        """A kernel taking ``tried`` at run time failed: the ints it added to
        those already taken (all of them, if it added none) are compiled in."""
        self.constant |= (tried - self.runtime) or tried
        self.runtime -= self.constant


# Keys of the cache entries that would serve a call with these ints at run
# time: (the ints, the entry of its shape, the prefix of its family's dynamic entries).
IntLookup = tuple[frozenset[Position], str, str]


@dataclass
class Planner:
    """The specialization policy of one op overload on one device, with what
    this process learned of its calls."""

    # (device, family_key) -> what this process knows of the shape family.
    families: dict[tuple[str, str], Family] = field(default_factory=dict)
    # ints_key -> what this process knows of the family's ints.
    ints: dict[str, Ints] = field(default_factory=dict)
    # CallSignature.shape_key -> compiles attempted for it in this process.
    value_variants: dict[str, int] = field(default_factory=dict)
    # (device, kinds_key) of the calls that compiled a kernel.
    compiled_kinds: set[tuple[str, str]] = field(default_factory=set)
    # CallSignature.decision_key of signatures kept eager because eager is faster.
    eager_faster: set[tuple[str, str]] = field(default_factory=set)
    # (device, dtypes) -> the family keys of a template matmul's sizes that compiled (kernels/matmul.py).
    matmul_sizes: dict[tuple[str, tuple[str, ...]], set[str]] = field(default_factory=dict)

    # A call's first miss looks for kernels taking its ints at run time only
    # where it has this many ints at most (every subset is a cache key).
    RUNTIME_INT_LOOKUPS = 3

    def family(self, signature: CallSignature) -> Family:
        return self.families.setdefault((str(signature.device), family_key(signature)), Family())

    def runtime_ints(self, signature: CallSignature) -> tuple[frozenset[Position], list[IntLookup]]:
        """The ints a kernel for ``signature`` takes at run time, and, at the
        first call of its ints, the keys under which the cache may hold a
        kernel taking some of them (most first): the runtime then calls
        :meth:`ints_published` with those of the first one it finds."""
        key = ints_key(signature)
        if key in self.ints:
            return self.ints[key].to_take(signature), []
        self.ints[key] = Ints(signature.int_arguments)
        ints = [p for p in signature.int_arguments if signature.can_take_runtime_ints([p])]
        if len(ints) > self.RUNTIME_INT_LOOKUPS:
            return frozenset(), []
        lookups = []
        for n in range(len(ints), 0, -1):
            for taken in itertools.combinations(ints, n):
                with_ints = signature.with_runtime_ints(taken)
                lookups.append((frozenset(taken), with_ints.key, family_key(with_ints) + "-"))
        return frozenset(), lookups

    def ints_published(self, signature: CallSignature, taken: frozenset[Position]) -> frozenset[Position]:
        """Another process saw ``taken`` move: the ints a kernel for ``signature`` takes now."""
        ints = self.ints[ints_key(signature)]
        ints.runtime |= taken
        return ints.to_take(signature)

    def ints_served(self, signature: CallSignature, taken: frozenset[Position], served: bool) -> None:
        """Whether a kernel taking ``taken`` at run time serves ``signature``'s calls."""
        ints = self.ints[ints_key(signature)]
        if served:
            ints.runtime |= taken
        else:
            ints.failed(taken)

    def falls_back(self, decision: Decision, signature: CallSignature, compiles: bool) -> bool:
        """Whether ``signature``'s call, whose kernel would take runtime
        numbers, is tried next with its numbers compiled in: where no such
        kernel is used, unless nothing is compiled here (``compiles``) or
        eager was measured faster (a kernel with the numbers compiled in
        would be no faster)."""
        return (
            isinstance(decision, RunEagerly) and not decision.numbers and bool(signature.runtime_arguments)
            and compiles and signature.decision_key not in self.eager_faster
        )

    @staticmethod
    def eager(signature: CallSignature, verdict: Eager) -> RunEagerly:
        """What calls of ``signature`` run on ``verdict``: the C++ side keeps
        a family's for the whole family, and one of every value of its
        numbers for calls that differ from it only in their values."""
        if verdict.scope == "values":
            return RunEagerly(verdict.reason, numbers=tuple(signature.number_positions))
        return RunEagerly(verdict.reason, ShapeFamily.any_shape(signature) if verdict.scope == "family" else None)

    def eager_is_faster(self, signature: CallSignature, reason: str) -> RunEagerly:
        """Eager for good, where it was measured faster than the kernel: for
        every value of the signature's runtime numbers too (and no kernel with
        its numbers compiled in is tried)."""
        self.eager_faster.add(signature.decision_key)
        return RunEagerly(reason, numbers=tuple(signature.runtime_arguments))

    def use_dynamic(
        self, signature: CallSignature, key: str, dynamic: ShapeFamily, decision: Decision, judge: Callable[[Any], str | None]
    ) -> Decision:
        """``decision``, the dynamic kernel ``key``'s (of ``dynamic``), for
        ``signature``'s range of sizes: the kernel where it was not measured
        slower than eager there (``judge`` times a kernel at the call and
        says why eager is faster, or None; once per range), else eager, for
        that range only."""
        family = self.family(signature)
        family.published[key], family.decisions[key] = dynamic, decision
        if not isinstance(decision, UseKernel) or decision.dynamic is None or not settings.keep_faster.get():
            return decision
        size_range = (key, decision.dynamic.size_range([t.sizes for t in tensor_args(signature)]))
        if size_range not in family.verdicts:
            family.verdicts[size_range] = judge(decision.kernel)
        reason = family.verdicts[size_range]
        if reason is None:
            return replace(decision, per_range=True)
        self.eager_faster.add(signature.decision_key)
        return RunEagerly(reason, decision.dynamic, judged=decision.kernel)

    def request(self, signature: CallSignature) -> CompileRequest:
        """What a miss of ``signature`` compiles: its own kernel, or the
        dynamic kernel of the dims that moved in its family, with the span
        of sizes seen of each."""
        family = self.family(signature)
        dynamic = self._kernel_to_compile(signature, family)
        key = dynamic.entry_key(signature) if dynamic is not None else None
        name = qualified_name(signature.op)
        if key is None:
            return CompileRequest(name, signature.device.type, signature.key, signature.to_json())
        return CompileRequest(name, signature.device.type, key, signature.to_json(), dynamic, dynamic.size_span(signature, family.seen))

    @staticmethod
    def waited_for(signature: CallSignature) -> bool:
        """Whether a forward whose misses compile side by side returns only
        once the compile of ``signature`` has ended: all but an autotuned
        matmul's (kernels/matmul.py), which takes tens of seconds while
        eager's cuBLAS serves its calls."""
        return not is_template_matmul(signature)

    def to_compile(self, signature: CallSignature) -> CompileRequest | Eager:
        """The request a compile of ``signature`` makes now, counted against
        the limits; or eager, past one of them."""
        limited = self.count_variant(signature) or self.count_matmul_sizes(signature)
        if limited is not None:
            return limited
        reason = self.family(signature).over_limit()
        if reason is not None:
            return Eager(reason, "family", record=family_limit_key(signature))
        return self.request(signature)

    def count_variant(self, signature: CallSignature) -> Eager | None:
        """Counts a compile of ``signature``; eager past the limit, for every
        further value, in this process and (recorded in the cache) in others."""
        variants = self.value_variants.get(signature.shape_key, 0)
        # Like dynamo's cache size limit: further values run eagerly instead of compiling forever.
        limit = settings.max_value_variants.get()
        if variants >= limit:
            reason = (
                f"{variants} kernels already compiled for new values of its numeric arguments "
                f"({settings.max_value_variants.name}={limit}); further values run eagerly"
            )
            return Eager(reason, "values", record=signature.values_key)
        self.value_variants[signature.shape_key] = variants + 1
        return None

    def count_matmul_sizes(self, signature: CallSignature) -> Eager | None:
        """Counts a template matmul's new reduction and column sizes, each a
        family of its own (kernels/matmul.py), so that a length that moves
        them (a weight gradient's tokens) does not compile forever; eager,
        for every shape of a further family, past the limit."""
        if not fixed_dims(signature):
            return None
        seen = self.matmul_sizes.setdefault((str(signature.device), tuple(t.dtype for t in tensor_args(signature))), set())
        key, limit = family_key(signature), settings.max_matmul_sizes.get()
        if key not in seen and len(seen) >= limit:
            reason = (
                f"{len(seen)} reduction and column sizes already compiled "
                f"({settings.max_matmul_sizes.name}={limit}); further sizes run eagerly"
            )
            return Eager(reason, "family", record=family_limit_key(signature))
        seen.add(key)
        return None

    def compiled(self, signature: CallSignature, dynamic_failed: str | None, kernel: bool) -> None:
        """A compile for ``signature`` ended, with a ``kernel`` or not;
        ``dynamic_failed``: why its dynamic kernel failed, if it did."""
        family = self.family(signature)
        if dynamic_failed is not None:
            family.dynamic_failed = dynamic_failed
        family.see(signature)
        if kernel:
            self.compiled_kinds.add((str(signature.device), kinds_key(signature)))

    @staticmethod
    def verdict_keys(signature: CallSignature, of_family: bool = True) -> list[tuple[str, str]]:
        """The cache keys under which a process records that calls like
        ``signature`` run eagerly, with each verdict's scope: every value of its
        numbers, and (with ``of_family``) every shape of its family."""
        return [(signature.values_key, "values")] + [(family_limit_key(signature), "family")] * of_family

    def judged_at_compile(self, signature: CallSignature, key: str, dynamic: ShapeFamily, sizes: list[tuple[int, ...]]) -> None:
        """The dynamic kernel ``key`` was timed against eager at ``sizes`` when it was published: not slower there."""
        self.family(signature).verdicts.setdefault((key, dynamic.size_range(sizes)), None)

    def _kernel_to_compile(self, signature: CallSignature, family: Family) -> ShapeFamily | None:
        """The dynamic kernel to compile for ``signature``, which none of its
        family's kernels admits; None for a static kernel."""
        if not settings.dynamic_shapes.get() or family.dynamic_failed:
            return None

        def general() -> ShapeFamily | None:
            # Asked of the op on meta tensors: only where it is the answer.
            kernel = ShapeFamily.general_for(signature)
            return kernel if any(kernel.dims) else None  # else no sizes to move

        if not family.seen:
            # The op compiled already for calls of these dtypes and ranks, in another
            # family: its shapes move, so the family's first kernel is general.
            kinds = (str(signature.device), kinds_key(signature))
            return general() if kinds in self.compiled_kinds else None
        known = {key for key, _ in family.dynamic()}
        if known:
            # Where the general kernel refuses it (a size export fixed), the shape compiles alone.
            kernel = general()
            return None if kernel is None or kernel.entry_key(signature) in known else kernel
        if signature.key in family.keys:
            return None
        changed = changed_dims(signature, family.seen)
        # Where only strides changed, or a size to or from 1, a general kernel (a broadcast, a slice, a
        # batch of one): export fixes a dim that grew from 1 to the size of its partner, which did not move.
        if not any(changed) or grew_from_one(signature, family.seen):
            return general()
        return ShapeFamily(changed)
