"""Where the cache lives and what its keys are made of.

Layout under the root::

    <root>/v2/<environment>/<op>/<signature>/entry.json   metadata, written last
    <root>/v2/<environment>/<op>/<signature>/kernel.so    the AOTInductor library
    <root>/v2/<environment>/<op>/.lock                    one compile of this op at a time

``<environment>`` names everything that shapes an artifact besides the call
itself (device kind and capability, torch build, this package's version), so a
kernel is only ever found by a process that could have produced it. Every name
the package derives is made of ``[A-Za-z0-9._+-]`` (see :func:`safe_name`).

Apart from any cache root, each user has a private directory
(:func:`private_root`, never shared) for what is about this machine rather than
about kernels::

    <private>/machine/<cpu>-torch<version>.json           the CPU ISA, probed once
    <private>/machine/compiler-*.json                     the C++ compiler's choice and version
    <private>/extension/torch-<version>-<digest>/_C.so    the C++ extension, built once per torch build
    <private>/scratch/compile-<host>-<pid>-*/             compiles in progress
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import platformdirs
import torch

from aoti_eager import settings
from aoti_eager.version import __version__

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


def atomic_write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` so that readers see the old file or the new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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


def usable_vec_isas() -> list[str]:
    """The vector ISAs Inductor's probe found usable on this CPU, in its order
    of preference (remembered as :func:`cpu_isa` is)."""
    return _vec_isas(torch.__version__)["usable"]


def machine_record(name: str) -> Path:
    """Where a fact about this machine is remembered (in the private directory)."""
    return private_directory("machine") / name


@lru_cache(maxsize=None)
def _vec_isas(torch_version: str) -> dict:
    record = machine_record(f"{_cpu_identity()}-torch{safe_name(torch_version)}.json")
    try:
        probed = json.loads(record.read_text())
        if isinstance(probed["isa"], str) and isinstance(probed["usable"], list):
            return probed
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from torch._inductor import cpu_vec_isa

    probed = {"isa": str(cpu_vec_isa.pick_vec_isa()) or "scalar", "usable": [str(i) for i in cpu_vec_isa.valid_vec_isa_list()]}
    atomic_write_text(record, json.dumps(probed))
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
    atomic_write_text(record, json.dumps({"identity": identity}))
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
    if device.type == "cpu":
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


def environment_key(device: torch.device, compile_options: dict[str, Any] | None = None) -> str:
    """A directory name for :func:`environment_fields`: readable, then a digest
    of every field, which keeps the key exact where :func:`safe_name` is not."""
    fields = environment_fields(device, compile_options)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    capability = fields.get("isa") or fields.get("arch") or "generic"
    return safe_name(f"{device.type}-{capability}-torch{fields['torch']}-{digest}")
