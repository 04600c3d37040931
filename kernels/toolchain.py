"""What kernels are built with on this machine: the C++ compiler, the CPU and
the vector ISA it targets, and the environment that names all of it in the
cache (:func:`environment_name`). Answers that take a probe are remembered in
the user's private directory (:func:`machine_record`).

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

import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

import torch

from aoti_eager.cache import layout
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
def cpp_compiler() -> str:
    """The first of :func:`candidates` whose libraries work beside torch.

    Falls back to the first candidate when none passes: kernels then fail to
    compile or to load, and their calls run eagerly. The verdict is kept in the
    user's private directory, and believed only while it names one of the
    candidates found now.
    """
    found = candidates()
    digest = hashlib.sha256(json.dumps([found, torch.__version__]).encode()).hexdigest()[:16]
    record = machine_record(f"compiler-choice-{digest}.json")
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
def linker() -> str | None:
    """The linker kernel libraries are linked with (``-fuse-ld``): ``gold``
    where the system has it, else None, the compiler's default (GNU ld). A
    library links against libtorch_cpu.so (hundreds of MB), whose symbols gold
    reads in about a third of GNU ld's time."""
    return "gold" if shutil.which("ld.gold") else None


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
    :func:`usable_vec_isas`: ISA names and, for each, the extensions found) as
    the vector ISAs this CPU runs, instead of probing again.

    Inductor's probe builds a test program per ISA and loads each in a new
    Python process that imports torch: seconds on a CPU machine, up to a
    minute on a many-core GPU host, paid by the first compile of every process
    (a CUDA wrapper is C++ too). The ISA a CPU kernel is built for is probed
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

    original = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    isas = [vec_isa_named(name) for name in usable or {}]
    if usable is None or original is None or None in isas:
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
    for cls, check in own_checks.items():
        cls.__bool__ = lambda isa, check=check: isa in isas or check(isa)
    try:
        with inductor_config.patch(checked):
            yield
    finally:
        cpu_vec_isa.valid_vec_isa_list = original
        for cls, check in own_checks.items():
            cls.__bool__ = check


def _cpu_identity() -> str:
    """The CPU model and feature flags: what the vector ISA probe depends on."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [l for l in f if l.startswith(("model name", "flags"))]
        text = "".join(sorted(set(lines)))
    except OSError:
        text = platform.processor() + platform.machine()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cpu_isa() -> str:
    """The vector ISA Inductor compiles for on this CPU.

    Inductor's probe compiles test programs and loads each in a new Python
    process, seconds in all, so its answer is remembered in the user's
    private directory per CPU identity and torch build.
    """
    return _vec_isas(torch.__version__)["isa"]


def usable_vec_isas() -> dict[str, list[str]]:
    """The vector ISAs Inductor's probe found usable on this CPU, in its order
    of preference, each with the extensions it found (remembered as
    :func:`cpu_isa` is)."""
    return _vec_isas(torch.__version__)["usable"]


def remembered_vec_isas() -> dict[str, list[str]] | None:
    """:func:`usable_vec_isas` where a process has probed them before; else
    None, without probing."""
    probed = _remembered_vec_isas(torch.__version__)
    return probed["usable"] if probed is not None else None


def vec_isas_known() -> bool:
    """Whether :func:`cpu_isa` answers without Inductor's probe."""
    if _vec_isas.cache_info().currsize == 0:
        if _remembered_vec_isas(torch.__version__) is None:
            return False
        _vec_isas(torch.__version__)  # kept: a process that compiles nothing asks on every miss
    return True


def machine_record(name: str) -> Path:
    """Where a fact about this machine is remembered (in the private directory)."""
    return layout.private_directory("machine") / name


def _vec_isas_record(torch_version: str) -> Path:
    # Named apart from the records of names only (<cpu>-torch<version>.json), which
    # earlier versions read: one machine may run both.
    return machine_record(f"vec-isas-{_cpu_identity()}-torch{layout.safe_name(torch_version)}.json")


def _remembered_vec_isas(torch_version: str) -> dict | None:
    try:
        probed = json.loads(_vec_isas_record(torch_version).read_text())
        usable = probed["usable"]
        if isinstance(probed["isa"], str) and isinstance(usable, dict) and all(
            isinstance(name, str) and isinstance(found, list) and all(isinstance(e, str) for e in found)
            for name, found in usable.items()
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

    isas = cpu_vec_isa.valid_vec_isa_list()  # the probe: it sets the extensions on each ISA it checks
    probed = {"isa": str(cpu_vec_isa.pick_vec_isa()) or "scalar", "usable": {str(isa): _extensions(isa) for isa in isas}}
    layout.atomic_write_text(_vec_isas_record(torch_version), json.dumps(probed))
    return probed


@lru_cache(maxsize=None)
def compiler_identity(compiler: str | None = None) -> str:
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
    record = machine_record(f"compiler-version-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}.json")
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
        # Libraries that borrow their inputs (kernels/wrapper_split.py): a
        # runtime that hands them over would never free them.
        fields["inputs"] = "borrowed"
        fields["isa"] = cpu_isa()
        # Inductor compiles with -march=native: the exact CPU model matters.
        fields["cpu"] = _cpu_identity()
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
