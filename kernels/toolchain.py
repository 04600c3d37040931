"""The C++ compiler that kernels are built with, and the vector ISA it targets.

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
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import torch

from aoti_eager.cache import layout

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
            [compiler, "-shared", "-fPIC", "-std=c++17", str(source), "-o", str(library)],
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


@contextlib.contextmanager
def known_vec_isas(names: list[str] | None) -> Iterator[None]:
    """Within the block, Inductor takes ``names`` (its own earlier answer, see
    :func:`aoti_eager.cache.layout.usable_vec_isas`) as the vector ISAs this CPU
    runs, instead of probing again.

    Inductor's probe builds a test program per ISA and loads each in a new
    Python process that imports torch: 1-2 s on a CPU machine, about 45 s on a
    CUDA machine, paid by the first compile of every process (a CUDA wrapper is
    C++ too). Without ``names``, or where they are not this torch's ISAs,
    Inductor probes.
    """
    from torch._inductor import cpu_vec_isa

    by_name: dict[str, list] = {}
    for isa in getattr(cpu_vec_isa, "supported_vec_isa_list", []):
        by_name.setdefault(str(isa), []).append(isa)
    original = getattr(cpu_vec_isa, "valid_vec_isa_list", None)
    if names is None or original is None or any(len(by_name.get(name, [])) != 1 for name in names):
        yield
        return
    isas = [by_name[name][0] for name in names]
    cpu_vec_isa.valid_vec_isa_list = lambda: isas
    try:
        yield
    finally:
        cpu_vec_isa.valid_vec_isa_list = original
