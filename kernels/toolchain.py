"""What kernels are built with on this machine: the C++ compiler, the CPU and
the vector ISA it targets (probed by :mod:`aoti_eager.kernels.inductor.vec_isa`),
and the environment that names all of it in the cache (:func:`environment_name`).
Answers that take a probe are remembered in the user's private directory
(:func:`aoti_eager.cache.layout.machine_record`).

Each answer comes from the current :class:`Toolchain`, which tests swap with
:func:`scope` instead of patching this module's functions.

Inductor builds with ``$CXX``, else ``g++``. Some compilers link libstdc++
statically into every shared library they build (custom GCC builds do). Such a
library crashes the process as soon as it touches ``std::locale`` beside
torch's own libstdc++, and AOTInductor's runtime does that when it creates a
model: it parses the device string with ``std::regex``. So each candidate
builds a small library that does the same, a child process loads it beside
torch, and the first candidate that passes is used. The verdict is kept on
disk per set of candidates and torch build, as it costs seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import torch

from aoti_eager.cache import layout
from aoti_eager.kernels.inductor import shims, vec_isa
from aoti_eager.kernels.seam import Seam
from aoti_eager.version import __version__

log = logging.getLogger("aoti_eager")

_TEST_LIBRARY_SOURCE = r"""
#include <regex>
#include <string>
extern "C" int aoti_eager_toolchain_check() {
  std::string device = "cuda:0";
  std::smatch match;
  return std::regex_match(device, match, std::regex("(cpu|cuda)(:([0-9]+))?")) ? 0 : 1;
}
"""
_LOAD_BESIDE_TORCH = "import ctypes, sys, torch; sys.exit(ctypes.CDLL(sys.argv[1]).aoti_eager_toolchain_check())"


def candidates() -> list[str]:
    """Compilers to try, in order: ``$CXX`` (Inductor's choice), then the usual names on PATH."""
    names = [os.environ.get("CXX"), "clang++" if sys.platform == "darwin" else "g++", "c++", "clang++"]
    found: dict[str, str] = {}
    for name in filter(None, names):
        path = shutil.which(name)
        if path:
            found.setdefault(os.path.realpath(path), path)
    return list(found.values())


def why_unusable(compiler: str) -> str | None:
    """None if a library built by ``compiler`` runs beside torch, else the reason."""
    with tempfile.TemporaryDirectory(prefix="aoti_eager-toolchain-") as workdir:
        source, library = Path(workdir, "check.cpp"), Path(workdir, "check.so")
        source.write_text(_TEST_LIBRARY_SOURCE)
        build = subprocess.run(
            [compiler, "-shared", "-fPIC", *language_standard(), str(source), "-o", str(library)],
            capture_output=True, text=True, timeout=300,
        )
        if build.returncode != 0:
            return f"cannot build a shared library: {(build.stderr.strip().splitlines() or [''])[-1][:200]}"
        load = subprocess.run([sys.executable, "-c", _LOAD_BESIDE_TORCH, str(library)], capture_output=True, timeout=300)
        if load.returncode < 0:
            return f"its libraries crash a process that has imported torch (signal {-load.returncode})"
        if load.returncode != 0:
            return f"its libraries fail beside torch (exit code {load.returncode})"
    return None


def language_standard() -> list[str]:
    """The ``-std=`` flag Inductor compiles kernels with, which follows the
    installed torch's headers (C++17 up to some releases, C++20 after)."""
    from torch._inductor import cpp_builder

    # A private function of Inductor's; the compiler's own default where it moved.
    standard = getattr(cpp_builder, "_get_cpp_std_cflag", lambda: [])
    return [f"-{flag}" for flag in standard()]


@lru_cache(maxsize=None)
def _chosen_compiler() -> str:
    """The first of :func:`candidates` whose libraries work beside torch.

    Falls back to the first candidate when none passes: kernels then fail to
    compile or to load, and their calls run eagerly. The verdict is kept in the
    user's private directory, and believed only while it names one of the
    candidates found now.
    """
    found = candidates()
    digest = hashlib.sha256(json.dumps([found, torch.__version__]).encode()).hexdigest()[:16]
    record = layout.machine_record(f"compiler-choice-{digest}.json")
    try:
        remembered = json.loads(record.read_text())["compiler"]
        if remembered in found:
            return remembered
    except (OSError, ValueError, KeyError, TypeError):
        pass
    chosen = None
    for compiler in found:
        reason = why_unusable(compiler)
        if reason is None:
            chosen = compiler
            break
        log.warning("aoti_eager: not building kernels with %s: %s", compiler, reason)
    chosen = chosen or (found[0] if found else "g++")
    layout.atomic_write_text(record, json.dumps({"compiler": chosen, "candidates": found}))
    return chosen


@lru_cache(maxsize=None)
def _found_linker() -> str | None:
    """The linker kernel libraries are linked with (``-fuse-ld``): ``gold``
    where the system has it, else None, the compiler's default (GNU ld). A
    library links against libtorch_cpu.so (hundreds of MB), whose symbols gold
    reads in about a third of GNU ld's time."""
    return "gold" if shutil.which("ld.gold") else None


@lru_cache(maxsize=None)
def _identity(compiler: str | None = None) -> str:
    """``compiler`` (by default Inductor's: ``$CXX``, else g++) and its version.

    Asking the compiler takes milliseconds, which a warm process's first call
    must not pay: the answer is kept on disk per compiler binary (path, size,
    modification time), so an upgrade asks again.
    """
    compiler = compiler or os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    try:
        binary = os.path.realpath(shutil.which(compiler) or compiler)
        stat = os.stat(binary)
        fingerprint = f"{binary}:{stat.st_size}:{stat.st_mtime_ns}"
    except OSError:
        fingerprint = compiler
    record = layout.machine_record(f"compiler-version-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}.json")
    try:
        return json.loads(record.read_text())["identity"]
    except (OSError, ValueError, KeyError):
        pass
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    identity = f"{compiler}: {(out.splitlines() or ['unknown version'])[0]}"
    layout.atomic_write_text(record, json.dumps({"identity": identity}))
    return identity


@dataclass(frozen=True)
class Toolchain:
    """Where each answer about what kernels are built with comes from: by
    default this machine's (probed once, remembered); a test gives its own
    with :func:`scope`."""

    compiler: Callable[[], str] = _chosen_compiler
    compiler_identity: Callable[..., str] = _identity  # (compiler=None): the compiler and its version
    linker: Callable[[], str | None] = _found_linker
    cpu_identity: Callable[[], str] = vec_isa.cpu_identity
    cpu_isa: Callable[[], str] = vec_isa.isa
    usable_vec_isas: Callable[[], dict[str, list[str]]] = vec_isa.usable
    remembered_vec_isas: Callable[[], dict[str, list[str]] | None] = vec_isa.remembered
    vec_isas_known: Callable[[], bool] = vec_isa.known
    declared_shims: Callable[[str], frozenset[str] | None] = shims.declared_shims  # (device type): by name


_toolchain = Seam(Toolchain())
# The toolchain every answer below comes from; scope(cpu_isa=lambda: "avx2") swaps answers within a block.
current, scope = _toolchain.current, _toolchain.scope


def forget() -> None:
    """Forgets what this process remembered of the machine (its records on disk stay)."""
    for remembered in (_chosen_compiler, _found_linker, _identity, vec_isa.forget):
        getattr(remembered, "cache_clear", remembered)()


def cpp_compiler() -> str:
    """The C++ compiler kernels are built with (see :func:`_chosen_compiler`)."""
    return current().compiler()


def compiler_identity(compiler: str | None = None) -> str:
    """``compiler`` (by default Inductor's: ``$CXX``, else g++) and its version (see :func:`_identity`)."""
    return current().compiler_identity(compiler)


def linker() -> str | None:
    """The linker kernel libraries are linked with (see :func:`_found_linker`)."""
    return current().linker()


def cpu_isa() -> str:
    """The vector ISA Inductor compiles for on this CPU (see :func:`aoti_eager.kernels.inductor.vec_isa.isa`)."""
    return current().cpu_isa()


def usable_vec_isas() -> dict[str, list[str]]:
    """The vector ISAs usable on this CPU, each with its extensions (see :func:`aoti_eager.kernels.inductor.vec_isa.usable`)."""
    return current().usable_vec_isas()


def vec_isas_for(device_type: str) -> dict[str, list[str]]:
    """The vector ISAs a compile for ``device_type`` builds with: this CPU's
    usable ones for CPU kernels, none for a GPU's, whose wrapper holds no vector
    code (so that a GPU compile never waits for Inductor's probe of the CPU)."""
    return usable_vec_isas() if device_type == "cpu" else {}


def remembered_vec_isas() -> dict[str, list[str]] | None:
    """:func:`usable_vec_isas` where a process probed them before, else None, without probing."""
    return current().remembered_vec_isas()


def vec_isas_known() -> bool:
    """Whether :func:`cpu_isa` answers without Inductor's probe."""
    return current().vec_isas_known()


def environment_fields(device: torch.device, compile_options: dict[str, Any] | None = None) -> dict[str, str]:
    """Everything besides the call that shapes a kernel compiled for ``device``
    with the given Inductor options.

    Never the device index: a kernel compiled on ``cuda:0`` serves ``cuda:1``
    of the same architecture.
    """
    fields = {
        "device": device.type,
        "torch": torch.__version__,
        "torch_git": str(torch.version.git_version),
        "aoti_eager": __version__,
        "machine": platform.machine(),
        "compiler": compiler_identity((compile_options or {}).get("cpp.cxx", (None, None))[1]),
        "inductor_options": json.dumps(compile_options or {}, sort_keys=True),
    }
    if linker() is not None:  # named only where it is not the default, as before it could be chosen
        fields["linker"] = linker()
    if device.type == "cpu":
        # Libraries that borrow their inputs (kernels/inductor/wrapper_split.py): a
        # runtime that hands them over would never free them.
        fields["inputs"] = "borrowed"
        fields["isa"] = cpu_isa()
        # Inductor compiles with -march=native: the exact CPU model matters.
        fields["cpu"] = current().cpu_identity()
    elif device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        fields["arch"] = f"sm_{major}{minor}"
        fields["cuda"] = str(torch.version.cuda)
        try:
            import triton

            fields["triton"] = triton.__version__
        except ImportError:
            fields["triton"] = "none"
    return fields


def environment_name(device: torch.device, compile_options: dict[str, Any] | None = None) -> str:
    """A directory name for :func:`environment_fields`: readable, then a digest
    of every field, which keeps the name exact where
    :func:`aoti_eager.cache.layout.safe_name` is not."""
    fields = environment_fields(device, compile_options)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    capability = fields.get("isa") or fields.get("arch") or "generic"
    return layout.safe_name(f"{device.type}-{capability}-torch{fields['torch']}-{digest}")
