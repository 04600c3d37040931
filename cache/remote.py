"""The fleet cache: a Redis server behind the local cache, shared by every
machine that runs the same model (:class:`RedisTier`, a
:class:`~aoti_eager.cache.entry_store.RemoteTier`).

A kernel compiled on one machine is published to the server; every other
machine of the same environment (same torch, compiler, CPU or GPU) fetches it
on a local miss, verifies it, and publishes it into its local cache, from
which the C++ hit path loads it like any local entry. Keys, ``<env>`` an
environment's name and ``<op>`` the op's directory name::

    aoti_eager:v2:entry:<env>:<op>:<signature key>   a hash: entry.json, kernel.so, kernel.json,
                                                     manifest.json, manifest.sig
    aoti_eager:v2:lock:<env>:<op>:<signature key>    the compile lock: its holder's token, with a TTL
    aoti_eager:v2:keys:<env>:<op>                    a set: the signature keys of the op's entries, so
                                                     that a shape family's entries are listed in one
                                                     command (:meth:`RedisTier.keys`), not a SCAN

**Signed, or not used.** A library is native code that would run in every
process of the fleet, and whoever can write to the server could put one
there. So an entry is published only with a signature: ``manifest.json``
lists the sha256 of each of its files under the names a bundle gives them
(``<env>/<op>/<signature key>/<file>``, which binds them to their key: a
signed entry copied under another key does not verify), signed by
``$AOTI_EAGER_SIGNING_KEY`` (see :mod:`aoti_eager.cache.signing`). An entry is
used only if a key of ``$AOTI_EAGER_TRUSTED_KEYS`` signed it and every file
matches; otherwise one warning names it and the reason, and the call
compiles locally.

**One compile for the fleet.** A compile holds ``SET lock token NX PX ttl``,
renewed by a thread while it compiles and released only with its token.
Others poll for the published entry meanwhile; a dead holder's lock expires
after the TTL (``$AOTI_EAGER_REMOTE_LOCK_TTL``) and the next waiter compiles.

**Never in the way.** Connecting and each command have small timeouts. Any
failure of the server (unreachable, restarted, refusing the password, out of
memory, answering something that is not Redis) marks it down for
``$AOTI_EAGER_REMOTE_RETRY`` seconds, with one warning per process: the tier
is then empty and the process runs on its local cache alone.

Example::

    >>> cache = KernelCache(root, environment)
    >>> cache.behind = tier("redis://cache-host:6379/0", environment)
    >>> cache.lookup("aten::abs", key)   # local, else the fleet's: verified, then published locally

Standard library only, and ``redis`` (the ``remote`` extra), imported when a
tier first talks to its server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from aoti_eager import settings
from aoti_eager.cache import layout, signing
from aoti_eager.cache.entry_store import Entry
from aoti_eager.cache.store import ENTRY_FILES, LIBRARY_FILE, DamagedEntry, op_dirname, op_of_dirname, received_entry

log = logging.getLogger("aoti_eager")

T = TypeVar("T")

NAMESPACE = f"aoti_eager:{layout.LAYOUT_VERSION}"
MANIFEST_FIELD = "manifest.json"
SIGNATURE_FIELD = "manifest.sig"
# How often a waiter asks whether the lock's holder has published.
POLL_SECONDS = 0.1

# Set-if-absent for a whole entry, atomically: a reader sees no entry or a
# complete one; and its key (ARGV[1]) in the op's set of keys.
_PUBLISH_IF_ABSENT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('SADD', KEYS[2], ARGV[1])
return 1
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
    import redis

    said = str(error) or type(error).__name__
    if isinstance(error, redis.AuthenticationError) or "WRONGPASS" in said or "NOAUTH" in said:
        return (f"the server refused the user or password ({said}): give the right ones in the URL, "
                f"redis://user:password@host:port/db, in ${settings.remote.name} or enable(remote=...)")
    # A plain server given a TLS handshake says nothing: a timeout, not an SSL error.
    if url.startswith("rediss://") and ("SSL" in said or "ssl" in said or isinstance(error, redis.TimeoutError)):
        return (f"the TLS connection failed ({said}): a rediss:// URL needs a server that speaks TLS with a "
                "certificate this machine trusts; use redis:// for a plain server")
    if isinstance(error, redis.TimeoutError):
        return (f"no answer within {settings.remote_timeout.get():g} s ({said}); "
                f"${settings.remote_timeout.name} allows more")
    if isinstance(error, redis.ConnectionError):
        return f"cannot connect ({said}); check that the server is up and reachable from this machine"
    if isinstance(error, redis.ResponseError):
        return f"the server refused a command ({said}); if it is out of memory, raise its maxmemory or evict"
    return f"its answer is not Redis's protocol ({type(error).__name__}: {said}): is it a Redis server?"


class Server:
    """One Redis server as this process talks to it: one client with small
    timeouts, and a circuit breaker (after a failure, nothing is asked of it
    for ``$AOTI_EAGER_REMOTE_RETRY`` seconds; one warning per process)."""

    def __init__(self, url: str):
        self.url = url
        self._client: Any = None
        self._down_until = 0.0
        self._warned = False
        # Warnings already given (see say_once).
        self.said: set[str] = set()

    def client(self) -> Any:
        if self._client is None:
            try:
                import redis
                from redis.backoff import NoBackoff
                from redis.retry import Retry
            except ImportError:
                raise ServerUnavailable(
                    "the fleet cache needs the redis client package: pip install 'aoti-eager[remote]'") from None
            self._client = redis.Redis.from_url(
                self.url,
                socket_connect_timeout=settings.remote_connect_timeout.get(),
                socket_timeout=settings.remote_timeout.get(),
                # One try: the breaker, not a retry loop, decides when to ask again.
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
            )
        return self._client

    def run(self, command: Callable[[Any], T]) -> T:
        """``command(client)``'s result. Raises ServerUnavailable, without
        asking the server while it is marked down."""
        if time.monotonic() < self._down_until:
            raise ServerUnavailable(f"the fleet cache {redacted(self.url)} failed less than "
                                    f"{settings.remote_retry.get():g} s ago")
        client = self.client()
        import redis

        try:
            return command(client)
        except (redis.RedisError, OSError, ValueError) as e:
            reason = describe_failure(self.url, e)
            retry = settings.remote_retry.get()
            self._down_until = time.monotonic() + retry
            if not self._warned:
                self._warned = True
                log.warning("aoti_eager: the fleet cache %s cannot be used: %s. This process runs on its local cache "
                            "alone, and tries the server again every %g s (%s).",
                            redacted(self.url), reason, retry, settings.remote_retry.name)
            else:
                log.info("aoti_eager: the fleet cache %s failed again: %s", redacted(self.url), reason)
            raise ServerUnavailable(f"the fleet cache {redacted(self.url)}: {reason}") from e

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


def tier(url: str, environment: str) -> RedisTier:
    """The fleet cache at ``url`` for one environment (see the module's docstring)."""
    return RedisTier(server(url), environment)


def entry_key(environment: str, op: str, signature_key: str) -> str:
    return f"{NAMESPACE}:entry:{environment}:{op_dirname(op)}:{signature_key}"


def keys_key(environment: str, op: str) -> str:
    return f"{NAMESPACE}:keys:{environment}:{op_dirname(op)}"


def lock_key(environment: str, op: str, signature_key: str) -> str:
    return f"{NAMESPACE}:lock:{environment}:{op_dirname(op)}:{signature_key}"


def member_name(environment: str, op: str, signature_key: str, file: str) -> str:
    """A file's name in an entry's manifest: a bundle's member name, which binds it to its key."""
    return f"{environment}/{op_dirname(op)}/{signature_key}/{file}"


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
    keys = server.run(lambda client: list(client.scan_iter(match=pattern, count=1000)))
    if op is not None:
        wanted = op_dirname(op)
        op_dirs = [key.decode().split(":")[4] for key in keys]
        keys = [key for key, found in zip(keys, op_dirs) if found == wanted or found.startswith(wanted + ".")]
    fields = (*ENTRY_FILES, MANIFEST_FIELD, SIGNATURE_FIELD)

    def sizes(client: Any) -> list[int]:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            for field in fields:
                pipe.hstrlen(key, field)
        return pipe.execute()

    lengths = server.run(sizes)
    for i, key in enumerate(keys):
        _, _, _, env, op_dir, signature_key = key.decode().split(":", 5)
        yield RemoteEntry(env, op_of_dirname(op_dir), signature_key, sum(lengths[i * len(fields):(i + 1) * len(fields)]))


class RedisTier:
    """The fleet cache's entries of one environment (see the module's docstring)."""

    def __init__(self, server: Server, environment: str):
        self.server = server
        self.environment = environment

    def fetch(self, op: str, signature_key: str, into: Path) -> tuple[Entry, dict[str, Path]] | None:
        """The entry the server holds, its signature and every file verified,
        written into ``into``; None if there is none, it is refused (one
        warning per entry), or the server fails."""
        key = entry_key(self.environment, op, signature_key)
        try:
            fields = self.server.run(lambda client: client.hgetall(key))
        except ServerUnavailable:
            return None
        if not fields:
            return None
        try:
            return self._verified(op, signature_key, fields, into)
        except (signing.SignatureError, signing.KeyFileError, DamagedEntry) as e:
            self.server.say_once(
                "aoti_eager: the fleet cache's entry %s is refused, the call compiles locally: %s", key, str(e))
            return None

    def _verified(self, op: str, signature_key: str, fields: dict[bytes, bytes],
                  into: Path) -> tuple[Entry, dict[str, Path]]:
        files = {name.decode(errors="replace"): data for name, data in fields.items()}
        manifest, signature = files.pop(MANIFEST_FIELD, None), files.pop(SIGNATURE_FIELD, None)
        unexpected = sorted(set(files) - set(ENTRY_FILES))
        if unexpected:
            raise DamagedEntry(f"it holds {unexpected}, which no entry has")
        members = {member_name(self.environment, op, signature_key, name): signing.file_digest(data)
                   for name, data in files.items()}
        trusted = settings.trusted_keys.get()
        if not trusted:
            raise signing.SignatureError(f"no key is trusted: set ${settings.trusted_keys.name} to the public keys "
                                         "of the machines that publish (`aoti-eager cache keygen`)")
        signing.check_manifest(manifest, signature, members, trusted)
        paths = {}
        for name, data in files.items():
            paths[name] = into / name
            paths[name].write_bytes(data)
        library = members.get(member_name(self.environment, op, signature_key, LIBRARY_FILE))
        return received_entry(op, paths, library["sha256"] if library else None)

    def offer(self, op: str, signature_key: str, directory: Path) -> bool:
        """Publishes the local entry in ``directory``, signed with
        ``$AOTI_EAGER_SIGNING_KEY``, unless the server has one for the key;
        whether it did. Without a signing key nothing is published (one
        warning per process)."""
        signing_key = settings.signing_key.get()
        if signing_key is None:
            self.server.say_once("aoti_eager: nothing is published to the fleet cache %s: only signed entries are "
                                 "shared, and %s is unset (`aoti-eager cache keygen KEY`, then set it to KEY)",
                                 redacted(self.server.url), settings.signing_key.name)
            return False
        try:
            files = {name: (directory / name).read_bytes() for name in ENTRY_FILES if (directory / name).exists()}
            manifest = signing.manifest_of({member_name(self.environment, op, signature_key, name): signing.file_digest(data)
                                            for name, data in files.items()})
            signature = signing.sign(manifest, signing_key)
        except (OSError, signing.KeyFileError) as e:
            self.server.say_once("aoti_eager: not publishing to the fleet cache: %s", str(e))
            return False
        fields = [*[item for name_data in files.items() for item in name_data],
                  MANIFEST_FIELD, manifest, SIGNATURE_FIELD, signature]
        key, index = entry_key(self.environment, op, signature_key), keys_key(self.environment, op)
        try:
            return bool(self.server.run(
                lambda client: client.eval(_PUBLISH_IF_ABSENT, 2, key, index, signature_key, *fields)))
        except ServerUnavailable:
            return False

    def keys(self, op: str, prefix: str) -> list[str]:
        """The signature keys of ``op``'s entries on the server that begin
        with ``prefix``, sorted; [] if the server fails. A key that no entry
        of this package could have (a name that is not a plain directory
        name) is left out: the server is trusted with nothing.

            >>> tier.keys("aten::add.Tensor", family_key + "-")
            ['<family key>-<digest>']
        """
        try:
            members = self.server.run(lambda client: client.smembers(keys_key(self.environment, op)))
        except ServerUnavailable:
            return []
        found = {member.decode(errors="replace") for member in members if isinstance(member, bytes)}
        return sorted(key for key in found
                      if key.startswith(prefix) and key not in (".", "..") and layout.safe_name(key) == key)

    @contextlib.contextmanager
    def lock_signature(self, op: str, signature_key: str, timeout: float = -1) -> Iterator[bool]:
        """The fleet-wide compile lock of the signature (see the module's
        docstring); yields whether it is held. Waiting ends when the entry is
        published, the server fails (the compile goes on under the local lock
        alone) or after ``timeout`` seconds (TimeoutError; < 0: never)."""
        name = lock_key(self.environment, op, signature_key)
        published = entry_key(self.environment, op, signature_key)
        token = uuid.uuid4().hex
        ttl_ms = max(1, int(settings.remote_lock_ttl.get() * 1000))
        deadline = None if timeout < 0 else time.monotonic() + timeout
        held = False
        try:
            while True:
                if self.server.run(lambda client: client.set(name, token, nx=True, px=ttl_ms)):
                    held = True
                    break
                if self.server.run(lambda client: client.exists(published)):
                    break
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"another machine has held the fleet cache's lock {name} for over {timeout:g} s")
                time.sleep(POLL_SECONDS)
        except ServerUnavailable:
            pass
        if not held:
            yield False
            return
        renewal = _Renewal(self.server, name, token, ttl_ms)
        try:
            yield True
        finally:
            renewal.stop()
            with contextlib.suppress(ServerUnavailable):
                self.server.run(lambda client: client.eval(_RELEASE, 1, name, token))


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
                renewed = self.server.run(lambda client: client.eval(_RENEW, 1, self.lock_name, self.token, self.ttl_ms))
            except ServerUnavailable:
                continue
            if not renewed:
                log.info("aoti_eager: the fleet cache's lock %s expired or was removed while compiling; another "
                         "machine may compile the same signature", self.lock_name)
                return

    def stop(self) -> None:
        self._stopped.set()
        self.join()
