"""A small Redis client for the fleet cache: RESP2 over one socket, every
command under a whole-command deadline, every reply under a size bound.

Why not the ``redis`` package: its timeouts bound each socket read, so a
server that answers one byte at a time holds a call without bound; it reads a
reply of any length the server announces; and importing it costs more than a
whole fleet hit. What the fleet cache needs is small: send commands, read
their replies, URLs of the three kinds Redis has::

    >>> connection = Connection("redis://:password@cache-host:6379/0", connect_timeout=0.1)
    >>> with connection.deadline(1.0):
    ...     connection.execute(["SET", "k", "v"], ["GET", "k"])
    ['OK', b'v']

Replies: simple strings as ``str``, bulk strings as ``bytes`` (None for nil),
integers as ``int``, arrays as lists (None for nil). An error reply raises
:class:`ReplyError` once every reply of the call has been read. Any other
failure closes the socket (a reply read halfway leaves it out of step); the
next call connects again.

Standard library only (``ssl`` imported for ``rediss://`` URLs alone).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import urllib.parse
from typing import Any, Iterator, Sequence

# Nesting of arrays in a reply (the fleet's deepest is 2: SCAN's).
MAX_DEPTH = 4
# Values in the replies of one call, arrays' elements included: the largest
# the fleet asks for (a SCAN page, a listing's pipeline) are far fewer. Each
# costs far more memory than its few bytes on the wire, so bytes alone do not
# bound what a reply allocates.
MAX_VALUES = 1 << 16


class Error(Exception):
    """Any failure of a command."""


class ConnectError(Error):
    """The server cannot be reached, or closed the connection."""


class Timeout(Error):
    """The command's deadline passed before its whole reply came."""


class ProtocolError(Error):
    """The server's answer is not RESP, or is larger than allowed."""


class ReplyError(Error):
    """The server answered with an error (``-ERR ...``, ``-OOM ...``, ``-WRONGPASS ...``)."""


def _encode(argument: Any) -> bytes:
    if isinstance(argument, bytes):
        return argument
    return str(argument).encode()


def pack(command: Sequence[Any]) -> bytes:
    """``command`` as a RESP array of bulk strings."""
    parts = [b"*%d\r\n" % len(command)]
    for argument in map(_encode, command):
        parts += [b"$%d\r\n" % len(argument), argument, b"\r\n"]
    return b"".join(parts)


class Connection:
    """One connection to the server of ``url``, opened on first use; one
    command at a time (callers hold :attr:`lock`)."""

    def __init__(self, url: str, connect_timeout: float, max_reply_bytes: int = 1 << 30):
        self.url = url
        self.connect_timeout = connect_timeout
        self.max_reply_bytes = max_reply_bytes
        self.lock = threading.RLock()
        # A forked child makes its own: it must not speak on its parent's socket.
        self.pid = os.getpid()
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self._deadline = float("inf")
        self._read = 0
        self._values = 0

    @contextlib.contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """Every command in the block, connecting included, ends within
        ``seconds`` of its start, or raises :class:`Timeout`; so does the wait
        for another thread's command on the connection (a lock's renewal)."""
        deadline = time.monotonic() + seconds
        if not self.lock.acquire(timeout=seconds):
            raise Timeout("the connection was busy with another thread's command until the deadline")
        try:
            self._deadline = deadline
            yield
        finally:
            self._deadline = float("inf")
            self.lock.release()

    def execute(self, *commands: Sequence[Any]) -> list[Any]:
        """The replies to ``commands``, sent together (a pipeline)."""
        with self.lock:
            try:
                self._read = self._values = 0
                if self._sock is None:
                    self._connect()
                self._send(b"".join(pack(command) for command in commands))
                replies = [self._reply(0) for _ in commands]
            except ReplyError:
                raise  # only from the handshake: the connection is closed already
            except BaseException:
                self.close()
                raise
        errors = [reply for reply in replies if isinstance(reply, ReplyError)]
        if errors:
            raise errors[0]
        return replies

    def close(self) -> None:
        with self.lock:
            if self._sock is not None:
                with contextlib.suppress(OSError):
                    self._sock.close()
            self._sock = None
            self._buffer.clear()

    # ---- the socket ----

    def _remaining(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise Timeout("no complete answer before the command's deadline")
        return left

    def _connect(self) -> None:
        parts = urllib.parse.urlsplit(self.url)
        timeout = min(self.connect_timeout, self._remaining())
        try:
            if parts.scheme == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                with _closed_on_error(sock):
                    sock.settimeout(timeout)
                    sock.connect(parts.path)
            else:
                sock = _tcp(parts.hostname or "localhost", parts.port or 6379, time.monotonic() + timeout)
            if parts.scheme == "rediss":
                import ssl

                with _closed_on_error(sock):
                    sock.settimeout(self._remaining())  # the handshake, whole, within the command's deadline
                    sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
        except socket.timeout:
            raise ConnectError(f"no connection within {timeout:g} s") from None
        except OSError as e:
            raise ConnectError(str(e) or type(e).__name__) from None
        self._sock = sock
        self._buffer.clear()
        handshake = []
        if parts.password is not None:
            user = urllib.parse.unquote(parts.username) if parts.username else None
            handshake.append(["AUTH", *([user] if user else []), urllib.parse.unquote(parts.password)])
        database = _database(parts)
        if database:
            handshake.append(["SELECT", database])
        if handshake:
            self._send(b"".join(pack(command) for command in handshake))
            for reply in [self._reply(0) for _ in handshake]:
                if isinstance(reply, ReplyError):
                    self.close()
                    raise reply

    def _send(self, data: bytes) -> None:
        try:
            self._sock.settimeout(self._remaining())
            self._sock.sendall(data)
        except socket.timeout:
            raise Timeout("the server took no more of the command before its deadline") from None
        except OSError as e:
            raise ConnectError(str(e) or type(e).__name__) from None

    def _fill(self) -> None:
        try:
            self._sock.settimeout(self._remaining())
            data = self._sock.recv(1 << 20)
        except socket.timeout:
            raise Timeout("no complete answer before the command's deadline") from None
        except OSError as e:
            raise ConnectError(str(e) or type(e).__name__) from None
        if not data:
            raise ConnectError("the server closed the connection")
        self._read += len(data)
        if self._read > self.max_reply_bytes:
            raise ProtocolError(f"a reply of over {self.max_reply_bytes} bytes")
        self._buffer += data

    def _line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            if len(self._buffer) > 1 << 16:
                raise ProtocolError("a line of over 64 KiB")
            self._fill()
        line = bytes(self._buffer[:end])
        del self._buffer[:end + 2]
        return line

    def _exactly(self, size: int) -> bytes:
        if size > self.max_reply_bytes:
            raise ProtocolError(f"a reply of {size} bytes, over {self.max_reply_bytes}")
        while len(self._buffer) < size + 2:
            self._fill()
        data = bytes(self._buffer[:size])
        if self._buffer[size:size + 2] != b"\r\n":
            raise ProtocolError("a bulk string not ended by CRLF")
        del self._buffer[:size + 2]
        return data

    def _reply(self, depth: int) -> Any:
        self._values += 1
        if self._values > MAX_VALUES:
            raise ProtocolError(f"replies of over {MAX_VALUES} values")
        line = self._line()
        kind, rest = line[:1], line[1:]
        try:
            if kind == b"+":
                return rest.decode()
            if kind == b"-":
                return ReplyError(rest.decode(errors="replace"))
            if kind == b":":
                return int(rest)
            if kind == b"$":
                size = int(rest)
                return None if size < 0 else self._exactly(size)
            if kind == b"*":
                count = int(rest)
                if count < 0:
                    return None
                if depth >= MAX_DEPTH or self._values + count > MAX_VALUES:
                    raise ProtocolError(f"an array of {count} elements at depth {depth}: "
                                        f"over {MAX_DEPTH} levels or {MAX_VALUES} values")
                return [self._reply(depth + 1) for _ in range(count)]
        except ValueError:
            pass
        raise ProtocolError(f"not a RESP reply: {line[:40]!r}")


def _resolve(host: str, port: int, deadline: float) -> list[tuple]:
    """``getaddrinfo(host, port)`` by ``deadline``: the system's resolver has
    no timeout of its own (an unanswering DNS server holds it for its retries),
    so a host name is resolved in a thread that is left behind if late. A
    numeric address needs no resolver."""
    try:
        return socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass  # a name
    answer: list[Any] = []

    def resolve() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
        except OSError as e:
            answer.append(e)

    thread = threading.Thread(target=resolve, name="aoti_eager-resolve", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if not answer:
        raise socket.timeout(f"{host} not resolved in time")
    if isinstance(answer[0], OSError):
        raise answer[0]
    return answer[0]


def _tcp(host: str, port: int, deadline: float) -> socket.socket:
    """A TCP connection to the first address of ``host`` that accepts one,
    resolution included, by ``deadline`` (socket.timeout after it)."""
    error: OSError = socket.timeout(f"no address of {host} accepted a connection in time")
    for family, kind, proto, _, address in _resolve(host, port, deadline):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(address)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error


@contextlib.contextmanager
def _closed_on_error(sock: socket.socket) -> Iterator[None]:
    try:
        yield
    except BaseException:
        sock.close()
        raise


def _database(parts: urllib.parse.SplitResult) -> int:
    """The database a URL names: ``redis://host/3``, ``unix:///path?db=3``."""
    text = parts.path.strip("/") if parts.scheme != "unix" else ""
    text = urllib.parse.parse_qs(parts.query).get("db", [text])[0]
    try:
        return int(text or 0)
    except ValueError:
        raise ConnectError(f"the URL's database {text!r} is not a number") from None
