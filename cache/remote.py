"""The fleet cache: a Redis server behind the local cache, shared by every
machine that runs the same model (:class:`RedisTier`, a
:class:`~aoti_eager.cache.entry_store.RemoteTier`).

A kernel compiled on one machine is published to the server; every other
machine of the same environment (same torch, compiler, CPU or GPU) fetches it
on a local miss, verifies it, and publishes it into its local cache, from
which the C++ hit path loads it like any local entry.

The parts, and how data flows through them::

    KernelCache.lookup (store.py) --miss--> RedisTier.fetch --FETCH script--> server
        <-- files written into a temporary directory, verified (signature, sizes), published locally
    KernelCache.publish --> RedisTier.offer --PUBLISH_IF_ABSENT--> server
        (taken: the entry there is replaced only if it does not verify here, or is older: WATCH/MULTI)
    KernelCache.lock_signature --> RedisTier.lock_signature --TAKE_LOCK--> server, _Renewal renews it
    every command --> Server.run: the breaker, one deadline per command --> resp.Connection (cache/resp.py)

Keys, ``<env>`` an environment's name and ``<op>`` the op's directory name::

    aoti_eager:v2:entry:<env>:<op>:<signature key>   a hash: entry.json, kernel.so, kernel.json,
                                                     manifest.json, manifest.sig
    aoti_eager:v2:lock:<env>:<op>:<signature key>    the compile lock: its holder's token, with a TTL
    aoti_eager:v2:index:<env>:<op>                   a sorted set (all scores 0, so ordered by name): the
                                                     signature keys of the op's entries, so that a shape
                                                     family's are listed by prefix in one command
                                                     (:meth:`RedisTier.keys`), at most MAX_LISTED_KEYS

**Signed, or not used.** A library is native code that would run in every
process of the fleet, and whoever can write to the server could put one
there. So an entry is published only with a signature: ``manifest.json``
lists the sha256 of each of its files under the names a bundle gives them
(``<env>/<op>/<signature key>/<file>``, which binds them to their key: a
signed entry copied under another key does not verify) and the entry's
creation time, signed by ``$AOTI_EAGER_SIGNING_KEY`` (see
:mod:`aoti_eager.cache.signing`). An entry is used only if a key of
``$AOTI_EAGER_TRUSTED_KEYS`` signed it and every file matches; otherwise one
warning names it and the reason, and the call compiles locally. An entry
larger than ``$AOTI_EAGER_REMOTE_MAX_ENTRY`` is refused before it is read
(its fields' lengths are asked first, in the same script that returns them).

**Whoever may write to the server cannot block it.** A publisher finding an
entry that does not verify for it (unsigned, untrusted, altered, oversized)
or that verifies but is older than its own replaces it, compare-and-set
(``WATCH``): a first publication by nobody trusted does not hold the key, and
an old signed entry put back is undone by the next publication; a publisher
never replaces a newer verified entry with an older one.

**One compile for the fleet.** A compile takes ``lock`` with its token and a
TTL, renewed by a thread while it compiles and released only with its token,
whatever became of the publication. Another machine's call that finds the
lock taken does not wait: it runs eagerly and asks again after
``FLEET_RETRY_SECONDS`` (:class:`~aoti_eager.cache.entry_store.LockedElsewhere`);
a background compile may wait (``RedisTier.wait``). A lock that outlives the
TTL (set by hand, with no TTL or a longer one) is given the TTL by the first
waiter, so it is stale after ``$AOTI_EAGER_REMOTE_LOCK_TTL`` at most.

**Never in the way.** Connecting may take
``$AOTI_EAGER_REMOTE_CONNECT_TIMEOUT`` and a command, its whole reply
included, ``$AOTI_EAGER_REMOTE_TIMEOUT``. Any failure of the server
(unreachable, slow, restarted, refusing the password, out of memory,
answering something that is not Redis or not the reply expected) marks it
down for ``$AOTI_EAGER_REMOTE_RETRY`` seconds, with one warning per process:
the tier is then empty and the process runs on its local cache alone.

Example::

    >>> cache = KernelCache(root, environment)
    >>> cache.behind = tier("redis://cache-host:6379/0", environment)
    >>> cache.lookup("aten::abs", key)   # local, else the fleet's: verified, then published locally

Standard library only: the client is :mod:`aoti_eager.cache.resp`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from aoti_eager import settings
from aoti_eager.cache import layout, resp, signing
from aoti_eager.cache.entry_store import Entry, LockedElsewhere
from aoti_eager.cache.files import load_json
from aoti_eager.cache.store import ENTRY_FILE, ENTRY_FILES, LIBRARY_FILE, DamagedEntry, op_dirname, op_of_dirname, received_entry

log = logging.getLogger("aoti_eager")

T = TypeVar("T")

NAMESPACE = f"aoti_eager:{layout.LAYOUT_VERSION}"
MANIFEST_FIELD = "manifest.json"
SIGNATURE_FIELD = "manifest.sig"
FIELDS = (*ENTRY_FILES, MANIFEST_FIELD, SIGNATURE_FIELD)
# How often a background compile asks whether another machine's has ended.
POLL_SECONDS = 0.1
# How long a call that finds another machine compiling its signature runs
# eagerly before it asks the caches again.
FLEET_RETRY_SECONDS = 0.5
# The most signature keys of a shape family that one miss lists (each may be
# fetched): whoever can write to the server can add keys, never work.
MAX_LISTED_KEYS = 32
# What a listing of the server's entries (:func:`entries`) holds at most, and
# the SCAN pages it asks for: a server may answer with pages that never end.
MAX_LISTED_ENTRIES = 1 << 20
MAX_SCAN_PAGES = 1 << 16

# An entry's fields, in FIELDS' order, unless it is larger than ARGV[1] bytes
# in all: {number of fields, total bytes, field values...}; {0} for none.
# Lengths first, so that an oversized entry is refused without being read.
_FETCH = """
local fields = redis.call('HLEN', KEYS[1])
if fields == 0 then return {0} end
local total = 0
for i = 2, #ARGV do total = total + redis.call('HSTRLEN', KEYS[1], ARGV[i]) end
if total > tonumber(ARGV[1]) then return {fields, total} end
local reply = {fields, total}
for i, value in ipairs(redis.call('HMGET', KEYS[1], unpack(ARGV, 2))) do reply[i + 2] = value end
return reply
"""
# Set-if-absent for a whole entry, atomically: a reader sees no entry or a
# complete one; and its key (ARGV[1]) in the op's index.
_PUBLISH_IF_ABSENT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('ZADD', KEYS[2], 0, ARGV[1])
return 1
"""
# 1: the lock (KEYS[1]) is taken with the token ARGV[1] and a TTL of ARGV[2]
# ms; 2: the entry (KEYS[2]) is published; 0: another holds the lock. A lock
# with no TTL or a longer one (no holder of ours renews it so) gets the TTL.
_TAKE_LOCK = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 2 end
local ttl = redis.call('PTTL', KEYS[1])
if ttl == -1 or ttl > tonumber(ARGV[2]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# Only the holder (its token) renews or releases a lock: a holder whose lock
# expired must not release the next holder's.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class ServerUnavailable(Exception):
    """The server failed just now, or did within ``$AOTI_EAGER_REMOTE_RETRY``
    seconds; the message says how and what to do."""


class UnexpectedReply(Exception):
    """A reply of a type or shape that the command does not have: the server is not (only) Redis."""


def expect(value: Any, kind: type | tuple[type, ...]) -> Any:
    """``value``, if it is of ``kind``; else UnexpectedReply."""
    if not isinstance(value, kind):
        raise UnexpectedReply(f"a reply of type {type(value).__name__} where {kind} was expected")
    return value


def redacted(url: str) -> str:
    """``url`` without its password, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = f"{parts.username}:" if parts.username else ":"
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}***@{host}"))


def describe_failure(url: str, error: BaseException) -> str:
    """What went wrong with the server at ``url``, and what to do about it."""
    said = str(error) or type(error).__name__
    if isinstance(error, resp.ReplyError) and ("WRONGPASS" in said or "NOAUTH" in said or "invalid password" in said):
        return (f"the server refused the user or password ({said}): give the right ones in the URL, "
                f"redis://user:password@host:port/db, in ${settings.remote.name} or enable(remote=...)")
    # A plain server given a TLS handshake answers with an error, or says nothing.
    if url.startswith("rediss://") and isinstance(error, (resp.ConnectError, resp.Timeout, resp.ProtocolError)):
        return (f"the TLS connection failed ({said}): a rediss:// URL needs a server that speaks TLS with a "
                "certificate this machine trusts; use redis:// for a plain server")
    if isinstance(error, resp.Timeout):
        return (f"no complete answer within {command_seconds():g} s ({said}); "
                f"${settings.remote_timeout.name} allows more")
    if isinstance(error, resp.ConnectError):
        return f"cannot connect ({said}); check that the server is up and reachable from this machine"
    if isinstance(error, resp.ReplyError):
        return f"the server refused a command ({said}); if it is out of memory, raise its maxmemory or evict"
    return f"its answer is not Redis's protocol or not the reply expected ({type(error).__name__}: {said}): is it a Redis server?"


def command_seconds() -> float:
    """The most one command may take, connecting included."""
    return settings.remote_connect_timeout.get() + settings.remote_timeout.get()


class Server:
    """One Redis server as this process talks to it: one connection, each
    command under a deadline, and a circuit breaker (after a failure, nothing
    is asked of it for ``$AOTI_EAGER_REMOTE_RETRY`` seconds; one warning per
    process)."""

    def __init__(self, url: str):
        self.url = url
        self._client: resp.Connection | None = None
        self._down_until = 0.0
        self._warned = False
        # Warnings already given (see say_once).
        self.said: set[str] = set()

    def client(self) -> resp.Connection:
        if self._client is None or self._client.pid != os.getpid():
            self._client = resp.Connection(self.url, settings.remote_connect_timeout.get(),
                                           max_reply_bytes=settings.remote_max_entry.get() + (1 << 20))
        return self._client

    def run(self, command: Callable[[resp.Connection], T], force: bool = False) -> T:
        """``command(connection)``'s result, within :func:`command_seconds`.
        Raises ServerUnavailable, without asking the server while it is
        marked down (unless ``force``: a lock's release is tried even after
        the server refused a publication)."""
        if not force and time.monotonic() < self._down_until:
            raise ServerUnavailable(f"the fleet cache {redacted(self.url)} failed less than "
                                    f"{settings.remote_retry.get():g} s ago")
        client = self.client()
        try:
            with client.deadline(command_seconds()):
                return command(client)
        except Exception as e:  # whatever the server said: the call goes on without it
            client.close()  # a command cut short may leave the connection out of step
            self._trip(e)
            raise ServerUnavailable(f"the fleet cache {redacted(self.url)}: {describe_failure(self.url, e)}") from e

    def _trip(self, error: Exception) -> None:
        reason = describe_failure(self.url, error)
        retry = settings.remote_retry.get()
        self._down_until = time.monotonic() + retry
        if not self._warned:
            self._warned = True
            log.warning("aoti_eager: the fleet cache %s cannot be used: %s. This process runs on its local cache "
                        "alone, and tries the server again every %g s (%s).",
                        redacted(self.url), reason, retry, settings.remote_retry.name)
        else:
            log.info("aoti_eager: the fleet cache %s failed again: %s", redacted(self.url), reason)

    def call(self, *command: Any, reply: type | tuple[type, ...] = object, force: bool = False) -> Any:
        """The reply to one command, which must be of type ``reply`` (see :meth:`run`)."""
        return self.run(lambda client: expect(client.execute(command)[0], reply), force=force)

    def say_once(self, what: str, *args: Any) -> None:
        """Logs a warning once per process (per message and arguments)."""
        said = what % args
        if said not in self.said:
            self.said.add(said)
            log.warning(said)


_servers: dict[str, Server] = {}
_servers_lock = threading.Lock()


def server(url: str) -> Server:
    """The process's :class:`Server` for ``url`` (one breaker per server)."""
    with _servers_lock:
        return _servers.setdefault(url, Server(url))


def forget() -> None:
    """Drops what this process knows of every server (breakers, warnings
    given): a later call asks each again, as a new process does."""
    with _servers_lock:
        _servers.clear()


def tier(url: str, environment: str, wait: float = 0.0) -> RedisTier:
    """The fleet cache at ``url`` for one environment (see the module's docstring)."""
    return RedisTier(server(url), environment, wait)


def entry_key(environment: str, op: str, signature_key: str) -> str:
    return f"{NAMESPACE}:entry:{environment}:{op_dirname(op)}:{signature_key}"


def keys_key(environment: str, op: str) -> str:
    return f"{NAMESPACE}:index:{environment}:{op_dirname(op)}"


def lock_key(environment: str, op: str, signature_key: str) -> str:
    return f"{NAMESPACE}:lock:{environment}:{op_dirname(op)}:{signature_key}"


def member_name(environment: str, op: str, signature_key: str, file: str) -> str:
    """A file's name in an entry's manifest: a bundle's member name, which binds it to its key."""
    return f"{environment}/{op_dirname(op)}/{signature_key}/{file}"


def fetch_command(key: str) -> list[Any]:
    return ["EVAL", _FETCH, 1, key, settings.remote_max_entry.get(), *FIELDS]


def fields_of(reply: Any) -> dict[str, bytes] | None:
    """The fields that :data:`_FETCH` returned, None for no entry. Raises
    DamagedEntry for an entry over the size cap or with fields no entry
    has, UnexpectedReply for a reply that is not the script's."""
    expect(reply, list)
    count = expect(reply[0], int) if reply else 0
    if count == 0:
        return None
    total = expect(reply[1], int)
    if len(reply) == 2:
        raise DamagedEntry(f"its files take {total} bytes, over {settings.remote_max_entry.name}="
                           f"{settings.remote_max_entry.text()} (refused unread)")
    if len(reply) != 2 + len(FIELDS):
        raise UnexpectedReply(f"{len(reply)} values where {2 + len(FIELDS)} were expected")
    fields = {name: expect(value, bytes) for name, value in zip(FIELDS, reply[2:]) if value is not None}
    if count != len(fields):
        raise DamagedEntry(f"it holds {count - len(fields)} fields that no entry has")
    return fields


@dataclasses.dataclass(frozen=True)
class RemoteEntry:
    """An entry the server holds, as :func:`entries` lists it."""

    environment: str
    op: str
    signature_key: str
    bytes: int


def entries(server: Server, environment: str | None = None, op: str | None = None) -> Iterator[RemoteEntry]:
    """Every entry the server holds (of ``environment`` and ``op``, if
    given), with its size (its files, manifest and signature). Raises
    ServerUnavailable."""
    # An op named without its overload (aten::add) stands for all of them.
    pattern = f"{NAMESPACE}:entry:{environment or '*'}:{op_dirname(op) + '*' if op else '*'}:*"
    wanted = op_dirname(op) if op is not None else None
    listed, cursor = [], b"0"
    for _ in range(MAX_SCAN_PAGES):  # a command per page: each has its deadline
        cursor, found = server.run(lambda client: _scan_page(client, cursor, pattern))
        listed += [parts for parts in map(_entry_of_key, found) if parts is not None
                   and (wanted is None or parts[2] == wanted or parts[2].startswith(wanted + "."))]
        if len(listed) > MAX_LISTED_ENTRIES:
            raise ServerUnavailable(f"the fleet cache {redacted(server.url)} lists over {MAX_LISTED_ENTRIES} entries")
        if cursor == b"0":
            break
    else:
        raise ServerUnavailable(f"the fleet cache {redacted(server.url)}: its listing did not end after "
                                f"{MAX_SCAN_PAGES} pages")
    for start in range(0, len(listed), 500):
        chunk = listed[start:start + 500]
        lengths = server.run(lambda client: [expect(n, int) for n in client.execute(
            *[["HSTRLEN", key, field] for key, *_ in chunk for field in FIELDS])])
        for i, (_, env, op_dir, signature_key) in enumerate(chunk):
            size = sum(lengths[i * len(FIELDS):(i + 1) * len(FIELDS)])
            yield RemoteEntry(env, op_of_dirname(op_dir), signature_key, size)


def _scan_page(client: resp.Connection, cursor: bytes, pattern: str) -> tuple[bytes, list[str]]:
    """One page of SCAN: the next cursor, and the keys."""
    following, found = expect(client.execute(["SCAN", cursor, "MATCH", pattern, "COUNT", 1000])[0], list)
    return expect(following, bytes), [expect(key, bytes).decode(errors="replace") for key in expect(found, list)]


def _entry_of_key(key: str) -> tuple[str, str, str, str] | None:
    """(key, environment, op directory, signature key) of an entry's key;
    None for a key that no entry of this package has, whose parts could name
    a path outside the cache (``..``, a ``/``)."""
    parts = key.split(":")
    if len(parts) != 6 or ":".join(parts[:3]) != f"{NAMESPACE}:entry" or not all(map(plain_name, parts[3:])):
        return None
    return key, parts[3], parts[4], parts[5]


def plain_name(name: str) -> bool:
    """Whether ``name`` could be a directory name this package gives: one
    component, of safe characters (see :func:`layout.safe_name`)."""
    return 0 < len(name) <= 255 and name not in (".", "..") and layout.safe_name(name) == name


class RedisTier:
    """The fleet cache's entries of one environment (see the module's
    docstring). ``wait``: how long :meth:`lock_signature` waits for another
    machine's compile before it raises LockedElsewhere (0: it does not)."""

    def __init__(self, server: Server, environment: str, wait: float = 0.0):
        self.server = server
        self.environment = environment
        self.wait = wait

    def fetch(self, op: str, signature_key: str, into: Path) -> tuple[Entry, dict[str, Path]] | None:
        """The entry the server holds, its signature and every file verified,
        written into ``into``; None if there is none, it is refused (one
        warning per entry), or the server fails."""
        key = entry_key(self.environment, op, signature_key)

        def read(client: resp.Connection) -> dict[str, bytes] | DamagedEntry | None:
            try:
                return fields_of(client.execute(fetch_command(key))[0])
            except DamagedEntry as e:  # the entry's fault, not the server's
                return e

        try:
            fields = self.server.run(read)
        except ServerUnavailable:
            return None
        if fields is None:
            return None
        try:
            if isinstance(fields, DamagedEntry):
                raise fields
            self._verify(op, signature_key, fields, settings.trusted_keys.get())
            return self._written(op, signature_key, fields, into)
        except (signing.SignatureError, signing.KeyFileError, DamagedEntry) as e:
            self._refused(key, e)
            return None

    def _refused(self, key: str, error: Exception) -> None:
        self.server.say_once(
            "aoti_eager: the fleet cache's entry %s is refused, the call compiles locally: %s", key, str(error))

    def _verify(self, op: str, signature_key: str, fields: dict[str, bytes], trusted: list[Path]) -> float:
        """The creation time that the entry's signed manifest records, its
        signature by one of ``trusted`` and every file checked. Raises
        SignatureError, KeyFileError."""
        files = {name: data for name, data in fields.items() if name in ENTRY_FILES}
        members = {member_name(self.environment, op, signature_key, name): signing.file_digest(data)
                   for name, data in files.items()}
        if not trusted:
            raise signing.SignatureError(f"no key is trusted: set ${settings.trusted_keys.name} to the public keys "
                                         "of the machines that publish (`aoti-eager cache keygen`)")
        manifest = fields.get(MANIFEST_FIELD)
        signing.check_manifest(manifest, fields.get(SIGNATURE_FIELD), members, trusted)
        return signing.manifest_created(manifest)

    def _written(self, op: str, signature_key: str, fields: dict[str, bytes],
                 into: Path) -> tuple[Entry, dict[str, Path]]:
        paths = {}
        for name in ENTRY_FILES:
            if name in fields:
                paths[name] = into / name
                paths[name].write_bytes(fields[name])
        library = signing.file_digest(fields[LIBRARY_FILE])["sha256"] if LIBRARY_FILE in fields else None
        return received_entry(op, paths, library)

    def offer(self, op: str, signature_key: str, directory: Path) -> bool:
        """Publishes the local entry in ``directory``, signed with
        ``$AOTI_EAGER_SIGNING_KEY``, unless the server holds one for the key
        that verifies here and is not older; whether it did. Without a
        signing key nothing is published (one warning per process)."""
        signing_key = settings.signing_key.get()
        if signing_key is None:
            self.server.say_once("aoti_eager: nothing is published to the fleet cache %s: only signed entries are "
                                 "shared, and %s is unset (`aoti-eager cache keygen KEY`, then set it to KEY)",
                                 redacted(self.server.url), settings.signing_key.name)
            return False
        try:
            fields, created = self._signed_fields(op, signature_key, directory, signing_key)
        except (OSError, ValueError, KeyError, TypeError, signing.KeyFileError) as e:
            self.server.say_once("aoti_eager: not publishing to the fleet cache: %s", str(e))
            return False
        key, index = entry_key(self.environment, op, signature_key), keys_key(self.environment, op)
        flat = [item for name_value in fields.items() for item in name_value]
        try:
            if self.server.call("EVAL", _PUBLISH_IF_ABSENT, 2, key, index, signature_key, *flat, reply=int):
                return True
            trusted = [*settings.trusted_keys.get(), *_own_public_key(signing_key)]
            return self.server.run(lambda client: self._replace_if_stale(client, op, signature_key, flat, created, trusted))
        except ServerUnavailable:
            return False

    def _signed_fields(self, op: str, signature_key: str, directory: Path, signing_key: Path) -> tuple[dict[str, bytes], float]:
        """The fields of the entry in ``directory`` with its signed manifest, and its creation time."""
        files = {name: (directory / name).read_bytes() for name in ENTRY_FILES if (directory / name).exists()}
        if sum(map(len, files.values())) > settings.remote_max_entry.get():
            raise ValueError(f"{directory} is larger than {settings.remote_max_entry.name}, which receivers refuse")
        created = float(load_json(files[ENTRY_FILE])["created"])
        manifest = signing.manifest_of({member_name(self.environment, op, signature_key, name): signing.file_digest(data)
                                        for name, data in files.items()}, created=created)
        return {**files, MANIFEST_FIELD: manifest, SIGNATURE_FIELD: signing.sign(manifest, signing_key)}, created

    def _replace_if_stale(self, client: resp.Connection, op: str, signature_key: str, flat: list[Any],
                          created: float, trusted: list[Path]) -> bool:
        """Replaces the entry the server holds for the key if it does not
        verify with ``trusted`` or is older than ``created``: compare-and-set
        (WATCH), so that an entry published meanwhile is left alone."""
        key = entry_key(self.environment, op, signature_key)
        client.execute(["WATCH", key])
        try:
            fields = fields_of(client.execute(fetch_command(key))[0])
            theirs = None if fields is None else self._verify(op, signature_key, fields, trusted)
        except (DamagedEntry, signing.SignatureError) as e:
            log.info("aoti_eager: replacing the fleet cache's entry %s, which does not verify here: %s", key, e)
            theirs = None
        except signing.KeyFileError:
            theirs = float("inf")  # cannot tell: leave it
        if theirs is not None and theirs >= created:
            client.execute(["UNWATCH"])
            return False
        replies = client.execute(["MULTI"], ["DEL", key], ["HSET", key, *flat],
                                 ["ZADD", keys_key(self.environment, op), 0, signature_key], ["EXEC"])
        return replies[-1] is not None

    def keys(self, op: str, prefix: str) -> list[str]:
        """The signature keys of ``op``'s entries on the server that begin
        with ``prefix``, sorted, at most MAX_LISTED_KEYS; [] if the server
        fails. A key that no entry of this package could have (a name that
        is not a plain directory name) is left out: the server is trusted
        with nothing.

            >>> tier.keys("aten::add.Tensor", family_key + "-")
            ['<family key>-<digest>']
        """
        low, high = b"[" + prefix.encode(), b"(" + prefix.encode() + b"\xff"
        try:
            members = self.server.call("ZRANGEBYLEX", keys_key(self.environment, op), low, high, "LIMIT", 0,
                                       MAX_LISTED_KEYS, reply=list)
        except ServerUnavailable:
            return []
        found = {member.decode(errors="replace") for member in members if isinstance(member, bytes)}
        return sorted(key for key in found if key.startswith(prefix) and plain_name(key))[:MAX_LISTED_KEYS]

    @contextlib.contextmanager
    def lock_signature(self, op: str, signature_key: str, timeout: float = -1) -> Iterator[bool]:
        """The fleet-wide compile lock of the signature (see the module's
        docstring); yields whether it is held (False: the entry is published,
        or the server fails: the compile goes on under the local lock alone).
        Raises LockedElsewhere if another machine holds it after ``wait``
        seconds (``timeout``, if shorter; < 0: ``wait``)."""
        name = lock_key(self.environment, op, signature_key)
        published = entry_key(self.environment, op, signature_key)
        token = uuid.uuid4().hex
        ttl_ms = max(1, int(settings.remote_lock_ttl.get() * 1000))
        deadline = time.monotonic() + (self.wait if timeout < 0 else min(self.wait, timeout))
        try:
            while (taken := self.server.call("EVAL", _TAKE_LOCK, 2, name, published, token, ttl_ms, reply=int)) == 0:
                if time.monotonic() >= deadline:
                    raise LockedElsewhere(f"another machine is compiling it (the fleet cache's lock {name})",
                                          retry_after=FLEET_RETRY_SECONDS)
                time.sleep(POLL_SECONDS)
        except ServerUnavailable:
            taken = 0
        if taken != 1:
            yield False
            return
        renewal = _Renewal(self.server, name, token, ttl_ms)
        try:
            yield True
        finally:
            renewal.stop()
            with contextlib.suppress(ServerUnavailable):
                self.server.call("EVAL", _RELEASE, 1, name, token, force=True)


def _own_public_key(signing_key: Path) -> list[Path]:
    """The public half of the publisher's key, if beside it: what it signed verifies for it."""
    public = signing.public_key_path(signing_key)
    return [public] if public.exists() else []


class _Renewal(threading.Thread):
    """Keeps a held lock alive: renews its TTL every third of it, while its
    holder compiles. A holder that dies stops renewing, and the lock expires."""

    def __init__(self, server: Server, name: str, token: str, ttl_ms: int):
        super().__init__(name="aoti_eager-fleet-lock", daemon=True)
        self.server, self.lock_name, self.token, self.ttl_ms = server, name, token, ttl_ms
        self._stopped = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._stopped.wait(self.ttl_ms / 3000):
            try:
                renewed = self.server.call("EVAL", _RENEW, 1, self.lock_name, self.token, self.ttl_ms)
            except ServerUnavailable:
                continue
            if not renewed:
                log.info("aoti_eager: the fleet cache's lock %s expired or was removed while compiling; another "
                         "machine may compile the same signature", self.lock_name)
                return

    def stop(self) -> None:
        self._stopped.set()
        self.join()
