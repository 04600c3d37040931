"""The local filesystem store of kernels: lookup, per-op locks, atomic
publication, removal (:class:`KernelCache`, an
:class:`~aoti_eager.cache.entry_store.EntryStore`).

An entry is a directory named by its signature digest. It is assembled under a
temporary name inside the op's directory and published with one ``rename``, so
a reader sees either no entry or a complete one; ``entry.json`` carries the
sha256 of the library and of the files beside it, the op and key it was
published for and a digest of its own fields, all checked before the library
is loaded, and what the C++ side takes from it is checked against the op's
schema. The library is loaded from a private copy made from the very
descriptor that was hashed (:meth:`KernelCache.hold`), so a file swapped
after the check never runs; in a shared cache, an entry that another member
wrote is loaded only when a trusted key signed it (:func:`check_signed`).
Removal is a rename to a temporary name too, and leaves alone an entry that a
process is loading.

A remote tier plugs in as ``KernelCache.behind``, a
:class:`~aoti_eager.cache.entry_store.RemoteTier` (the fleet cache,
:mod:`aoti_eager.cache.remote`): on a local miss :meth:`KernelCache.lookup`
fetches the entry from it into a temporary directory of the op, publishes it
here and answers with the local copy, read back and checked like any local
entry, so that the C++ hit path only ever loads local, checked files. What the
tier returns it has verified itself (its signature). A local publication is
offered to it, and :meth:`KernelCache.lock_signature` holds its lock too, so
that a signature is compiled once by the whole fleet.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch
from filelock import FileLock, Timeout

from aoti_eager import settings
from aoti_eager.cache import files as cache_files
from aoti_eager.cache import layout, signing
from aoti_eager.cache.entry_store import Entry, EntryStore, RemoteTier, metadata_digest

log = logging.getLogger("aoti_eager")

ENTRY_FILE = "entry.json"
LIBRARY_FILE = "kernel.so"
# Beside the library (kernel.json: ops left to the dispatcher; a region's training kernel: its backward's library).
SIDECAR_FILES = ("kernel.json", "backward.so", "backward.json")
# What an entry directory may hold.
ENTRY_FILES = (ENTRY_FILE, LIBRARY_FILE, *SIDECAR_FILES)
# In a shared cache: the publisher's signature of the entry's files (see read_entry).
ENTRY_SIGNATURE = "entry.sig"
# Directories being assembled or removed; never an entry.
TEMPORARY_PREFIX = ".tmp-"


def sha256_of(path: Path) -> str:
    with cache_files.open_regular_file(path) as f:
        return cache_files.copy_hashed(f)["sha256"]


class UntrustedEntry(Exception):
    """An entry that someone else could have written: it is never loaded."""


class UnsignedEntry(UntrustedEntry):
    """A shared cache's entry that another member wrote and no trusted key
    signed: not loaded here, and left in place for the members who trust it."""


class DamagedEntry(Exception):
    """An entry that is incomplete or does not match its recorded sha256."""


def check_trusted(path: Path, root: Path) -> int:
    """Raises UntrustedEntry unless ``path`` and every directory between it and
    ``root`` could only have been written by this user (or, in a shared cache,
    by the shared group: ``$AOTI_EAGER_CACHE_GROUP``), and none of them is
    a symbolic link (the root itself may be one). Returns the owner of ``path``."""
    group = settings.cache_group.get()
    current = path
    owner = None
    while True:
        st = current.stat() if current == root else current.lstat()
        owner = st.st_uid if owner is None else owner
        if stat.S_ISLNK(st.st_mode):
            raise UntrustedEntry(f"{current} is a symbolic link: nothing in the cache is reached through a link")
        shared = group is not None and st.st_gid == group
        if st.st_uid != os.getuid() and not shared:
            raise UntrustedEntry(f"{current} belongs to uid {st.st_uid}, not to this user")
        if st.st_mode & (0o002 if shared else 0o022):
            who = "others" if shared else "group or others"
            raise UntrustedEntry(f"{current} is writable by {who} (mode {st.st_mode & 0o777:o})")
        if current == root or current.parent == current:
            return owner
        current = current.parent


# (root, shared group) whose parents check_parents found sound in this process.
_parents_checked: set[tuple[Path, int | None]] = set()


def check_parents(root: Path) -> None:
    """Raises UntrustedEntry unless every directory above ``root`` (on the
    path it is named by and on its real path) belongs to root or this user
    (in a shared cache, or to the shared group) and is writable by others
    only with the sticky bit: nobody else can move the cache away and put
    another in its place."""
    group = settings.cache_group.get()
    if (root, group) in _parents_checked:
        return  # only root, or their owner, could change them since
    for parent in {*Path(os.path.abspath(root)).parents, *Path(os.path.realpath(root)).parents}:
        try:
            st = parent.stat()
        except FileNotFoundError:
            continue  # made by this user with the cache
        if st.st_uid not in (0, os.getuid()) and not (group is not None and st.st_gid == group):
            raise UntrustedEntry(f"{parent}, above the cache {root}, belongs to uid {st.st_uid}, "
                                 "who could put another cache in its place")
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise UntrustedEntry(f"{parent}, above the cache {root}, is writable by others without the sticky "
                                 f"bit (mode {st.st_mode & 0o7777:o}): anyone could put another cache in its place")
    _parents_checked.add((root, group))


def read_entry(directory: Path, root: Path, copy_as: Path | None = None) -> Entry | None:
    """The entry published in ``directory``, its artifact verified against its
    sha256; None if there is none.

    With ``copy_as`` (a new path in a private directory, see
    :func:`_copied_name`), the library and its sidecar files are copied there
    from the descriptors they are hashed through, and the entry's ``library``
    is the copy: what is loaded is exactly what was verified, whatever
    happens to the cache meanwhile. An entry that another
    user wrote (a shared cache's) must be signed by a trusted key (see
    :func:`check_signed`).

    Raises UntrustedEntry (see :func:`check_trusted`) or DamagedEntry.
    """
    try:
        owners = {check_trusted(directory, root), *(check_trusted(path, directory) for path in directory.iterdir())}
    except FileNotFoundError:
        return None  # none, or removed meanwhile
    try:
        raw = cache_files.read_capped(directory / ENTRY_FILE)
        data = cache_files.load_json(raw)
    except FileNotFoundError:
        if not directory.exists():
            return None
        raise DamagedEntry(f"{ENTRY_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise DamagedEntry(f"unreadable {ENTRY_FILE}: {e}") from None
    digests = {ENTRY_FILE: signing.file_digest(raw)}
    try:
        entry = Entry(**{**data, "library": None})
        library = data["library"]
    except (TypeError, KeyError) as e:
        raise DamagedEntry(f"incomplete entry: {type(e).__name__}: {e}") from None
    if library is not None:
        if library != LIBRARY_FILE:
            raise DamagedEntry(f"{ENTRY_FILE} names the library {library!r}, not {LIBRARY_FILE!r}")
        digests.update(_read_library(directory, copy_as))
        if digests[LIBRARY_FILE]["sha256"] != entry.sha256:
            raise DamagedEntry("artifact does not match its recorded sha256")
        entry.library = copy_as or directory / LIBRARY_FILE
    if entry.metadata_sha256 != metadata_digest(data):
        raise DamagedEntry(f"{ENTRY_FILE} does not match its recorded digest (edited, or written by an older version)")
    check_recorded_place(directory, entry, digests)
    if entry.library is not None:
        check_output_counts(entry.op, entry.output_counts)
    if owners != {os.getuid()}:
        check_signed(directory, digests, max(owners - {os.getuid()}))
    return entry


def check_recorded_place(directory: Path, entry: Entry, digests: dict[str, dict]) -> None:
    """Raises DamagedEntry unless ``entry`` was published for the op and key of
    ``directory`` (a member of a shared cache can rename a directory it did not
    write) and the files beside its library are those it recorded.

    An entry of an older version records neither: accepted in a private cache,
    which only this user could have rearranged; damaged (compiled again) in a
    shared one."""
    if entry.signature_key is None:
        if settings.cache_group.get() is not None:
            raise DamagedEntry(f"{ENTRY_FILE} does not record the key it was published for (written by an older "
                               "version): in a shared cache it could have been moved from another key")
        return
    if (op_dirname(entry.op), entry.signature_key) != (directory.parent.name, directory.name):
        raise DamagedEntry(f"{ENTRY_FILE} was published for {entry.op} {entry.signature_key}, not for where it is")
    if entry.library is not None:
        found = {name: digests[name]["sha256"] for name in SIDECAR_FILES if name in digests}
        recorded = entry.sidecar_sha256 or {}
        differ = sorted(name for name in {*found, *recorded} if found.get(name) != recorded.get(name))
        if differ:
            raise DamagedEntry(f"the files beside the library ({', '.join(differ)}) do not match their recorded sha256")


def _copied_name(copy_as: Path, name: str) -> Path:
    """Where the entry's file ``name`` is copied when its library is copied
    to ``copy_as``: beside it, with the same stem, as AOTInductor's runner
    looks for its JSON file (``kernel.json`` -> ``<stem>.json``,
    ``backward.so`` -> ``<stem>-backward.so``)."""
    stem = Path(name).stem
    return copy_as.with_name(copy_as.stem + ("" if stem == Path(LIBRARY_FILE).stem else f"-{stem}") + Path(name).suffix)


def beside(library: Path, name: str) -> Path:
    """The entry's file ``name`` beside its ``library``, as a read entry
    gives it (in the entry's directory, or copied with it)."""
    return library.with_name(name) if library.name == LIBRARY_FILE else _copied_name(library, name)


def _read_library(directory: Path, copy_as: Path | None) -> dict[str, dict]:
    """The digests (:func:`signing.file_digest`) of the library and its sidecar
    files, each hashed through the descriptor it was opened with, and copied
    from it (see :func:`_copied_name`) if ``copy_as`` is given.

    Raises DamagedEntry for files that cannot be opened; an OSError while
    copying is the copy's (its disk is full, say), not the entry's.
    """
    digests = {}
    with contextlib.ExitStack() as opened:
        sources = {}
        for name in (LIBRARY_FILE, *SIDECAR_FILES):
            try:
                sources[name] = opened.enter_context(cache_files.open_regular_file(directory / name))
            except FileNotFoundError as e:
                if name == LIBRARY_FILE:
                    raise DamagedEntry(f"incomplete entry: FileNotFoundError: {e}") from None
            except OSError as e:
                raise DamagedEntry(f"unreadable {name}: {e}") from None
        for name, source in sources.items():
            target = opened.enter_context(open(_copied_name(copy_as, name), "xb")) if copy_as else None
            digests[name] = cache_files.copy_hashed(source, target)
    return digests


def _member(directory: Path, name: str) -> str:
    """A file's name in an entry's manifest, as bundles and the fleet cache
    name it (``<environment>/<op>/<signature>/<file>``): bound to its key."""
    return "/".join((*directory.parts[-3:], name))


def _entry_manifest(members: dict[str, dict]) -> bytes:
    """The manifest an entry's signature covers: made again by every reader,
    so with a fixed creation time (entry.json, a member, records the entry's)."""
    return signing.manifest_of(members, created=0.0)


def check_signed(directory: Path, digests: dict[str, dict], owner: int) -> None:
    """Raises UntrustedEntry unless the entry in ``directory``, whose files
    have ``digests``, is signed (:data:`ENTRY_SIGNATURE`) by a key of
    ``$AOTI_EAGER_TRUSTED_KEYS``: in a shared cache, what another member
    (``owner``) wrote is native code that nobody here checked."""
    members = {_member(directory, name): digest for name, digest in digests.items()}
    try:
        try:
            signature = cache_files.read_capped(directory / ENTRY_SIGNATURE)
        except FileNotFoundError:
            signature = None
        signing.trusted_signer(_entry_manifest(members), signature, settings.trusted_keys.get())
    except (OSError, signing.SignatureError, signing.KeyFileError) as e:
        raise UnsignedEntry(
            f"{directory} was written by uid {owner}, another user, and {e}: a shared cache's entry that another "
            f"member wrote is loaded only when a key of ${settings.trusted_keys.name} signed it (its publisher sets "
            f"${settings.signing_key.name})") from None


def sign_entry(directory: Path, place: Path) -> None:
    """In a shared cache, with ``$AOTI_EAGER_SIGNING_KEY`` set, signs the
    entry assembled in ``directory`` for its ``place`` (see :func:`check_signed`)."""
    key = settings.signing_key.get()
    if settings.cache_group.get() is None or key is None:
        return
    members = {}
    for name in ENTRY_FILES:
        if (directory / name).exists():
            with cache_files.open_regular_file(directory / name) as f:
                members[_member(place, name)] = cache_files.copy_hashed(f)
    try:
        signature = signing.sign(_entry_manifest(members), key)
    except signing.KeyFileError as e:
        log.warning("aoti_eager: the entry %s is published unsigned, which other members of the shared cache "
                    "will not load: %s", place, e)
        return
    (directory / ENTRY_SIGNATURE).write_bytes(signature)


def received_entry(op: str, files: dict[str, Path], library_sha256: str | None) -> tuple[Entry, dict[str, Path]]:
    """The entry that ``files`` (name -> path), received from elsewhere (a
    bundle, the fleet cache) and checked against their signed manifest, make
    up; with the files to publish beside it (see :meth:`KernelCache.publish`).

    ``library_sha256`` is the sha256 of the library as received. Raises
    DamagedEntry for files that are no entry of ``op``, or a library other
    than the one its ``entry.json`` records.
    """
    files = dict(files)
    try:
        data = cache_files.load_json(cache_files.read_capped(files.pop(ENTRY_FILE)))
        entry = Entry(**{**data, "library": None})
    except (KeyError, ValueError, TypeError, OSError) as e:
        raise DamagedEntry(f"no readable {ENTRY_FILE}: {e}") from None
    if entry.op != op:
        raise DamagedEntry(f"{ENTRY_FILE} names {entry.op!r}, not {op!r}")
    if data.get("library") is None:
        files.pop(LIBRARY_FILE, None)
    elif LIBRARY_FILE not in files or library_sha256 != entry.sha256:
        raise DamagedEntry("artifact does not match its recorded sha256")
    else:
        entry.library = files[LIBRARY_FILE]
    return entry, files


def in_place(root: Path, path: Path) -> bool:
    """Whether ``path``, below ``root``, is reached from it through no symbolic
    link (``path`` itself included): what may be removed or moved as part of
    the cache."""
    real_root = os.path.realpath(root)
    return os.path.realpath(path) == os.path.normpath(os.path.join(real_root, os.path.relpath(path, root)))


def remove_tree(root: Path, path: Path) -> None:
    """Removes ``path`` from the cache at ``root``: a directory with what it
    holds, or a symbolic link (the link, never what it points to). Nothing is
    removed through a link, so nothing outside the cache is ever touched."""
    if not in_place(root, path.parent):
        log.warning("aoti_eager: not removing %s: a symbolic link leads it out of the cache %s", path, root)
    elif path.is_symlink():
        log.warning("aoti_eager: removing the symbolic link %s (-> %s); what it points to is left alone",
                    path, os.readlink(path))
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)  # by file descriptors: never follows a link inside


def _overload(op: str) -> torch._ops.OpOverload | None:
    """The overload named ``aten::add.Tensor`` (``aten::abs``: the default one), if this process has it."""
    namespace, _, name = op.partition("::")
    base, _, overload = name.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), base), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def check_output_counts(op: str, output_counts: Any) -> None:
    """Raises DamagedEntry unless ``output_counts`` describes the returns of
    ``op``'s schema as the C++ side reads them (csrc/compiled_kernel.h): 0
    for a return that hands back a mutated argument, -1 for a Tensor, N >= 0
    for a Tensor[] of N tensors."""
    overload = _overload(op)
    if overload is None:
        return  # an op this process cannot override: nothing will load it
    returns = overload._schema.returns
    if not isinstance(output_counts, list) or len(output_counts) != len(returns):
        raise DamagedEntry(f"output_counts {output_counts!r} does not describe the {len(returns)} returns of {op}")
    for ret, count in zip(returns, output_counts):
        if ret.alias_info is not None and ret.alias_info.is_write:
            valid = count == 0
        elif isinstance(ret.type, torch.ListType):
            valid = type(count) is int and count >= 0
        else:
            valid = count == -1
        if type(count) is not int or not valid:
            raise DamagedEntry(f"output_counts {output_counts!r} does not match the return {ret} of {op}")


def set_aside(root: Path, directory: Path, reason: str) -> None:
    """Moves a damaged entry to ``<root>/quarantine``, with a log line saying
    why (a symbolic link in its place is removed instead, see :func:`remove_tree`)."""
    if not in_place(root, directory):
        remove_tree(root, directory)
        return
    quarantine = root / "quarantine" / f"{directory.name}-{uuid.uuid4().hex[:8]}"
    log.warning("aoti_eager: cache entry %s set aside: %s", directory, reason)
    try:
        layout.make_cache_dirs(quarantine.parent)
        os.rename(directory, quarantine)
    except OSError:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _flock(directory: Path, operation: int) -> Iterator[bool]:
    """Holds an flock on ``directory``; yields whether it was taken (False: the
    directory is gone, or LOCK_NB and someone else holds it)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # gone, or a symbolic link: never an entry
        yield False
        return
    try:
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def remove_entry(root: Path, directory: Path) -> bool:
    """Removes an entry of the cache at ``root`` unless a process is loading it
    (see :meth:`KernelCache.in_use`); a symbolic link in its place is removed
    as :func:`remove_tree` does.

    The entry is first renamed to a temporary name, so that a reader never
    sees it half removed and a process killed meanwhile leaves only what
    :meth:`KernelCache.remove_abandoned` cleans up.
    """
    if not in_place(root, directory):
        remove_tree(root, directory)
        return not os.path.lexists(directory)
    with _flock(directory, fcntl.LOCK_EX | fcntl.LOCK_NB) as locked:
        if not locked:
            return not directory.exists()
        doomed = directory.with_name(f"{TEMPORARY_PREFIX}{uuid.uuid4().hex}")
        os.rename(directory, doomed)
    remove_tree(root, doomed)
    return True


# In each op's directory: held shared by every compile of the op, exclusively to clean up.
OP_LOCK = ".lock"
# In each op's directory, then the signature's key: one compile of the signature at a time.
SIGNATURE_LOCK_PREFIX = ".lock-"


def _lock_mode() -> int:
    return 0o600 if settings.cache_group.get() is None else 0o660


def _lock_file(path: Path, timeout: float = -1) -> FileLock:
    """An exclusive flock on ``path`` (see :meth:`KernelCache.lock_signature`)."""
    return FileLock(str(path), timeout=timeout, mode=_lock_mode())


def _open_lock(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, _lock_mode())
    with contextlib.suppress(PermissionError):  # another member's lock file
        os.fchmod(fd, _lock_mode())  # whatever the umask
    return fd


def _wait_flock(fd: int, operation: int, path: Path, deadline: float | None) -> None:
    """Takes an flock on ``fd``; raises filelock.Timeout once ``deadline``
    (time.monotonic) has passed (None: waits forever)."""
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if deadline is not None and deadline <= time.monotonic():
                raise Timeout(str(path)) from None
            time.sleep(0.05)


def _deadline(timeout: float) -> float | None:
    return None if timeout < 0 else time.monotonic() + timeout


@contextlib.contextmanager
def _shared_flock(path: Path, timeout: float = -1) -> Iterator[None]:
    """A shared flock on the lock file ``path``, which only a cleanup or the
    command line holds exclusively; raises filelock.Timeout after ``timeout``
    seconds (< 0: waits forever)."""
    fd = _open_lock(path)
    try:
        _wait_flock(fd, fcntl.LOCK_SH, path, _deadline(timeout))
        yield
    finally:
        os.close(fd)


def _is_at(fd: int, path: Path) -> bool:
    """Whether ``path`` is still the file open as ``fd``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


@contextlib.contextmanager
def _removed_lock(path: Path, timeout: float = -1) -> Iterator[None]:
    """An exclusive flock on the lock file ``path``, which is removed when it
    is released, so that locks of signatures done with do not pile up.

    Whoever removes the file holds its lock; whoever takes the lock checks
    that the file is still at ``path`` and otherwise locks the new one, so
    two holders never hold "the" lock through two files. Raises
    filelock.Timeout after ``timeout`` seconds (< 0: waits forever).
    """
    deadline = _deadline(timeout)
    while True:
        fd = _open_lock(path)
        try:
            _wait_flock(fd, fcntl.LOCK_EX, path, deadline)
        except BaseException:
            os.close(fd)
            raise
        if _is_at(fd, path):
            break
        os.close(fd)  # removed by its holder meanwhile
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # while held: a waiting process then finds it gone
        os.close(fd)


def remove_idle_lock(path: Path) -> None:
    """Removes the signature lock ``path`` unless someone holds it (one a
    killed process left), as :func:`_removed_lock` does."""
    with contextlib.suppress(OSError, Timeout), _removed_lock(path, timeout=0):
        pass


# pid -> this process's directory of library copies (see _load_copy).
_load_directories: dict[int, Path] = {}


def _load_directory() -> Path:
    """This process's directory in the user's private one, where verified
    libraries are copied to be loaded; made once per process (those that
    killed processes of this host left are removed then) and removed at exit."""
    path = _load_directories.get(os.getpid())
    if path is None or not path.is_dir():
        parent, mine = layout.private_directory("load"), layout.process_prefix("load")
        layout.remove_left_by_dead_processes(parent, mine)
        path = parent / f"{mine}{os.getpid()}-{uuid.uuid4().hex}"
        path.mkdir(mode=0o700)
        _load_directories[os.getpid()] = path
        atexit.register(_remove_load_directory, os.getpid(), path)
    return path


def _remove_load_directory(pid: int, path: Path) -> None:
    if os.getpid() == pid:  # not a forked child's exit: the directory is its parent's
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _load_copy() -> Iterator[Path]:
    """A new name in :func:`_load_directory` for one library's copy; the
    copy and its sidecar files are removed after the block (a loaded library
    stays mapped)."""
    copy_as = _load_directory() / f"{uuid.uuid4().hex}.so"
    try:
        yield copy_as
    finally:
        for name in (LIBRARY_FILE, *SIDECAR_FILES):
            _copied_name(copy_as, name).unlink(missing_ok=True)


def op_lock(op_dir: Path, timeout: float = -1) -> FileLock:
    """The op's lock (:data:`OP_LOCK`), exclusively: no compile of the op is under way while it is held."""
    return _lock_file(op_dir / OP_LOCK, timeout)


def op_dirname(op: str) -> str:
    return op.replace("::", ".")


def op_of_dirname(name: str) -> str:
    return name.replace(".", "::", 1)


def _directories(path: Path) -> list[os.DirEntry]:
    """The subdirectories of ``path``, links not followed, hidden ones left out."""
    try:
        with os.scandir(path) as found:
            return [e for e in found if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
    except (FileNotFoundError, NotADirectoryError):
        return []


class KernelCache(EntryStore):
    """The entries of one cache root for one environment: a directory name
    that the compiler side derives from everything that shapes a kernel
    besides the call (see :func:`aoti_eager.kernels.toolchain.environment_name`)."""

    def __init__(self, root: Path, environment: str):
        self.root = Path(root)
        self.directory = self.root / layout.LAYOUT_VERSION / environment
        # The tier a local miss is looked up in (see the module's docstring).
        self.behind: RemoteTier | None = None

    def _op_dir(self, op: str) -> Path:
        return self.directory / op_dirname(op)

    def entry_dir(self, op: str, signature_key: str) -> Path:
        return self._op_dir(op) / signature_key

    @contextlib.contextmanager
    def lock_signature(self, op: str, signature_key: str, timeout: float = -1) -> Iterator[None]:
        """Held while the entry of one signature is compiled and published:
        each signature is compiled once, and other signatures of the op at the
        same time, in this process or others.

        The signature's own lock orders its compiles. The op's lock is held
        shared meanwhile, so that :meth:`remove_abandoned`, which takes it
        exclusively and without waiting, never removes what a living compile
        is assembling. Both are flocks: the kernel releases them when their
        holder dies, however it dies, so a lock is never stale. ``timeout``
        < 0 waits forever for the signature's lock (raises TimeoutError).
        Then the signature's lock of the tier behind, if any (across machines).
        """
        with self.signature_lock(op, signature_key, timeout):
            self.remove_abandoned(op)
            with _shared_flock(self._op_dir(op) / OP_LOCK, timeout):
                if self.behind is None:
                    yield
                else:
                    with self.behind.lock_signature(op, signature_key, timeout):
                        yield

    def signature_lock(self, op: str, signature_key: str, timeout: float = -1) -> ContextManager[None]:
        """The lock that orders the compiles of one signature (see
        :meth:`lock_signature`); its file goes when it is released."""
        return _removed_lock(self._made_op_dir(op) / f"{SIGNATURE_LOCK_PREFIX}{signature_key}", timeout)

    def lock(self, op: str, timeout: float = -1) -> FileLock:
        """The op's lock, exclusively: while it is held no compile of the op
        is under way, and none starts (see :meth:`lock_signature`)."""
        return op_lock(self._made_op_dir(op), timeout)

    def temporary_directory(self, op: str) -> tempfile.TemporaryDirectory:
        """A directory in which an entry of ``op`` is assembled (an import),
        made under :meth:`lock`: if the process is killed, :meth:`remove_abandoned`
        removes it."""
        return tempfile.TemporaryDirectory(prefix=TEMPORARY_PREFIX, dir=self._made_op_dir(op))

    def _check_op_dir(self, op: str) -> Path:
        """The op's directory; UntrustedEntry first if the root's parents, or
        what exists of the way from the root to it, others could write: a
        miss never makes anything in a cache that it refuses."""
        check_parents(self.root)
        existing = self._op_dir(op)
        while not existing.exists() and existing != self.root:
            existing = existing.parent
        if existing.exists():
            check_trusted(existing, self.root)
        return self._op_dir(op)

    def _made_op_dir(self, op: str) -> Path:
        """The op's directory (see :meth:`_check_op_dir`), made where missing."""
        op_dir = self._check_op_dir(op)
        layout.make_cache_dirs(op_dir)
        return op_dir

    def shared_directory(self) -> Path:
        """Build products that every compile of this environment shares (see
        :mod:`aoti_eager.kernels.inductor.wrapper_split`), in the user's private
        directory: every cache root of the user shares them, and no one else
        can change what goes into the kernels."""
        return layout.private_directory("shared", self.directory.name)

    def remove_abandoned(self, op: str) -> None:
        """Removes what processes that died while publishing or removing left,
        unless a compile of the op is under way (see :meth:`lock_signature`):
        then any temporary directory may be that compile's."""
        lock = op_lock(self._op_dir(op), timeout=0)
        try:
            lock.acquire()
        except (Timeout, OSError):
            return  # the next compile cleans up
        try:
            for left in self._op_dir(op).glob(".*-*"):  # one pass over what may be many entries
                if left.name.startswith(TEMPORARY_PREFIX):
                    log.info("aoti_eager: removing %s, left by a process that died while compiling or publishing", left)
                    remove_tree(self.root, left)
                elif left.name.startswith(SIGNATURE_LOCK_PREFIX):
                    remove_idle_lock(left)
        finally:
            lock.release()

    @contextlib.contextmanager
    def in_use(self, op: str, signature_key: str) -> Iterator[None]:
        """Keeps eviction away from the entry while it is verified and loaded
        (a shared flock on its directory; a loaded library may then go)."""
        with _flock(self.entry_dir(op, signature_key), fcntl.LOCK_SH):
            yield

    @contextlib.contextmanager
    def hold(self, op: str, signature_key: str) -> Iterator[Entry | None]:
        """:meth:`lookup` under :meth:`in_use`, the entry's library a private
        copy of the bytes that were verified (see :func:`read_entry`), removed
        after the block; a DamagedEntry raised in the block is set aside."""
        with self.in_use(op, signature_key), _load_copy() as copy_as:
            entry = self.lookup(op, signature_key, copy_as=copy_as)
            try:
                yield entry
            except DamagedEntry as e:
                set_aside(self.root, self.entry_dir(op, signature_key), str(e))
                raise

    def set_aside(self, op: str, signature_key: str, reason: str) -> None:
        """Moves the entry to the quarantine (see :func:`set_aside`)."""
        set_aside(self.root, self.entry_dir(op, signature_key), reason)

    def lookup(self, op: str, signature_key: str, copy_as: Path | None = None) -> Entry | None:
        """The published entry, or None; a damaged entry is set aside.
        ``copy_as``: see :func:`read_entry`.

        Raises UntrustedEntry for an entry that someone else could have written.
        A found entry's last use is recorded (its directory's mtime): once per
        process and entry, as a process remembers what it found.
        """
        directory = self.entry_dir(op, signature_key)
        # Even on a miss: a kernel is never compiled into a directory others could write.
        self._check_op_dir(op)
        try:
            entry = read_entry(directory, self.root, copy_as)
        except DamagedEntry as e:
            set_aside(self.root, directory, str(e))
            return None
        if entry is not None:
            try:
                os.utime(directory)
            except OSError:
                pass  # another member's entry in a shared cache: its last use stays as it was
        elif self.behind is not None:
            entry = self._materialize(op, signature_key, copy_as)
        return entry

    def _materialize(self, op: str, signature_key: str, copy_as: Path | None) -> Entry | None:
        """The entry of the tier behind, published here and read back; None if it has none."""
        with self.temporary_directory(op) as workdir:
            fetched = self.behind.fetch(op, signature_key, Path(workdir))
            if fetched is None:
                return None
            entry, files = fetched
            self.publish(signature_key, entry, files, offer=False)
        try:
            return read_entry(self.entry_dir(op, signature_key), self.root, copy_as)
        except DamagedEntry as e:
            set_aside(self.root, self.entry_dir(op, signature_key), str(e))
            return None

    def remove(self, op: str, signature_key: str) -> bool:
        """Removes a published entry (see :func:`remove_entry`)."""
        return remove_entry(self.root, self.entry_dir(op, signature_key))

    def entries(self, op: str | None = None) -> Iterator[tuple[str, str]]:
        """(op, signature key) of every published entry (of ``op``, if given);
        links and temporary directories are never entries."""
        for op_dir in _directories(self.directory):
            if op is not None and op_dir.name != op_dirname(op):
                continue
            for entry_dir in _directories(Path(op_dir.path)):
                if not entry_dir.name.startswith(TEMPORARY_PREFIX):
                    yield op_of_dirname(op_dir.name), entry_dir.name

    def keys(self, op: str, prefix: str) -> list[str]:
        """The signature keys of ``op``'s entries that begin with ``prefix``:
        the local ones, then those only the tier behind holds, which
        :meth:`lookup` fetches. So another machine's dynamic-shape kernel of
        a shape family is found as a local one is::

            >>> cache.keys("aten::add.Tensor", family_key + "-")
            ['<family key>-<digest>']
        """
        local = [key for _, key in self.entries(op) if key.startswith(prefix)]
        if self.behind is None:
            return local
        return local + [key for key in self.behind.keys(op, prefix) if key not in local]

    def publish(self, signature_key: str, entry: Entry, files: dict[str, Path] | None = None,
                offer: bool = True) -> Entry:
        """Publishes ``entry`` with ``files`` (name in the entry -> source path),
        then, with ``offer``, offers it to the tier behind.

        Returns the entry as published; if another process published the same
        signature first, its entry wins and is returned.
        """
        op_dir = self._made_op_dir(entry.op)
        tmp = op_dir / f"{TEMPORARY_PREFIX}{uuid.uuid4().hex}"
        tmp.mkdir(mode=0o700)
        try:
            for name, source in (files or {}).items():
                shutil.copyfile(source, tmp / name)
            entry.signature_key = signature_key
            if entry.library is not None:
                entry.sha256 = sha256_of(tmp / LIBRARY_FILE)
                entry.sidecar_sha256 = {name: sha256_of(tmp / name) for name in SIDECAR_FILES if (tmp / name).exists()}
                entry.library = Path(LIBRARY_FILE)
            metadata = entry.to_json()
            entry.metadata_sha256 = metadata["metadata_sha256"]
            (tmp / ENTRY_FILE).write_text(json.dumps(metadata, indent=1))
            final = self.entry_dir(entry.op, signature_key)
            sign_entry(tmp, final)
            if settings.cache_group.get() is not None:
                for path in tmp.iterdir():
                    os.chmod(path, 0o640)
                os.chmod(tmp, 0o2770)  # so that any member may evict it
            try:
                os.rename(tmp, final)
            except OSError:
                published = self.lookup(entry.op, signature_key)
                if published is not None:
                    return published
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if offer and self.behind is not None:
            self.behind.offer(entry.op, signature_key, final)
        if entry.library is not None:
            entry.library = final / LIBRARY_FILE
        return entry
