"""Builds and imports ``aoti_eager._C``, the C++ fast path.

``aoti_eager._C`` exists from the first call of :func:`load` on.

The extension is compiled against the torch of the running interpreter on first
use, once per (torch build, source) pair, and kept next to the kernel cache; a
later process imports the built library directly, in milliseconds.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch
from filelock import FileLock

from aoti_eager.cache import layout

log = logging.getLogger("aoti_eager")

_NAME = "_C"
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
    return layout.default_root() / "extension" / f"torch-{torch.__version__}-{_source_digest()}"


def _import_from(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_QUALIFIED_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_QUALIFIED_NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[_QUALIFIED_NAME] = module
    import aoti_eager

    aoti_eager._C = module
    return module


@lru_cache(maxsize=None)
def load() -> ModuleType:
    """Returns the ``_C`` module, building it first if this torch has none yet."""
    if not _SOURCES:
        raise RuntimeError("aoti_eager: the C++ sources (csrc/*.cpp) are missing from this installation")
    directory = build_directory()
    library = directory / f"{_NAME}.so"
    if not library.exists():
        layout.make_cache_dirs(directory)
        with FileLock(str(directory / "build.lock")):
            if not library.exists():
                log.info("building the aoti_eager C++ extension for torch %s (once per torch build)", torch.__version__)
                _build(directory)
    return _import_from(library)


def _build(directory: Path) -> None:
    from torch.utils.cpp_extension import load as build

    from aoti_eager.kernels.toolchain import cpp_compiler

    # cpp_extension builds with $CXX: make it the compiler the kernels use,
    # one whose libraries are known to work beside torch.
    user_cxx = os.environ.get("CXX")
    os.environ["CXX"] = cpp_compiler(layout.default_root())
    try:
        build(
            name=_NAME,
            sources=[str(s) for s in _SOURCES],
            extra_cflags=["-O3", "-std=c++17"],
            build_directory=str(directory),
            verbose=os.environ.get("AOTI_EAGER_VERBOSE_BUILD") == "1",
            # Only built here; imported below under its package name.
            is_python_module=False,
        )
    finally:
        if user_cxx is None:
            del os.environ["CXX"]
        else:
            os.environ["CXX"] = user_cxx
