"""The vector ISAs Inductor compiles CPU code for on this machine, probed once
and remembered, and Inductor told them instead of probing again.

Torch internals it touches (:data:`INTERNALS`), checked with torch 2.11,
2.13 and 2.14.1:

- ``torch._inductor.cpu_vec_isa.valid_vec_isa_list`` and
  ``torch._inductor.cpu_vec_isa.pick_vec_isa``: Inductor's probe, made once
  per CPU and torch build (:func:`isa`, :func:`usable`).
- ``torch._inductor.cpu_vec_isa.supported_vec_isa_list``: the ISAs by name
  (:func:`vec_isa_named`); where it has moved, no ISA is known by name, and
  Inductor probes as usual.
- ``valid_vec_isa_list`` is also replaced within :func:`known_vec_isas`,
  with ``torch._inductor.config.cpp.vec_isa_ok`` set and an ISA class's own
  check (``torch._inductor.cpu_vec_isa.VecISA.__bool__``) answered.
- The ``_is_*_supported`` flags the probe sets on an ISA (``_is_avx512_bf16_supported``,
  ``_is_amx_fp16_supported``): only flags the ISA's class declares are set.

Where any of them has moved (``missing(INTERNALS)``), nothing is replaced: the ISA is
named ``unprobed`` in the environment, nothing is remembered, and Inductor
probes for itself when it compiles, as it would without this package.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import platform
import re
from functools import lru_cache
from typing import Any, Iterator

import torch

from aoti_eager.cache import layout
from aoti_eager.kernels.inductor.internals import missing

INTERNALS = (
    "torch._inductor.cpu_vec_isa.valid_vec_isa_list()",
    "torch._inductor.cpu_vec_isa.pick_vec_isa()",
    "torch._inductor.cpu_vec_isa.supported_vec_isa_list",
    "torch._inductor.cpu_vec_isa.VecISA.__bool__(self)",
    "torch._inductor.config.cpp.vec_isa_ok",
)


def vec_isa_named(name: str) -> Any:
    """This torch's vector ISA named ``name`` (Inductor's ``str`` of it), or
    None where no one ISA has that name."""
    from torch._inductor import cpu_vec_isa

    isas = [isa for isa in getattr(cpu_vec_isa, "supported_vec_isa_list", []) if str(isa) == name]
    return isas[0] if len(isas) == 1 else None


# What Inductor's probe of an ISA finds besides the ISA, and keeps on its
# object: AVX-512 with BF16 (``_is_avx512_bf16_supported``), AMX with FP16
# (``_is_amx_fp16_supported``). Each adds a compiler flag (-mavx512bf16,
# -mamx-fp16) to what the ISA builds with.
_EXTENSION = re.compile(r"_is_\w+_supported")


def _extensions(isa: Any) -> list[str]:
    """The extensions the probe found on ``isa`` (see :data:`_EXTENSION`)."""
    return sorted(name for name, value in vars(isa).items() if _EXTENSION.fullmatch(name) and value is True)


@contextlib.contextmanager
def known_vec_isas(usable: dict[str, list[str]] | None) -> Iterator[None]:
    """Within the block, Inductor takes ``usable`` (its own earlier answer, see
    :func:`usable`: ISA names and, for each, the extensions found) as
    the vector ISAs this CPU runs, instead of probing again.

    Inductor's probe builds a test program per ISA and loads each in a new
    Python process that imports torch, paid by the first compile of every
    process (a CUDA wrapper is C++ too). The ISA a CPU kernel is built for is probed
    again the same way when its code is generated, unless Inductor is told
    that ISAs are usable (``cpp.vec_isa_ok``), which ``usable`` says for each of
    them. Without ``usable``, or where they are not this torch's ISAs,
    Inductor probes.

    The extensions are set on the ISAs as the probe would have set them: the
    process that probed and every later one then compile with the same flags.
    (Without them an H100 host's second process built its precompiled header
    and the shared wrapper parts again, without -mavx512bf16.)
    """
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    if usable is None or missing(INTERNALS):
        yield
        return
    original = cpu_vec_isa.valid_vec_isa_list
    isas = [vec_isa_named(name) for name in usable]
    if None in isas:
        yield
        return
    for isa, extensions in zip(isas, usable.values()):
        for name in extensions:
            if _EXTENSION.fullmatch(name) and isinstance(getattr(type(isa), name, None), bool):
                setattr(isa, name, True)
    cpu_vec_isa.valid_vec_isa_list = lambda: isas
    # A user's TORCHINDUCTOR_VEC_ISA_OK stands.
    checked = {"cpp.vec_isa_ok": True} if inductor_config.cpp.vec_isa_ok is None else {}
    # An ISA with a check of its own (AMX builds and runs a test program in a
    # new process, once per process) is usable where the probe found it so.
    own_checks = {cls: cls.__dict__["__bool__"] for cls in map(type, isas) if checked and "__bool__" in cls.__dict__}
    for cls, own_check in own_checks.items():
        cls.__bool__ = lambda isa, own_check=own_check: isa in isas or own_check(isa)
    try:
        with inductor_config.patch(checked):
            yield
    finally:
        cpu_vec_isa.valid_vec_isa_list = original
        for cls, own_check in own_checks.items():
            cls.__bool__ = own_check


def cpu_identity() -> str:
    """The CPU model and feature flags: what the vector ISA probe depends on."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l for l in f if l.startswith(("model name", "flags"))]
        text = "".join(sorted(set(lines)))
    except OSError:
        text = platform.processor() + platform.machine()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# The ISA's name where Inductor's probe is not where it was: the environment
# says so, and Inductor probes for itself when it compiles.
UNPROBED = "unprobed"


def isa() -> str:
    """The vector ISA Inductor compiles for on this CPU.

    Inductor's probe compiles test programs and loads each in a new Python
    process, seconds in all, so its answer is remembered in the user's
    private directory per CPU identity and torch build.
    """
    return _vec_isas(torch.__version__)["isa"]


def usable() -> dict[str, list[str]]:
    """The vector ISAs Inductor's probe found usable on this CPU, in its order
    of preference, each with the extensions it found (remembered as
    :func:`isa` is)."""
    return _vec_isas(torch.__version__)["usable"]


def remembered() -> dict[str, list[str]] | None:
    """:func:`usable` where a process has probed them before; else None,
    without probing."""
    probed = _remembered_vec_isas(torch.__version__)
    return probed["usable"] if probed is not None else None


def known() -> bool:
    """Whether :func:`isa` answers without Inductor's probe."""
    if _vec_isas.cache_info().currsize == 0:
        if _remembered_vec_isas(torch.__version__) is None:
            return False
        _vec_isas(torch.__version__)  # kept: a process that compiles nothing asks on every miss
    return True


def forget() -> None:
    """Forgets the probe's answer in this process (its record on disk stays)."""
    _vec_isas.cache_clear()


def _vec_isas_record(torch_version: str):
    # Named apart from the records of names only (<cpu>-torch<version>.json), which
    # earlier versions read: one machine may run both.
    return layout.machine_record(f"vec-isas-{cpu_identity()}-torch{layout.safe_name(torch_version)}.json")


def _remembered_vec_isas(torch_version: str) -> dict | None:
    try:
        probed = json.loads(_vec_isas_record(torch_version).read_text())
        found = probed["usable"]
        if isinstance(probed["isa"], str) and isinstance(found, dict) and all(
            isinstance(name, str) and isinstance(extensions, list) and all(isinstance(e, str) for e in extensions)
            for name, extensions in found.items()
        ):
            return probed
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


@lru_cache(maxsize=None)
def _vec_isas(torch_version: str) -> dict:
    if (probed := _remembered_vec_isas(torch_version)) is not None:
        return probed
    from torch._inductor import cpu_vec_isa

    if missing(INTERNALS):
        return {"isa": UNPROBED, "usable": {}}
    isas = cpu_vec_isa.valid_vec_isa_list()  # the probe: it sets the extensions on each ISA it checks
    probed = {"isa": str(cpu_vec_isa.pick_vec_isa()) or "scalar", "usable": {str(isa): _extensions(isa) for isa in isas}}
    layout.atomic_write_text(_vec_isas_record(torch_version), json.dumps(probed))
    return probed
