"""Bundles: cache entries in one tar file, to build a cache once and install
it on every machine of the same kind.

A bundle's libraries are native code that will run in the importing user's
processes, so a bundle is trusted only through a signature: it holds
``<environment>/<op>/<signature>/<file>`` for each entry, as in the cache, and
``manifest.json``, the sha256 and size of every other member (``entry.json``,
the entry's metadata, among them), signed in ``manifest.sig`` (see
:mod:`aoti_eager.cache.signing`). Importing checks the signature against the
keys the user trusts and every member against the manifest before anything is
written, then installs only entries whose environment is one of this
machine's (the rest are reported as skipped), checking each artifact against
the sha256 its ``entry.json`` records, and publishes it like a fresh compile.

Nothing in a bundle is ever extracted by path: members are streamed, hashed
and size-capped, and only names of the expected form are accepted, so a
hostile bundle can neither write outside the cache nor exhaust memory.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import re
import stat
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable

from aoti_eager.cache import signing
from aoti_eager.cache.files import MAX_JSON_BYTES, copy_hashed, open_regular_file
from aoti_eager.cache.inventory import entries
from aoti_eager.cache.store import (
    ENTRY_FILE,
    ENTRY_FILES,
    LIBRARY_FILE,
    DamagedEntry,
    Entry,
    KernelCache,
    UntrustedEntry,
    op_of_dirname,
    read_entry,
    received_entry,
)

MANIFEST = "manifest.json"
MANIFEST_SIGNATURE = "manifest.sig"
MANIFEST_FORMAT = signing.MANIFEST_FORMAT
# The largest member a bundle may hold: a kernel library, and any JSON
# (entry.json, kernel.json, the manifest of every member).
MAX_LIBRARY_BYTES = 512 << 20
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


class BadBundle(Exception):
    """A bundle that is refused as a whole: not a bundle, unexpected or
    oversized members, or not signed by a trusted key."""


@dataclass
class Transfer:
    """What an export or import did, entry by entry (``environment/op/signature``)."""

    done: list[str] = field(default_factory=list)
    already_present: list[str] = field(default_factory=list)
    # (entry, why): another machine's environment, or a damaged entry.
    skipped: list[tuple[str, str]] = field(default_factory=list)
    # The fingerprint of the key that signed the bundle (None: unsigned).
    signed_by: str | None = None
    # Why an import taken with allow_unsigned is not trusted.
    untrusted_because: str | None = None


class _Hashing:
    """A file object's reader that hashes what passes through it."""

    def __init__(self, source: BinaryIO):
        self.source, self.sha256, self.bytes = source, hashlib.sha256(), 0

    def read(self, size: int = -1) -> bytes:
        data = self.source.read(size)
        self.sha256.update(data)
        self.bytes += len(data)
        return data

    def digest(self) -> dict:
        return {"sha256": self.sha256.hexdigest(), "bytes": self.bytes}


def _refuse_to_replace(path: Path) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        raise OSError(f"{path} exists and is not a regular file (a link, directory, device or pipe): not replacing it")


def export_bundle(root: Path, path: Path, signing_key: Path | None = None) -> Transfer:
    """Writes every verified entry of the cache at ``root`` into the bundle
    ``path``, signed with the private key ``signing_key`` if given."""
    _refuse_to_replace(path)
    transfer = Transfer()
    members: dict[str, dict] = {}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    try:
        with os.fdopen(fd, "wb") as out, tarfile.open(fileobj=out, mode="w:gz") as tar:
            for listing in entries(root):
                name = "/".join(listing.directory.parts[-3:])
                try:
                    if read_entry(listing.directory, root) is None:
                        continue  # removed meanwhile
                    # All of an entry's files are opened before any is added:
                    # an entry is in the bundle whole or not at all.
                    with contextlib.ExitStack() as opened:
                        files = {file: opened.enter_context(open_regular_file(listing.directory / file))
                                 for file in ENTRY_FILES if os.path.lexists(listing.directory / file)}
                        for file, source in files.items():
                            members[f"{name}/{file}"] = _add(tar, f"{name}/{file}", source, os.fstat(source.fileno()).st_size)
                except (DamagedEntry, UntrustedEntry, OSError) as e:
                    transfer.skipped.append((name, str(e)))
                    continue
                transfer.done.append(name)
            manifest = signing.manifest_of(members)
            _add_bytes(tar, MANIFEST, manifest)
            if signing_key is not None:
                signature = signing.sign(manifest, signing_key)
                _add_bytes(tar, MANIFEST_SIGNATURE, signature)
                transfer.signed_by = signing.signer(signature)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return transfer


def _add(tar: tarfile.TarFile, name: str, source: BinaryIO, size: int) -> dict:
    """Adds ``size`` bytes of ``source`` as ``name``; returns their sha256 and size."""
    info = tarfile.TarInfo(name)
    info.size, info.mode = size, 0o644
    hashing = _Hashing(source)
    tar.addfile(info, hashing)
    return hashing.digest()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    _add(tar, name, io.BytesIO(data), len(data))


@dataclass
class _Contents:
    """What pass one over a bundle found, before anything is written."""

    # environment/op/signature -> file name -> member
    entries: dict[str, dict[str, tarfile.TarInfo]] = field(default_factory=dict)
    # member name -> {"sha256", "bytes"}, as read
    digests: dict[str, dict] = field(default_factory=dict)
    manifest: bytes | None = None
    signature: bytes | None = None


def _size_limit(name: str) -> int:
    return MAX_LIBRARY_BYTES if name.endswith(".so") else MAX_JSON_BYTES


def _check_member(member: tarfile.TarInfo) -> list[str]:
    """The member's name in parts; BadBundle for a member no bundle holds."""
    parts = member.name.split("/")
    expected = (member.name in (MANIFEST, MANIFEST_SIGNATURE)
                or (len(parts) == 4 and parts[3] in ENTRY_FILES and all(_NAME.fullmatch(p) for p in parts)))
    if not member.isfile() or not expected:
        raise BadBundle(f"unexpected member {member.name!r}: not an aoti_eager cache bundle, nothing imported")
    if member.size > _size_limit(member.name):
        raise BadBundle(f"member {member.name!r} claims {member.size} bytes, more than the "
                        f"{_size_limit(member.name)} a bundle member of its kind may hold; nothing imported")
    return parts


def _copy(tar: tarfile.TarFile, member: tarfile.TarInfo, target: BinaryIO | None) -> dict:
    """Streams ``member`` into ``target`` (or nowhere); its sha256 and size."""
    return copy_hashed(tar.extractfile(member), target)


def _scan(tar: tarfile.TarFile) -> _Contents:
    """Pass one: every member's name, size and sha256, read as a stream; each
    header is checked before its data is read."""
    contents = _Contents()
    seen: set[str] = set()
    for member in tar:
        parts = _check_member(member)
        if member.name in seen:
            raise BadBundle(f"member {member.name!r} appears twice; nothing imported")
        seen.add(member.name)
        if member.name == MANIFEST:
            contents.manifest = tar.extractfile(member).read()  # size checked above
        elif member.name == MANIFEST_SIGNATURE:
            contents.signature = tar.extractfile(member).read()
        else:
            contents.digests[member.name] = _copy(tar, member, None)
            contents.entries.setdefault("/".join(parts[:3]), {})[parts[3]] = member
    return contents


def _check_signature(contents: _Contents, trusted_keys: list[Path]) -> str:
    """The fingerprint of the trusted key that signed the manifest, every
    member matching it; SignatureError saying why not."""
    return signing.check_manifest(contents.manifest, contents.signature, contents.digests, trusted_keys)


def import_bundle(
    root: Path, path: Path, environments: Iterable[str], trusted_keys: list[Path], allow_unsigned: bool = False
) -> Transfer:
    """Publishes the entries of the bundle ``path`` that fit this machine into
    the cache at ``root``: those of ``environments``, the names of this
    machine's environments (see :func:`aoti_eager.kernels.toolchain.environment_name`).

    The bundle must be signed by one of ``trusted_keys`` (public key files),
    every member matching the signed manifest, unless ``allow_unsigned``
    (then ``untrusted_because`` says why it is not trusted). Raises BadBundle,
    before writing anything, for a bundle that is refused.
    """
    transfer = Transfer()
    with open_regular_file(path, follow_link=True) as file:
        try:
            with tarfile.open(fileobj=file, mode="r:*") as tar:
                contents = _scan(tar)
                try:
                    transfer.signed_by = _check_signature(contents, trusted_keys)
                except signing.SignatureError as e:
                    if not allow_unsigned:
                        raise BadBundle(
                            f"{path} is refused, nothing imported: {e}. A bundle's kernels are native code that "
                            "would run in this user's processes: import only bundles signed by a key you trust "
                            "(--trust-key KEY.pub, or $AOTI_EAGER_TRUSTED_KEYS), or pass --allow-unsigned") from None
                    transfer.untrusted_because = str(e)
                caches = {environment: KernelCache(root, environment) for environment in environments}
                for name, files in contents.entries.items():
                    cache = caches.get(name.split("/")[0])
                    if cache is None:
                        transfer.skipped.append((name, "built for another environment (torch, compiler, CPU or GPU)"))
                        continue
                    try:
                        published = _install(cache, name, tar, files, contents.digests)
                    except (DamagedEntry, UntrustedEntry) as e:
                        transfer.skipped.append((name, str(e)))
                        continue
                    (transfer.done if published else transfer.already_present).append(name)
        except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise BadBundle(f"{path} is not a readable bundle (truncated, damaged or not a tar file): {e}") from None
    return transfer


def _install(cache: KernelCache, name: str, tar: tarfile.TarFile, files: dict[str, tarfile.TarInfo],
             digests: dict[str, dict]) -> bool:
    """Publishes one entry of the bundle, under its op's lock; False if the cache has it already."""
    _, op_dir, key = name.split("/")
    op = op_of_dirname(op_dir)
    with cache.lock_signature(op, key):
        if cache.lookup(op, key) is not None:
            return False
        with cache.temporary_directory(op) as workdir:
            paths = {}
            for file, member in files.items():
                paths[file] = Path(workdir, file)
                with open(paths[file], "wb") as target:
                    if _copy(tar, member, target) != digests[member.name]:
                        raise DamagedEntry(f"{member.name} changed while it was imported")
            library = digests.get(f"{name}/{LIBRARY_FILE}")
            entry, paths = received_entry(op, paths, library["sha256"] if library else None)
            cache.publish(key, entry, paths)
    return True
