"""Bundles: cache entries in one tar file, to build a cache once and install
it on every machine of the same kind.

A bundle holds ``<environment>/<op>/<signature>/<file>`` for each entry, as in
the cache. Importing installs only entries whose environment is one of this
machine's (the rest are reported as skipped), checks each artifact against the
sha256 its ``entry.json`` records, and publishes it like a fresh compile.
Nothing in a bundle is ever extracted by path: members are read into memory
and only names of the expected form are accepted, so a hostile bundle cannot
write outside the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from aoti_eager.cache import layout
from aoti_eager.cache.inventory import entries
from aoti_eager.cache.store import (
    ENTRY_FILE,
    LIBRARY_FILE,
    DamagedEntry,
    Entry,
    KernelCache,
    UntrustedEntry,
    op_of_dirname,
    read_entry,
)

# What an entry directory may hold (kernel.json: ops left to the dispatcher).
ENTRY_FILES = (ENTRY_FILE, LIBRARY_FILE, "kernel.json")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


class BadBundle(Exception):
    """A file that is not a bundle, or holds members a bundle never holds."""


@dataclass
class Transfer:
    """What an export or import did, entry by entry (``environment/op/signature``)."""

    done: list[str] = field(default_factory=list)
    already_present: list[str] = field(default_factory=list)
    # (entry, why): another machine's environment, or a damaged entry.
    skipped: list[tuple[str, str]] = field(default_factory=list)


def export_bundle(root: Path, path: Path) -> Transfer:
    """Writes every verified entry of the cache at ``root`` into the bundle ``path``."""
    transfer = Transfer()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            for listing in entries(root):
                name = "/".join(listing.directory.parts[-3:])
                try:
                    if read_entry(listing.directory, root) is None:
                        continue  # removed meanwhile
                    for file in ENTRY_FILES:
                        if (listing.directory / file).exists():
                            tar.add(listing.directory / file, arcname=f"{name}/{file}", recursive=False)
                except (DamagedEntry, UntrustedEntry, OSError) as e:
                    transfer.skipped.append((name, str(e)))
                    continue
                transfer.done.append(name)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return transfer


def _members(tar: tarfile.TarFile) -> dict[str, dict[str, tarfile.TarInfo]]:
    """``environment/op/signature`` -> file name -> member; BadBundle for anything else."""
    grouped: dict[str, dict[str, tarfile.TarInfo]] = {}
    for member in tar.getmembers():
        parts = member.name.split("/")
        if not member.isfile() or len(parts) != 4 or parts[3] not in ENTRY_FILES or not all(
            _NAME.fullmatch(p) for p in parts
        ):
            raise BadBundle(f"unexpected member {member.name!r}: not an aoti_eager cache bundle, nothing imported")
        grouped.setdefault("/".join(parts[:3]), {})[parts[3]] = member
    return grouped


def local_caches(root: Path) -> dict[str, KernelCache]:
    """This machine's caches under ``root`` by environment name, one per device type here."""
    import torch

    from aoti_eager.kernels.compile import compile_options

    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    caches = [KernelCache(root, torch.device(d), compile_options(d, root)) for d in devices]
    return {cache.directory.name: cache for cache in caches}


def import_bundle(root: Path, path: Path) -> Transfer:
    """Publishes the entries of the bundle ``path`` that fit this machine into the cache at ``root``.

    Raises BadBundle, before importing anything, for a file that is not a bundle.
    """
    transfer = Transfer()
    caches = local_caches(root)
    try:
        tar = tarfile.open(path)
    except tarfile.TarError as e:
        raise BadBundle(f"{path} is not a tar file: {e}") from None
    with tar:
        for name, files in sorted(_members(tar).items()):
            environment, op_dir, key = name.split("/")
            cache = caches.get(environment)
            if cache is None:
                transfer.skipped.append((name, "built for another environment (torch, compiler, CPU or GPU)"))
                continue
            try:
                if cache.lookup(op_of_dirname(op_dir), key) is not None:
                    transfer.already_present.append(name)
                    continue
                _publish(cache, op_of_dirname(op_dir), key, {f: tar.extractfile(m).read() for f, m in files.items()})
            except (DamagedEntry, UntrustedEntry) as e:
                transfer.skipped.append((name, str(e)))
                continue
            transfer.done.append(name)
    return transfer


def _publish(cache: KernelCache, op: str, key: str, contents: dict[str, bytes]) -> None:
    try:
        data = json.loads(contents[ENTRY_FILE])
        entry = Entry(**{**data, "library": None})
    except (KeyError, ValueError, TypeError) as e:
        raise DamagedEntry(f"no readable {ENTRY_FILE}: {e}") from None
    if entry.op != op:
        raise DamagedEntry(f"{ENTRY_FILE} names {entry.op!r}, not {op!r}")
    if data.get("library") is not None:
        if LIBRARY_FILE not in contents or hashlib.sha256(contents[LIBRARY_FILE]).hexdigest() != entry.sha256:
            raise DamagedEntry("artifact does not match its recorded sha256")
    else:
        contents.pop(LIBRARY_FILE, None)
    with tempfile.TemporaryDirectory(prefix="aoti_eager-import-") as workdir:
        files = {}
        for name, content in contents.items():
            if name != ENTRY_FILE:
                files[name] = Path(workdir, name)
                files[name].write_bytes(content)
        if LIBRARY_FILE in files:
            entry.library = files[LIBRARY_FILE]
        layout.make_cache_dirs(cache.directory)
        cache.publish(key, entry, files)
