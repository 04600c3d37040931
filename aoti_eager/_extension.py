"""Builds and imports ``aoti_eager._C``, the C++ fast path.

``aoti_eager._C`` exists from the first call of :func:`load` on.

The extension is compiled against the torch of the running interpreter on first
use, once per (torch build, source) pair, and kept in the user's private
directory (``<private>/extension/``, see :func:`aoti_eager.cache.layout.private_root`),
whatever kernel cache a process uses; a later process imports the built library
directly, in milliseconds.

It is native code that every process loads, so it is trusted as a kernel is: its
sha256 is recorded when it is built and checked, with its owner and mode, before
it is imported. A library that fails the check (replaced, truncated) is built again.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import json
import os
import stat
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock

from aoti_eager import settings
from aoti_eager.cache import layout
from aoti_eager.cache.store import sha256_of

log = logging.getLogger("aoti_eager")

_NAME = "_C"
# Beside the library: its sha256, written when it was built.
_RECORD = "build.json"
_QUALIFIED_NAME = "aoti_eager._C"
_SOURCES = sorted((Path(__file__).resolve().parent / "csrc").glob("*.cpp")) or sorted(
    (Path(__file__).resolve().parent.parent / "csrc").glob("*.cpp")
)


def _source_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(_SOURCES + [p.with_suffix(".h") for p in _SOURCES]):
        if path.exists():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    h.update(torch.__version__.encode())
    h.update(str(torch.version.git_version).encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def build_directory() -> Path:
    return layout.private_directory("extension", layout.safe_name(f"torch-{torch.__version__}-{_source_digest()}"))


def _why_untrusted(library: Path) -> str | None:
    """None if ``library`` is this user's, writable by nobody else, and what
    was built (its sha256 matches the record); else what is wrong."""
    try:
        st = os.lstat(library)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return "not a file of this user's that only this user may write"
        recorded = json.loads(library.with_name(_RECORD).read_text())["sha256"]
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no readable record of its build ({type(e).__name__})"
    return None if sha256_of(library) == recorded else "does not match the sha256 recorded when it was built"


def _import_from(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_QUALIFIED_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_QUALIFIED_NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[_QUALIFIED_NAME] = module
    # As an import of the submodule would: the package, imported before this module, names it.
    setattr(sys.modules[_QUALIFIED_NAME.rpartition(".")[0]], "_C", module)
    return module


@lru_cache(maxsize=None)
def load() -> ModuleType:
    """Returns the ``_C`` module, building it first if this torch has none yet."""
    if not _SOURCES:
        raise RuntimeError("aoti_eager: the C++ sources (csrc/*.cpp) are missing from this installation")
    directory = build_directory()
    library = directory / f"{_NAME}.so"
    if _why_untrusted(library) is not None:
        with FileLock(str(directory / "build.lock")):
            why = _why_untrusted(library)
            if why is not None:
                if why != "missing":
                    log.warning("aoti_eager: building the C++ extension again: %s %s", library, why)
                    library.unlink(missing_ok=True)
                log.info("building the aoti_eager C++ extension for torch %s (once per torch build)", torch.__version__)
                _build(directory)
                os.chmod(library, 0o700)  # whatever the umask: a group-writable library is never loaded
                layout.atomic_write_text(library.with_name(_RECORD), json.dumps({"sha256": sha256_of(library)}))
    return _import_from(library)


def _build(directory: Path) -> None:
    from torch.utils.cpp_extension import load as build

    from aoti_eager.kernels.toolchain import cpp_compiler

    # cpp_extension builds with $CXX: make it the compiler the kernels use,
    # one whose libraries are known to work beside torch.
    user_cxx = os.environ.get("CXX")
    os.environ["CXX"] = cpp_compiler()
    try:
        build(
            name=_NAME,
            sources=[str(s) for s in _SOURCES],
            # The language standard is cpp_extension's own: torch's headers need the one it picks.
            extra_cflags=["-O3"],
            build_directory=str(directory),
            verbose=settings.verbose_build.get(),
            # Only built here; imported below under its package name.
            is_python_module=False,
        )
    finally:
        if user_cxx is None:
            del os.environ["CXX"]
        else:
            os.environ["CXX"] = user_cxx
