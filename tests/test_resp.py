"""The fleet cache's Redis client (cache/resp.py) against a server that
answers in Redis's place: what it says, however odd, is refused within the
command's deadline, and never allocates more than the caps allow."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator

import pytest

from aoti_eager.cache import resp


@contextlib.contextmanager
def answering(reply: bytes) -> Iterator[str]:
    """A server on loopback that answers the first command it is sent with
    ``reply``, then waits for the client to close; yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        connection, _ = listener.accept()
        with connection, contextlib.suppress(OSError):  # the client may close before the whole reply
            connection.recv(1 << 16)
            connection.sendall(reply)
            connection.recv(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with listener:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    thread.join(10)


def execute(url: str, *command: str) -> list:
    connection = resp.Connection(url, connect_timeout=5)
    try:
        with connection.deadline(10):
            return connection.execute(list(command))
    finally:
        connection.close()


def test_a_reply_of_more_small_values_than_the_cap_is_refused():
    # Each empty array is 4 bytes on the wire and about 60 in memory: a reply
    # within the byte cap would otherwise allocate over ten times that cap.
    count = resp.MAX_VALUES + 1
    with answering(b"*%d\r\n" % count + b"*0\r\n" * count) as url, pytest.raises(resp.ProtocolError, match="values"):
        execute(url, "SCAN", "0")
    nested = b"*2\r\n" + (b"*%d\r\n" % (resp.MAX_VALUES // 2) + b":1\r\n" * (resp.MAX_VALUES // 2)) * 2
    with answering(nested) as url, pytest.raises(resp.ProtocolError, match="values"):
        execute(url, "SCAN", "0")
    fits = b"*2\r\n" + (b"*1000\r\n" + b":1\r\n" * 1000) * 2
    with answering(fits) as url:
        assert execute(url, "SCAN", "0") == [[[1] * 1000, [1] * 1000]]


def test_a_host_name_the_resolver_does_not_answer_for_costs_at_most_the_connect_timeout(monkeypatch):
    # The system's resolver has no timeout: a DNS server that does not answer holds it for its retries.
    real, release, answered = socket.getaddrinfo, threading.Event(), threading.Event()

    def unanswering(host, port, family=0, kind=0, proto=0, flags=0):
        if flags & socket.AI_NUMERICHOST:
            return real(host, port, family, kind, proto, flags)  # a name: refused at once, no DNS asked
        release.wait(5)
        answered.set()
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", unanswering)
    connection = resp.Connection("redis://cache-host.example:6379/0", connect_timeout=0.2)
    try:
        with connection.deadline(1.0), pytest.raises(resp.ConnectError, match="no connection within 0.2 s"):
            connection.execute(["PING"])
        assert not answered.is_set(), "the call waited for the resolver"
    finally:
        release.set()


def test_a_command_waiting_for_another_threads_ends_within_its_own_deadline():
    # Another thread's command (a fleet lock's renewal) held up by a slow server holds the connection.
    connection = resp.Connection("redis://127.0.0.1:1/0", connect_timeout=0.1)
    busy, release, released = threading.Event(), threading.Event(), threading.Event()

    def slow_command() -> None:
        with connection.lock:
            busy.set()
            release.wait(5)
        released.set()

    other = threading.Thread(target=slow_command)
    other.start()
    busy.wait(5)
    try:
        with pytest.raises(resp.Timeout, match="busy with another thread's command"):
            with connection.deadline(0.2):
                connection.execute(["PING"])
        assert not released.is_set(), "the command waited for the other thread's"
    finally:
        release.set()
        other.join()
