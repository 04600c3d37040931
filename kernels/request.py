"""What a miss asks to have compiled: one kernel of one op on one device.

A :class:`CompileRequest` is what the miss path decides to compile, what the
background queue hands a worker process, what ``prewarm`` compiles and what
a ``record=`` manifest holds, one per line::

    {"op": "aten::abs", "device": "cpu", "key": "3f0c...", "signature": [{"name": "self", ...}]}

``signature`` is :meth:`CallSignature.to_json` of the call that missed (its
runtime numbers flagged ``"runtime"``), from which
:func:`aoti_eager.kernels.examples.example_arguments` rebuilds the call, and
``key`` the cache entry the kernel is published under. A dynamic-shape
kernel (kernels/dynamic.py) adds ``dynamic``: the dims that move, for each
tensor argument, the smallest and largest size of each among the shapes of
its family that the asking process had seen (one ``[min, max]`` per dim, in
``dims`` order), and whether it is a general kernel (every dim moves,
strides read at run time)::

    {"op": "aten::add.Tensor", "device": "cpu", "key": "9b1e...-04d2...", "signature": [...],
     "dynamic": {"dims": [[0], []], "seen": [[5, 9]], "general": false}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aoti_eager.kernels.dynamic import ShapeFamily
from aoti_eager.kernels.signature import Position


@dataclass(frozen=True)
class CompileRequest:
    """One kernel to compile: ``op`` on ``device`` (a device type) for the
    call ``signature`` (as JSON), published under ``key``; with ``family``, a
    dynamic-shape kernel of those dims, and ``seen``, the span of sizes seen
    of each (:meth:`ShapeFamily.size_span`)."""

    op: str
    device: str
    key: str
    signature: list[dict[str, Any]]
    family: ShapeFamily | None = None
    seen: list[list[int]] | None = None

    @property
    def id(self) -> tuple[str, str, str]:
        """What makes two requests the same kernel."""
        return (self.op, self.device, self.key)

    @property
    def runtime_ints(self) -> list[Position]:
        """Where the ints are that the kernel takes at run time (arguments,
        and items of int lists), as :attr:`CallSignature.runtime_arguments`
        gives them.

            >>> pad = {"kind": "list", "items": [{"kind": "int", "value": 0}, {"kind": "int", "value": 5, "runtime": True}]}
            >>> CompileRequest("aten::constant_pad_nd", "cpu", "k", [{"kind": "tensor"}, pad]).runtime_ints
            [(1, 1)]
        """
        runtime = lambda d: d["kind"] == "int" and bool(d.get("runtime"))  # noqa: E731
        positions: list[Position] = []
        for i, described in enumerate(self.signature):
            if runtime(described):
                positions.append(i)
            positions += [(i, j) for j, item in enumerate(described.get("items", [])) if runtime(item)]
        return positions

    @property
    def dynamic(self) -> dict[str, Any] | None:
        """A dynamic-shape kernel's ``{"dims", "seen", "general"}`` as a
        manifest line holds it; None for a static kernel."""
        return self.to_json().get("dynamic")

    def to_json(self) -> dict[str, Any]:
        """The request as a manifest line holds it (no ``dynamic`` for a static kernel)."""
        data: dict[str, Any] = {"op": self.op, "device": self.device, "key": self.key, "signature": self.signature}
        if self.family is not None:
            data["dynamic"] = {"dims": [list(d) for d in self.family.dims], "seen": self.seen or [], "general": self.family.general}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CompileRequest":
        """The request :meth:`to_json` gave. Raises KeyError, TypeError or
        ValueError for data that is not one."""
        unknown = set(data) - {"op", "device", "key", "signature", "dynamic"}
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        dynamic = data.get("dynamic")
        family = seen = None
        if dynamic is not None:
            family = ShapeFamily(tuple(tuple(dims) for dims in dynamic["dims"]), general=dynamic.get("general", False))
            seen = dynamic["seen"]
        return cls(data["op"], data["device"], data["key"], data["signature"], family, seen)
