"""Where compiles run: a private directory at a path that compiler command lines take as it is.

Inductor joins the paths of its compiler commands without quoting them, so a
compile whose files lie under ``/data/team cache`` fails (``g++`` reads two
arguments). Compiles therefore run here, and their results are copied into the
cache when they are published; the cache root's name never reaches a command
line.

Each compile has its own directory, named after its host and process, so that
what a killed process left is removed by the next compile on that host.
Inductor's own caches and the compiler's temporary files stay under the same
root during a compile (see :func:`compiling`).

Torch internals it touches (:data:`INTERNALS`), checked with torch 2.11, 2.13
and 2.14.1: ``torch._inductor.runtime.cache_dir_utils.default_cache_dir``, to
tell the user's ``TORCHINDUCTOR_CACHE_DIR`` from Inductor's own default, and
``torch._inductor.codecache._HEADER_DIR`` and
``torch._inductor.codecache._HEADER_LOCK_DIR``, set for a compile (Inductor
fixes them at import). Where one of them has moved (``missing(INTERNALS)``),
Inductor's caches stay where Inductor puts them; the compiler's temporary
files still go to the scratch root.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Iterator

from aoti_eager.cache import layout
from aoti_eager.kernels.inductor.internals import missing

INTERNALS = (
    "torch._inductor.runtime.cache_dir_utils.default_cache_dir()",
    "torch._inductor.codecache._HEADER_DIR",
    "torch._inductor.codecache._HEADER_LOCK_DIR",
)

# What no shell or build tool splits or expands.
_SAFE_PATH = re.compile(r"[A-Za-z0-9._+/-]+")
_PREFIX = "compile-"


def _safe(path: Path) -> bool:
    return _SAFE_PATH.fullmatch(str(path)) is not None


def _owned_directory(path: Path) -> Path | None:
    """``path`` created (mode 0700) or found as this user's directory that
    nobody else may write; None where it is someone else's or not a directory."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = os.lstat(path)
    if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


@lru_cache(maxsize=None)
def root() -> Path:
    """The scratch root: ``<private>/scratch`` where its path is safe, else
    ``aoti_eager-<uid>`` in the temporary directory or ``/tmp``.

    Raises RuntimeError when none of them is a safe path this user owns.
    """
    private = layout.private_root() / "scratch"
    if _safe(private):
        return layout.private_directory("scratch")
    name = f"aoti_eager-{os.getuid()}"
    for candidate in (Path(tempfile.gettempdir()) / name, Path("/tmp") / name):
        if _safe(candidate):
            with contextlib.suppress(OSError):
                if _owned_directory(candidate) is not None:
                    return candidate
    raise RuntimeError(
        f"aoti_eager: no directory to compile in: {private} and the temporary directory have characters "
        "that compiler command lines split (set TMPDIR to a path of letters, digits and ._+-/)"
    )


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """Within the block, what a compile writes besides its results stays in
    this user's directories, so that a killed compile leaves nothing in the
    shared temporary directory: Inductor's caches (generated sources,
    precompiled headers, Triton's cache) in ``<scratch root>/inductor``, unless
    ``$TORCHINDUCTOR_CACHE_DIR`` names another place, and the temporary files
    of the processes it starts (the compiler's) in ``<scratch root>/tmp``.

    Both directories outlive the compile: Inductor keeps a pool of autotuning
    processes that inherit them and serve later compiles.
    """
    from torch._inductor import codecache

    variables = {"TMPDIR": str(_temporary())}
    attributes = {}
    if not missing(INTERNALS) and not _users_cache_directory():
        inductor = root() / "inductor"
        variables["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
        # Precompiled headers go to the default directory whatever the variable says.
        attributes = {"_HEADER_DIR": str(inductor / "precompiled_headers"),
                      "_HEADER_LOCK_DIR": str(inductor / "precompiled_headers" / "locks")}
    saved_variables = {name: os.environ.get(name) for name in variables}
    saved_attributes = {name: getattr(codecache, name) for name in attributes}
    os.environ.update(variables)
    for name, value in attributes.items():
        setattr(codecache, name, value)
    # Python reads TMPDIR once, and default_cache_dir() above has made it read it:
    # Inductor's own temporary directories (a header's preprocessing) follow tempdir.
    try:
        with python_temporary_files():
            yield
    finally:
        for name, value in saved_attributes.items():
            setattr(codecache, name, value)
        for name, value in saved_variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _users_cache_directory() -> bool:
    """Whether ``$TORCHINDUCTOR_CACHE_DIR`` is the user's choice. Inductor
    writes its default into the variable when it first needs it: only
    another value is the user's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) != default_cache_dir()


@contextlib.contextmanager
def python_temporary_files() -> Iterator[None]:
    """Within the block, Python's temporary files (:mod:`tempfile`'s) are made
    in ``<scratch root>/tmp``. It sets no environment variable, so a thread
    may use it beside others: ``setenv`` while another thread reads the
    environment in C (a library's start-up) can crash the process."""
    saved, tempfile.tempdir = tempfile.tempdir, str(_temporary())
    try:
        yield
    finally:
        tempfile.tempdir = saved


def _temporary() -> Path:
    temporary = root() / "tmp"
    temporary.mkdir(mode=0o700, exist_ok=True)
    return temporary


def compile_directory() -> tempfile.TemporaryDirectory:
    """A new directory for one compile, removed when the returned object is
    cleaned up. Directories that dead processes of this host left are removed first."""
    scratch = root()
    remove_abandoned(scratch)
    return tempfile.TemporaryDirectory(prefix=f"{layout.process_prefix('compile')}{os.getpid()}-", dir=scratch)


def remove_abandoned(scratch: Path) -> None:
    """Removes the compile directories of this host's processes that no longer run."""
    layout.remove_left_by_dead_processes(scratch, layout.process_prefix("compile"))
