"""Whether AOTInductor's runtime loads kernels without crashing here.

A library can crash the process (a segmentation fault) when AOTInductor
creates its model container, e.g. one built by a compiler that links its own
libstdc++ (see :mod:`aoti_eager.kernels.toolchain`, which avoids the known
case). A crash cannot be caught, so until one kernel of a cache environment
has loaded on this machine, each is loaded first in a child process.

What the child's end says:

- it loaded: the runtime is sound here; the environment's kernels load in
  process from then on, whichever cache root or fleet they come from;
- it failed to load (an error, not a signal): that library's problem, its
  signature's to deal with (:class:`LibraryDoesNotLoad`);
- a signal: a crash. On a known-good library (a verified cache entry, which
  loaded and matched eager where it was compiled) the runtime is at fault, and
  every kernel of the environment stays eager (:class:`UnsafeToLoad`, the
  verdict kept until ``aoti-eager cache clear``); on a library just compiled,
  that library is (:class:`LibraryDoesNotLoad`).

The verdict is a fact about this machine, this user and the environment (its
name covers the torch build, the compiler, the CPU or GPU architecture), not
about a cache: it is kept in the user's private directory, one file per
environment (:func:`verdict_file`), so that a new cache root, or one filled
from the fleet, does not pay the child process again::

    >>> check_loads("cpu-avx2-torch2.13.0+cpu-0123456789ab", library, "cpu", [-1], known_good=True)
    >>> verdict_file("cpu-avx2-torch2.13.0+cpu-0123456789ab").relative_to(layout.private_root())
    PosixPath('load-probe/cpu-avx2-torch2.13.0+cpu-0123456789ab.json')

Torch internals it touches (:data:`INTERNALS`, checked with torch 2.11, 2.13
and 2.14.1): none of Python's. Its child process loads the library through
the package's C++ extension, whose reach into AOTInductor's model runner
(``csrc/compiled_kernel.cpp``) is checked where the extension is built: a
member that moved fails that build, not a probe.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

import torch

from aoti_eager.cache import layout

log = logging.getLogger("aoti_eager")

INTERNALS: tuple[str, ...] = ()


_CHILD = (
    "import json, sys, aoti_eager._extension as e; "
    "e.load().CompiledKernel(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))"
)


class UnsafeToLoad(RuntimeError):
    """The runtime crashes loading a known-good kernel: the environment's kernels stay eager."""


class LibraryDoesNotLoad(RuntimeError):
    """One library does not load (or crashed a child process before it was ever used)."""


# Environment name -> None where kernels load, else the reason they do not.
_verdicts: dict[str, str | None] = {}
# Environment -> the library a child started by probe_ahead loads, and the child.
_ahead: dict[str, tuple[Path, subprocess.Popen]] = {}


def check_loads(environment: str, library: Path, device: str, output_counts: list[int], known_good: bool) -> None:
    """Returns if ``library``, a kernel of the cache environment named
    ``environment``, may be loaded in this process.

    Raises UnsafeToLoad where the runtime crashes on this environment's
    kernels, LibraryDoesNotLoad where only ``library`` is at fault.
    ``known_good``: the library is a verified cache entry's.
    """
    crash = runtime_crashes(environment)
    if crash is not None:
        raise UnsafeToLoad(crash)
    # Before any process loads it: a cut library kills the one that does (SIGBUS), and the probe's
    # child dying so would be taken for the runtime's crash.
    cut = truncated(library)
    if cut is not None:
        raise LibraryDoesNotLoad(cut)
    if environment not in _verdicts:
        _probe(environment, library, device, output_counts, known_good)


# A 64-bit ELF file: its identification (little- or big-endian), then its header's fields up to the section
# headers' count; of a program header, its type, flags, offset, addresses and size in the file.
_ELF64 = b"\x7fELF\x02"
_ELF_HEADER = "HHIQQQIHHHHHH"
_ELF_HEADER_SIZE = struct.calcsize("<" + _ELF_HEADER)
_PROGRAM_HEADER = "IIQQQQ"
_PROGRAM_HEADER_SIZE = 56
_PT_LOAD = 1


def truncated(library: Path) -> str | None:
    """Why the 64-bit ELF file ``library`` is shorter than its headers say,
    or None. The loader maps the segments its program headers name whatever
    the file's size; the first touch of a page past the file's end then
    kills the process (SIGBUS), which no check of the bytes against a
    recorded sha256 prevents where that sha256 was recorded again. Any
    other file, or one that cannot be read, is the loader's to refuse (with
    an error, not a crash)."""
    try:
        with open(library, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            ends = _elf_ends(f)
    except OSError:
        return None
    what, end = max(ends.items(), key=lambda item: item[1], default=("", 0))
    return None if end <= size else f"the library is {size} bytes, {what} is at byte {end}: it was cut short"


def _elf_ends(f: BinaryIO) -> dict[str, int]:
    """Where what the headers of the 64-bit ELF file ``f`` describe ends, by
    what it is; empty for another file."""
    ident = f.read(16)
    if not ident.startswith(_ELF64) or ident[5] not in (1, 2):
        return {}
    order = "<" if ident[5] == 1 else ">"
    header = f.read(_ELF_HEADER_SIZE)
    if len(header) < _ELF_HEADER_SIZE:
        return {"the end of its ELF header": len(ident) + _ELF_HEADER_SIZE}
    _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _ = struct.unpack(order + _ELF_HEADER, header)
    ends = {"the end of its section headers": shoff + shnum * shentsize,
            "the end of its program headers": phoff + phnum * phentsize}
    if phentsize != _PROGRAM_HEADER_SIZE:
        return ends  # program headers of another size: the loader refuses them
    f.seek(phoff)
    table = f.read(phnum * phentsize)
    if len(table) < phnum * phentsize:
        return ends  # cut short in its program headers
    for i in range(phnum):
        kind, _, offset, _, _, filesz = struct.unpack_from(order + _PROGRAM_HEADER, table, i * phentsize)
        if kind == _PT_LOAD:
            ends[f"the end of its loaded segment {i}"] = offset + filesz
    return ends


def runtime_crashes(environment: str) -> str | None:
    """Why kernels of ``environment`` are not loaded, if a probe found they crash the runtime."""
    if environment not in _verdicts:
        recorded = _recorded(verdict_file(environment))
        if recorded is not None:
            _verdicts[environment] = recorded["reason"]
    return _verdicts.get(environment)


def verdict_directory() -> Path:
    """Where verdicts are kept: ``<private>/load-probe/`` (see
    :func:`aoti_eager.cache.layout.private_root`), this user's alone."""
    return layout.private_directory("load-probe")


def verdict_file(environment: str) -> Path:
    """The file of :func:`verdict_directory` that keeps the verdict on
    ``environment``, whatever the name holds."""
    return verdict_directory() / f"{layout.safe_name(environment)}.json"


def _recorded(path: Path) -> dict | None:
    """The verdict kept in ``path``; None if there is none."""
    try:
        record = json.loads(path.read_text())
        # Records without "loads" took any failure for a crash: judged again.
        if isinstance(record["loads"], bool) and (record["loads"] or isinstance(record["reason"], str)):
            return record
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def probe_ahead(environment: str, library: Path, device: str, output_counts: list[int]) -> None:
    """Starts the child that :func:`check_loads` would run for ``library``,
    a new library of ``environment`` (a training kernel's forward, while its
    backward compiles), where no verdict is known yet; the next
    :func:`check_loads` of the environment takes its end."""
    if runtime_crashes(environment) is None and environment not in _verdicts and environment not in _ahead:
        if truncated(library) is None:
            _ahead[environment] = (library, _child(library, device, output_counts))


def _child(library: Path, device: str, output_counts: list[int]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(library), device, json.dumps(output_counts)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _probe(environment: str, library: Path, device: str, output_counts: list[int], known_good: bool) -> None:
    probed, child = _ahead.pop(environment, None) or (library, _child(library, device, output_counts))
    _, stderr = child.communicate()
    if child.returncode == 0:
        # Whichever library of the environment it loaded, the runtime is sound here.
        _remember(environment, probed, None)
        return
    if probed != library:
        # Another library's failure, started ahead, says nothing of this one: it is probed itself.
        return _probe(environment, library, device, output_counts, known_good)
    last = (stderr.strip().splitlines() or [""])[-1][:200]
    detail = f": {last}" if last else ""
    if child.returncode > 0:
        raise LibraryDoesNotLoad(f"a test process could not load it (exit code {child.returncode}){detail}")
    which = "a known-good" if known_good else "a new"
    crash = f"AOTInductor's runtime crashed a test process loading {which} {device} kernel (signal {-child.returncode}){detail}"
    if not known_good:
        raise LibraryDoesNotLoad(crash)
    reason = f"{crash}; `aoti-eager cache clear` forgets this verdict"
    _remember(environment, library, reason)
    raise UnsafeToLoad(reason)


def _remember(environment: str, library: Path, reason: str | None) -> None:
    _verdicts[environment] = reason
    try:
        record = json.dumps({"loads": reason is None, "reason": reason, "library": str(library), "torch": torch.__version__})
        layout.atomic_write_text(verdict_file(environment), record)
    except OSError as e:  # a private directory that cannot be written: this process keeps the verdict
        log.debug("aoti_eager: cannot keep the load probe's verdict on %s: %s", environment, e)


def recorded_verdicts() -> dict[str, str | None]:
    """Per environment of the running torch build with a verdict on this
    machine: None where its kernels load, else why not. Other builds' verdicts
    (the private directory is shared by every torch a user runs) are left out."""
    verdicts = {}
    for path in sorted(verdict_directory().glob("*.json")):
        recorded = _recorded(path)
        if recorded is not None and recorded.get("torch") == torch.__version__:
            verdicts[path.stem] = recorded["reason"]
    return verdicts


def forget_verdicts() -> None:
    """Removes every verdict of this user's: the next kernel loaded of each environment is probed again."""
    for path in verdict_directory().glob("*.json"):
        path.unlink(missing_ok=True)
    _verdicts.clear()
