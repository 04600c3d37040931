"""Where the cache lives: its roots, the user's private directory, and the
names, directories and files the store makes there.

Layout under the root::

    <root>/v2/<environment>/<op>/<signature>/entry.json   metadata, written last
    <root>/v2/<environment>/<op>/<signature>/kernel.so    the AOTInductor library
    <root>/v2/<environment>/<op>/.lock                    held shared by each compile of the op, exclusively to clean up
    <root>/v2/<environment>/<op>/.lock-<signature>        one compile of a signature at a time

``<environment>`` names everything that shapes an artifact besides the call
itself (device kind and capability, compiler, torch build, this package's
version), so a kernel is only ever found by a process that could have produced
it. The store takes it as an opaque name; the compiler side derives it
(:func:`aoti_eager.kernels.toolchain.environment_name`). Every name the package
derives is made of ``[A-Za-z0-9._+-]`` (see :func:`safe_name`).

Apart from any cache root, each user has a private directory
(:func:`private_root`, never shared) for what is about this machine rather than
about kernels::

    <private>/machine/vec-isas-<cpu>-torch<version>.json  the CPU's vector ISAs, probed once (kernels/inductor/vec_isa.py)
    <private>/machine/compiler-*.json                     the C++ compiler's choice and version (kernels/toolchain.py)
    <private>/load-probe/<environment>.json               whether its kernels load without crashing here (kernels/inductor/load_probe.py)
    <private>/shared/<environment>/                       what every compile of an environment shares (kernels/inductor/wrapper_split.py)
    <private>/extension/torch-<version>-<digest>/_C.so    the C++ extension, built once per torch build (aoti_eager/_extension.py)
    <private>/scratch/compile-<host>-<pid>-*/             compiles in progress (kernels/inductor/scratch.py)
    <private>/load/load-<host>-<pid>-*/                   a verified library's copy while it is loaded (cache/store.py)
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
from pathlib import Path

import platformdirs

from aoti_eager import settings

# v2: directory names are [A-Za-z0-9._+-] only (v1 put Inductor's ISA name,
# which can hold a space, into the environment's directory name).
LAYOUT_VERSION = "v2"


def default_root() -> Path:
    """``$AOTI_EAGER_CACHE_DIR`` if set, else the platform's per-user cache dir."""
    return settings.cache_dir.get() or Path(platformdirs.user_cache_dir("aoti_eager"))


def private_root() -> Path:
    """This user's own directory for the C++ extension, what was learnt about
    this machine (compiler, CPU ISA) and compiles in progress: the platform's
    per-user cache dir, ``private/``, whatever the kernel cache root is.

    It is never shared (mode 0700, see :func:`private_directory`): a team cache
    holds kernels, which are checked before they are loaded, but nothing that
    the runtime would believe or load without checking.
    """
    return Path(platformdirs.user_cache_dir("aoti_eager")) / "private"


def machine_record(name: str) -> Path:
    """Where a fact about this machine is remembered: ``<private>/machine/<name>``."""
    return private_directory("machine") / name


def private_directory(*names: str) -> Path:
    """``private_root() / names...``, created where missing, each level
    checked: a directory (not a link) of this user's that nobody else may write.

    Raises PermissionError naming the path and what is wrong.
    """
    path = private_root()
    for name in ("", *names):
        path = path / name
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(f"aoti_eager: {path} is not a directory of this user's; remove it, then try again")
        if st.st_mode & 0o077:
            os.chmod(path, 0o700)
    return path


_UNSAFE_CHARACTER = re.compile(r"[^A-Za-z0-9._+-]")


def safe_name(text: str) -> str:
    """``text`` as a directory name that compiler command lines, shells and
    build tools take as it is: every character other than ``[A-Za-z0-9._+-]``
    becomes ``_`` (Inductor does not quote the paths of its commands, and
    names an ISA ``"avx512 avx512_vnni"``). Names made with it carry a digest
    of the exact values beside them."""
    return _UNSAFE_CHARACTER.sub("_", text)


def make_cache_dirs(path: Path) -> None:
    """Creates ``path`` and its missing parents: mode 0700, or in a shared
    cache 2770 and owned by the shared group.

    (``Path.mkdir(parents=True)`` would create the parents with the default mode.)
    """
    group = settings.cache_group.get()
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=0o700)
        except FileExistsError:
            continue
        if group is not None:
            os.chown(directory, -1, group)
            # setgid: what is created inside belongs to the group too.
            os.chmod(directory, 0o2770)


def process_prefix(kind: str) -> str:
    """``<kind>-<host>-``: names of directories that one process of this host
    uses, followed by its pid (see :func:`remove_left_by_dead_processes`)."""
    return f"{kind}-{safe_name(socket.gethostname())[:32]}-"


def remove_left_by_dead_processes(directory: Path, prefix: str) -> None:
    """Removes the subdirectories ``<prefix><pid>-*`` of ``directory`` whose
    process, of this host (see :func:`process_prefix`), no longer runs."""
    for path in directory.glob(f"{prefix}*"):
        pid = path.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process, with a pid this user's once had
    return True


def atomic_write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` so that readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
