"""The fleet cache (cache/remote.py) against a real ``redis-server`` on a free
loopback port: entries shared between cache roots (machines), only signed
ones used, one compile for the fleet, and a server that fails in every way
never in the way of a call."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

import aoti_eager
from aoti_eager import settings
from aoti_eager.cache import KernelCache, remote, signing
from aoti_eager.cache.entry_store import LockedElsewhere
from aoti_eager.cache.store import LIBRARY_FILE
from aoti_eager.kernels.toolchain import environment_name
from helpers import (
    ENVIRONMENT, REDIS_SERVER, RedisServer, assert_same_as_eager, free_port, machine, publish_kernel, refusals, run_shapes,
)

pytest.importorskip("redis", reason="the fleet cache's tests need the redis client: pip install 'aoti-eager[remote]'")
pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None,
    reason="redis-server is not installed (Debian: apt-get install -y redis-server; scripts/setup_env.sh installs it as root)",
)


def test_an_entry_published_on_one_machine_is_used_on_another(server, keys, tmp_path):
    first, second = machine(tmp_path / "a", server.url), machine(tmp_path / "b", server.url)
    published = publish_kernel(first, tmp_path, key="k", content=b"\x7fELF the kernel")
    assert second.entry_dir("aten::abs", "k").exists() is False
    found = second.lookup("aten::abs", "k")
    # Published into the second machine's local cache, where the hit path loads it from.
    assert found.library == second.entry_dir("aten::abs", "k") / LIBRARY_FILE
    assert found.library.read_bytes() == b"\x7fELF the kernel"
    assert (found.sha256, found.signature, found.created) == (published.sha256, published.signature, published.created)
    assert [(e.op, e.signature_key) for e in remote.entries(remote.server(server.url))] == [("aten::abs", "k")]
    # A key no machine published is a miss, and leaves nothing behind.
    assert second.lookup("aten::abs", "other") is None
    assert not list(second.directory.rglob(".tmp-*"))


def test_the_keys_of_an_ops_entries_are_listed_by_prefix(server, keys, tmp_path):
    first, second = machine(tmp_path / "a", server.url), machine(tmp_path / "b", server.url)
    for key in ("family-1", "family-2", "other"):
        publish_kernel(first, tmp_path, key=key)
    publish_kernel(first, tmp_path, key="family-3", op="aten::neg")
    tier, second.behind = second.behind, None
    publish_kernel(second, tmp_path, key="family-0")  # local alone, not offered
    second.behind = tier
    assert tier.keys("aten::abs", "family-") == ["family-1", "family-2"]
    assert second.keys("aten::abs", "family-") == ["family-0", "family-1", "family-2"]  # the local ones first
    # What a server lists is a name, never a path: a key that is not a plain directory name is left out.
    server.client.zadd(remote.keys_key(ENVIRONMENT, "aten::abs"), {"family-/../../escape": 0, "..": 0})
    assert tier.keys("aten::abs", "") == ["family-1", "family-2", "other"]


def test_a_verified_entry_is_replaced_only_by_a_newer_one(server, keys, tmp_path):
    first, second = machine(tmp_path / "a", server.url), machine(tmp_path / "b", server.url)
    publish_kernel(first, tmp_path, key="k", content=b"first")
    publish_kernel(second, tmp_path, key="k", content=b"second")  # a later compile of the same key elsewhere
    assert machine(tmp_path / "c", server.url).lookup("aten::abs", "k").library.read_bytes() == b"second"
    # The older one offered again (a push of an old cache) does not replace it.
    assert not first.behind.offer("aten::abs", "k", first.entry_dir("aten::abs", "k"))
    assert machine(tmp_path / "d", server.url).lookup("aten::abs", "k").library.read_bytes() == b"second"


def test_nothing_is_published_without_a_signing_key(server, keys, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv(settings.signing_key.name)
    first = machine(tmp_path / "a", server.url)
    publish_kernel(first, tmp_path, key="k1")
    publish_kernel(first, tmp_path, key="k2")
    assert list(remote.entries(remote.server(server.url))) == []
    assert first.lookup("aten::abs", "k1") is not None  # published locally all the same
    said = [m for m in refusals(caplog) if settings.signing_key.name in m]
    assert len(said) == 1, said


def _stored(server: RedisServer, key: str = "k") -> str:
    return remote.entry_key(ENVIRONMENT, "aten::abs", key)


def test_an_unsigned_entry_is_refused_with_one_warning(server, keys, tmp_path, caplog):
    publish_kernel(machine(tmp_path / "a", server.url), tmp_path, key="k")
    server.client.hdel(_stored(server), remote.MANIFEST_FIELD, remote.SIGNATURE_FIELD)
    second = machine(tmp_path / "b", server.url)
    assert second.lookup("aten::abs", "k") is None
    assert second.lookup("aten::abs", "k") is None
    said = refusals(caplog)
    assert len(said) == 1 and _stored(server) in said[0] and "not signed" in said[0], said
    assert not second.entry_dir("aten::abs", "k").exists()


def test_a_tampered_library_is_refused(server, keys, tmp_path, caplog):
    publish_kernel(machine(tmp_path / "a", server.url), tmp_path, key="k", content=b"\x7fELF honest")
    server.client.hset(_stored(server), LIBRARY_FILE, b"\x7fELF crafted")
    second = machine(tmp_path / "b", server.url)
    assert second.lookup("aten::abs", "k") is None
    said = refusals(caplog)
    assert len(said) == 1 and "do not match its signed manifest" in said[0], said


def test_a_signed_entry_copied_under_another_key_is_refused(server, keys, tmp_path, caplog):
    # Its manifest names the files with their key: a valid signature does not vouch for another signature.
    publish_kernel(machine(tmp_path / "a", server.url), tmp_path, key="k")
    server.client.copy(_stored(server, "k"), _stored(server, "other"))
    assert machine(tmp_path / "b", server.url).lookup("aten::abs", "other") is None
    assert "do not match its signed manifest" in refusals(caplog)[0]


def test_an_entry_signed_by_a_key_that_is_not_trusted_is_refused(server, keys, tmp_path, monkeypatch, caplog):
    publish_kernel(machine(tmp_path / "a", server.url), tmp_path, key="k")
    signing.generate_key_pair(tmp_path / "mine")
    monkeypatch.setenv(settings.trusted_keys.name, str(tmp_path / "mine.pub"))
    assert machine(tmp_path / "b", server.url).lookup("aten::abs", "k") is None
    assert "which is not a trusted key" in refusals(caplog)[0]
    monkeypatch.delenv(settings.trusted_keys.name)
    assert machine(tmp_path / "c", server.url).lookup("aten::abs", "k") is None
    assert settings.trusted_keys.name in refusals(caplog)[1]


def test_an_unreachable_server_costs_one_short_try_then_is_tried_again_later(server, keys, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(settings.remote_retry.name, "1")
    down = f"redis://127.0.0.1:{free_port()}/0"
    cache = machine(tmp_path / "a", down)
    started = time.monotonic()
    for key in ("k1", "k2", "k3"):
        assert cache.lookup("aten::abs", key) is None
    publish_kernel(cache, tmp_path, key="k4")  # published locally; the offer is not even tried
    assert cache.keys("aten::abs", "k") == ["k4"]  # the local keys alone
    assert time.monotonic() - started < 0.5
    said = refusals(caplog)
    assert len(said) == 1 and "cannot connect" in said[0] and "local cache alone" in said[0], said
    # The server is tried again once the retry interval is over.
    remote.server(down).url = server.url
    remote.server(down)._client = None
    assert cache.lookup("aten::abs", "k5") is None
    assert list(remote.entries(remote.server(server.url))) == []
    time.sleep(1.05)
    publish_kernel(cache, tmp_path, key="k6")
    assert [e.signature_key for e in remote.entries(remote.server(server.url))] == ["k6"]


def test_an_unroutable_server_waits_at_most_the_connect_timeout(keys, tmp_path, monkeypatch):
    remote.forget()
    monkeypatch.setenv(settings.remote_connect_timeout.name, "0.1")
    cache = machine(tmp_path / "a", "redis://192.0.2.1:6379/0")  # TEST-NET-1: never answers
    started = time.monotonic()
    assert cache.lookup("aten::abs", "k") is None
    assert cache.lookup("aten::abs", "k") is None
    assert time.monotonic() - started < 0.5


@contextlib.contextmanager
def garbage_server() -> Iterator[str]:
    """A server that answers every connection with bytes that are not Redis's protocol."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            with connection:
                connection.recv(1 << 16)
                connection.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_a_server_answering_garbage_is_not_used(keys, tmp_path, monkeypatch, caplog):
    remote.forget()
    with garbage_server() as url:
        cache = machine(tmp_path / "a", url)
        started = time.monotonic()
        assert cache.lookup("aten::abs", "k") is None
        publish_kernel(cache, tmp_path, key="k")
        assert cache.lookup("aten::abs", "k") is not None
        assert time.monotonic() - started < 2
    said = refusals(caplog)
    assert len(said) == 1 and "not Redis's protocol" in said[0], said


def test_a_wrong_password_is_refused_with_a_clear_error(keys, tmp_path, monkeypatch, caplog):
    remote.forget()
    protected = RedisServer(tmp_path, "--requirepass", "right")
    try:
        url = f"redis://:wrong@127.0.0.1:{protected.port}/0"
        assert machine(tmp_path / "a", url).lookup("aten::abs", "k") is None
        said = refusals(caplog)
        assert len(said) == 1 and "refused the user or password" in said[0], said
        assert "wrong" not in said[0], "a password in a message"
        with pytest.raises(remote.ServerUnavailable, match="refused the user or password"):
            list(remote.entries(remote.server(f"redis://127.0.0.1:{protected.port}/0")))
    finally:
        protected.stop()


def test_a_tls_url_to_a_plain_server_is_refused_with_a_clear_error(server, keys, tmp_path, caplog):
    url = server.url.replace("redis://", "rediss://")
    assert machine(tmp_path / "a", url).lookup("aten::abs", "k") is None
    said = refusals(caplog)
    assert len(said) == 1 and "TLS connection failed" in said[0] and "use redis://" in said[0], said


def test_a_full_server_leaves_the_entry_local(keys, tmp_path, monkeypatch, caplog):
    remote.forget()
    full = RedisServer(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    try:
        published = publish_kernel(machine(tmp_path / "a", full.url), tmp_path, key="k", content=os.urandom(4 << 20))
        assert published.library.stat().st_size == 4 << 20
        said = refusals(caplog)
        assert len(said) == 1 and "maxmemory" in said[0], said
        assert full.client.dbsize() == 0
    finally:
        full.stop()


def test_the_fleet_lock_is_held_by_one_and_released_only_by_its_holder(server, tmp_path):
    first, second = machine(tmp_path / "a", server.url), machine(tmp_path / "b", server.url)
    lock = remote.lock_key(ENVIRONMENT, "aten::abs", "k")
    with first.behind.lock_signature("aten::abs", "k") as held:
        assert held and server.client.get(lock) is not None
        # A call does not wait: it runs eagerly and asks again later.
        with pytest.raises(LockedElsewhere, match="another machine is compiling it") as refused:
            with second.behind.lock_signature("aten::abs", "k", timeout=900):
                pass
        assert refused.value.retry_after == remote.FLEET_RETRY_SECONDS
        # A background compile waits, as long as its tier's wait.
        second.behind.wait = 0.3
        started = time.monotonic()
        with pytest.raises(LockedElsewhere):
            with second.behind.lock_signature("aten::abs", "k", timeout=900):
                pass
        assert 0.3 <= time.monotonic() - started < 1
        assert server.client.get(lock) is not None, "a waiter released the holder's lock"
    assert server.client.get(lock) is None


def test_the_fleet_lock_is_renewed_while_held_and_a_dead_holders_expires(server, tmp_path, monkeypatch):
    monkeypatch.setenv(settings.remote_lock_ttl.name, "0.3")
    first, second = machine(tmp_path / "a", server.url), machine(tmp_path / "b", server.url)
    lock = remote.lock_key(ENVIRONMENT, "aten::abs", "k")
    with first.behind.lock_signature("aten::abs", "k"):
        time.sleep(0.8)  # longer than the TTL: renewed
        assert server.client.get(lock) is not None
    # A holder that died: its token stays until the TTL ends, then the next waiter takes it.
    server.client.set(lock, "dead holder", px=300)
    second.behind.wait = 5
    started = time.monotonic()
    with second.behind.lock_signature("aten::abs", "k", timeout=5) as held:
        assert held and 0.1 < time.monotonic() - started < 1


def test_a_waiter_stops_waiting_once_the_entry_is_published(server, keys, tmp_path):
    first, second = machine(tmp_path / "a", server.url), machine(tmp_path / "b", server.url)
    second.behind.wait = 10
    with first.lock_signature("aten::abs", "k"):
        threading.Timer(0.3, lambda: publish_kernel(first, tmp_path, key="k")).start()
        started = time.monotonic()
        with second.lock_signature("aten::abs", "k", timeout=10):
            assert time.monotonic() - started < 2
            assert second.lookup("aten::abs", "k") is not None


# ---- the runtime, in processes (real compiles: one per test) ----

FLEET = r"""
import json, pathlib, sys, time, torch, aoti_eager
cache_dir, url, index, processes = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
x = torch.linspace(-4, 4, int(sys.argv[5]))
expected = torch.sigmoid(x)
aoti_eager.enable(["aten::sigmoid"], devices=["cpu"], cache_dir=cache_dir, remote=url)
ready = pathlib.Path(sys.argv[6])
(ready / index).touch()
while len(list(ready.iterdir())) < processes:  # everyone misses at once
    time.sleep(0.01)
results = [torch.sigmoid(x) for _ in range(3)]
# A machine that found another compiling runs eagerly meanwhile: calls until a kernel serves.
deadline = time.monotonic() + 300
while not sum(aoti_eager.stats()["aten::sigmoid"][k] for k in ("compiles", "cache_loads")) and time.monotonic() < deadline:
    time.sleep(0.05)
    results.append(torch.sigmoid(x))
for r in results:
    torch.testing.assert_close(r, expected, rtol=0, atol=0)
print(json.dumps(aoti_eager.stats()["aten::sigmoid"]))
"""


def run_fleet(roots: list[Path], url: str, size: int, ready: Path) -> list[dict]:
    """Runs FLEET in a process per cache root (a machine's), all at once."""
    ready.mkdir()
    started = [
        subprocess.Popen([sys.executable, "-c", FLEET, str(root), url, str(i), str(len(roots)), str(size), str(ready)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i, root in enumerate(roots)
    ]
    stats = []
    for process in started:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err
        stats.append(json.loads(out.strip().splitlines()[-1]))
    return stats


def test_a_second_machine_makes_no_compile(server, keys, tmp_path):
    (first,) = run_fleet([tmp_path / "machine-a" / "cache"], server.url, 40, tmp_path / "ready-a")
    assert (first["compiles"], first["fallbacks"]) == (1, 0), first
    (second,) = run_fleet([tmp_path / "machine-b" / "cache"], server.url, 40, tmp_path / "ready-b")
    assert (second["compiles"], second["cache_loads"], second["hits"], second["fallbacks"]) == (0, 1, 2, 0), second


def test_a_dynamic_kernel_compiled_on_one_machine_serves_a_new_shape_on_another(server, keys, tmp_path):
    def make(n):
        return torch.randn(n, 16), torch.randn(16)

    # 5: a static kernel; 9: the dynamic-shape kernel of the family, published to the fleet.
    compiles, _ = run_shapes("aten::add.Tensor", tmp_path / "machine-a", torch.add, [5, 9], make, remote=server.url)
    assert compiles == [1, 1]
    # A shape machine A never saw: machine B finds the family's kernel in the fleet cache.
    compiles, stats = run_shapes("aten::add.Tensor", tmp_path / "machine-b", torch.add, [17, 33], make, remote=server.url)
    assert compiles == [0, 0] and (stats["cache_loads"], stats["hits"], stats["fallbacks"]) == (1, 1, 0), stats


def test_eight_processes_on_two_machines_compile_once(server, keys, tmp_path):
    roots = [tmp_path / f"machine-{i % 2}" / "cache" for i in range(8)]
    stats = run_fleet(roots, server.url, 56, tmp_path / "ready")
    assert sum(s["compiles"] for s in stats) == 1, json.dumps(stats)
    assert sum(s["cache_loads"] for s in stats) == 7, json.dumps(stats)
    # Calls on the other machine ran eagerly while the kernel compiled, no other way.
    assert all(s["fallbacks"] == 0 or "another machine is compiling it" in s["fallback_reason"] for s in stats), stats


def test_calls_are_right_and_prompt_when_the_server_is_killed_mid_run(keys, tmp_path, monkeypatch, caplog):
    # compile="never": misses consult the caches (local, then the fleet's) and run eagerly; nothing compiles.
    remote.forget()
    inputs = [torch.randn(size) for size in (3, 5, 7, 9, 11, 13)]
    expected = [torch.sigmoid(x) for x in inputs]
    doomed = RedisServer(tmp_path)
    aoti_eager.enable(["aten::sigmoid"], devices=["cpu"], cache_dir=tmp_path / "cache", remote=doomed.url, compile="never")
    for x, eager in zip(inputs[:2], expected):
        assert_same_as_eager(torch.sigmoid(x), eager)
    doomed.stop()
    for x, eager in zip(inputs[2:], expected[2:]):
        started = time.monotonic()
        result = torch.sigmoid(x)
        assert time.monotonic() - started < 0.5
        assert_same_as_eager(result, eager)
    assert aoti_eager.stats()["aten::sigmoid"]["misses"] == 6
    said = refusals(caplog)
    assert len(said) == 1 and "cannot connect" in said[0], said


# ---- prewarm and background workers ----

# Answers each entry with the fleet cache the worker was given.
_WORKER_SAYS_ITS_FLEET = r"""
import json, os, sys
for line in sys.stdin:
    print(json.dumps({"status": "compiled", "reason": os.environ.get("AOTI_EAGER_REMOTE")}), flush=True)
"""


def test_a_background_compile_uses_the_fleet_cache_that_enable_names(tmp_path, monkeypatch):
    from aoti_eager import _background, _worker
    from aoti_eager.kernels import CompileRequest

    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", _WORKER_SAYS_ITS_FLEET])
    monkeypatch.delenv(settings.remote.name, raising=False)
    entry = CompileRequest("aten::abs", "cpu", "k", [])
    url = "redis://fleet-host:6379/0"
    assert _background.submit(_background.InWorker(entry, tmp_path / "cache", url)).result(timeout=120).reason == url
    assert _background.submit(_background.InWorker(entry, tmp_path / "other cache")).result(timeout=120).reason is None


def test_prewarm_takes_what_the_fleet_holds_without_starting_a_worker(server, keys, tmp_path, monkeypatch):
    from aoti_eager import _worker
    from aoti_eager.kernels import CallSignature
    from aoti_eager.kernels.compile import compile_options
    from aoti_eager.kernels import CompileRequest

    here = environment_name(torch.device("cpu"), compile_options("cpu"))
    signature = CallSignature.of(torch.ops.aten.abs.default, "cpu", [torch.randn(8)])
    publisher = KernelCache(tmp_path / "a", here)
    publisher.behind = remote.tier(server.url, here)
    publish_kernel(publisher, tmp_path, key=signature.key)
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text(json.dumps(CompileRequest("aten::abs", "cpu", signature.key, signature.to_json()).to_json()) + "\n")
    monkeypatch.setattr(_worker, "COMMAND", [sys.executable, "-c", "raise SystemExit(3)"])  # a worker would fail
    monkeypatch.setenv(settings.remote.name, server.url)
    report = aoti_eager.prewarm(manifest, jobs=1, devices=["cpu"], cache_dir=tmp_path / "b")
    assert [r.outcome.status for r in report.results] == ["cached"], report.results
    assert KernelCache(tmp_path / "b", here).lookup("aten::abs", signature.key).library.read_bytes() == b"\x7fELF kernel"


# ---- the command line ----

def test_push_stats_and_pull(server, keys, tmp_path, capsys):
    from aoti_eager import _cli_cache, cli

    here = _cli_cache._environments_here()[0]
    machine_a = KernelCache(tmp_path / "a", here)
    for key in ("k1", "k2"):
        publish_kernel(machine_a, tmp_path, key=key, content=f"\x7fELF {key}".encode())
    publish_kernel(machine_a, tmp_path, key="k3", op="aten::add.Tensor")

    def run(*argv: str) -> tuple[int, dict]:
        code = cli.main([*argv, "--url", server.url, "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, pushed = run("--cache-dir", str(tmp_path / "a"), "remote", "push")
    assert code == 0 and len(pushed["pushed"]) == 3, pushed
    code, again = run("--cache-dir", str(tmp_path / "a"), "remote", "push")
    assert len(again["pushed"]) == 0 and len(again["already_present"]) == 3, again
    code, stats = run("remote", "stats")
    assert (stats["entries"], stats["environments"]) == (3, [here]), stats
    assert stats["by_op"]["aten::abs"]["entries"] == 2 and stats["by_op"]["aten::add.Tensor"]["entries"] == 1
    assert stats["bytes"] == sum(len(v) for key in server.client.keys("*:entry:*") for v in server.client.hvals(key))
    code, pulled = run("--cache-dir", str(tmp_path / "b"), "remote", "pull", "--op", "abs")
    assert code == 0 and len(pulled["pulled"]) == 2, pulled
    machine_b = KernelCache(tmp_path / "b", here)
    assert machine_b.lookup("aten::abs", "k2").library.read_bytes() == b"\x7fELF k2"
    assert machine_b.entry_dir("aten::add.Tensor", "k3").exists() is False


def test_push_without_a_signing_key_and_an_unreachable_server_say_what_to_do(server, keys, tmp_path, monkeypatch, capsys):
    from aoti_eager import cli

    monkeypatch.delenv(settings.signing_key.name)
    assert cli.main(["--cache-dir", str(tmp_path), "remote", "push", "--url", server.url]) == 1
    assert "AOTI_EAGER_SIGNING_KEY is unset" in capsys.readouterr().err
    assert cli.main(["remote", "stats", "--url", f"redis://127.0.0.1:{free_port()}/0"]) == 1
    assert "cannot connect" in capsys.readouterr().err


def test_doctor_says_whether_the_server_answers_and_which_keys_are_trusted(server, keys, monkeypatch):
    from aoti_eager import cli

    monkeypatch.setenv(settings.remote.name, server.url)
    report, problems = cli._remote_report()
    fingerprint = signing.key_file_fingerprint(keys, private=True)
    assert report["reachable"] and problems == []
    assert report["signing_key"]["fingerprint"] == fingerprint == report["trusted_keys"][0]["fingerprint"]
    assert "answers in" in cli._remote_line(report) and fingerprint in cli._remote_line(report)
    remote.forget()
    monkeypatch.setenv(settings.remote.name, f"redis://127.0.0.1:{free_port()}/0")
    report, problems = cli._remote_report()
    assert not report["reachable"] and "cannot connect" in problems[0]
    assert "does not answer" in cli._remote_line(report)


# ---- whoever can write to the server, or answers in its place, cannot hold or flood a call ----

def split_commands(data: bytes) -> tuple[list[list[bytes]], bytes]:
    """The complete RESP commands at the start of ``data``, and what is left."""
    commands = []
    while data.startswith(b"*"):
        try:
            head, rest = data.split(b"\r\n", 1)
            arguments = []
            for _ in range(int(head[1:])):
                size_line, rest = rest.split(b"\r\n", 1)
                size = int(size_line[1:])
                if len(rest) < size + 2:
                    raise ValueError("incomplete")
                arguments.append(rest[:size])
                rest = rest[size + 2:]
        except ValueError:
            break
        commands.append(arguments)
        data = rest
    return commands, data


@contextlib.contextmanager
def scripted_server(reply: bytes, byte_seconds: float = 0.0) -> Iterator[tuple[str, list[bytes]]]:
    """A server on loopback answering every command with ``reply``, one byte
    every ``byte_seconds``; yields its URL and the names of the commands it
    received. A client's handshake (CLIENT, HELLO) is answered at once."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.1)
    stop, received, threads = threading.Event(), [], []

    def answer(connection: socket.socket, data: bytes) -> None:
        for i in range(len(data)):
            if stop.is_set():
                return
            connection.sendall(data[i:i + 1])
            stop.wait(byte_seconds)

    def serve(connection: socket.socket) -> None:
        pending = b""
        with connection:
            connection.settimeout(0.1)
            while not stop.is_set():
                try:
                    data = connection.recv(1 << 16)
                except socket.timeout:
                    continue
                except OSError:
                    return
                if not data:
                    return
                commands, pending = split_commands(pending + data)
                for command in commands:
                    name = command[0].upper()
                    received.append(name)
                    try:
                        if name in (b"CLIENT", b"HELLO"):
                            connection.sendall(b"+OK\r\n")
                        else:
                            answer(connection, reply)
                    except OSError:
                        return

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            threads.append(threading.Thread(target=serve, args=(connection,), daemon=True))
            threads[-1].start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0", received
    finally:
        stop.set()
        acceptor.join()
        for thread in threads:
            thread.join()
        listener.close()




def test_a_server_that_trickles_its_reply_holds_a_call_one_deadline_then_is_not_asked(keys, tmp_path, monkeypatch, caplog):
    remote.forget()
    # A valid reply of 52 bytes, one byte every 0.5 s: 26 s; each read comes well within the 1 s socket timeout.
    reply = b"*8\r\n" + b"$0\r\n\r\n" * 8
    inputs = [torch.randn(size) for size in (5, 3, 7)]
    expected = [torch.sigmoid(x) for x in inputs]
    with scripted_server(reply, byte_seconds=0.5) as (url, received):
        aoti_eager.enable(["aten::sigmoid"], devices=["cpu"], cache_dir=tmp_path / "cache", remote=url, compile="never")
        started = time.monotonic()
        assert_same_as_eager(torch.sigmoid(inputs[0]), expected[0])
        # One command's deadline (connecting, then the command), and a margin for a loaded machine.
        assert time.monotonic() - started < settings.remote_connect_timeout.get() + settings.remote_timeout.get() + 1.5
        asked = len(received)
        for x, eager in zip(inputs[1:], expected[1:]):
            assert_same_as_eager(torch.sigmoid(x), eager)
        assert len(received) == asked, "the server was asked again within the retry interval"
    said = refusals(caplog)
    assert len(said) == 1 and "no complete answer within" in said[0], said


@pytest.mark.parametrize("reply", [b":1\r\n", b"+OK\r\n", b"*2\r\n:1\r\n*1\r\n:2\r\n", b"$3\r\nabc\r\n",
                                   b"$999999999999\r\n", b"*1\r\n" * 100 + b":1\r\n"],
                         ids=["integer", "status", "nested", "bulk", "announced-huge", "deeply-nested"])
def test_a_reply_of_an_unexpected_type_trips_the_breaker(reply, keys, tmp_path, monkeypatch, caplog):
    remote.forget()
    inputs = [torch.randn(size) for size in (5, 9)]
    expected = [torch.sigmoid(x) for x in inputs]
    with scripted_server(reply) as (url, received):
        aoti_eager.enable(["aten::sigmoid"], devices=["cpu"], cache_dir=tmp_path / "cache", remote=url, compile="never")
        assert_same_as_eager(torch.sigmoid(inputs[0]), expected[0])
        asked = len(received)
        assert asked >= 1
        assert_same_as_eager(torch.sigmoid(inputs[1]), expected[1])
        assert len(received) == asked, "the server was asked again within the retry interval"
    said = refusals(caplog)
    assert len(said) == 1 and "not the reply expected" in said[0], said


def test_an_oversized_entry_is_refused_without_being_read(server, keys, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AOTI_EAGER_REMOTE_MAX_ENTRY", "1MiB")
    publish_kernel(machine(tmp_path / "a", server.url), tmp_path, key="k")
    big = os.urandom(4 << 20)
    server.client.hset(_stored(server), mapping={LIBRARY_FILE: big, "entry.json": big, "kernel.json": big})
    sent_before = int(server.client.info("stats")["total_net_output_bytes"])
    assert machine(tmp_path / "b", server.url).lookup("aten::abs", "k") is None
    assert int(server.client.info("stats")["total_net_output_bytes"]) - sent_before < 1 << 20
    said = refusals(caplog)
    assert len(said) == 1 and "over AOTI_EAGER_REMOTE_MAX_ENTRY" in said[0] and "refused unread" in said[0], said


def test_a_miss_fetches_at_most_the_cap_of_a_familys_keys_however_many_are_planted(server, keys, tmp_path):
    from aoti_eager.kernels import CallSignature
    from aoti_eager.kernels.compile import compile_options
    from aoti_eager.kernels.dynamic import family_key
    from aoti_eager.kernels.signature import qualified_name

    here, op = environment_name(torch.device("cpu"), compile_options("cpu")), torch.ops.aten.sigmoid.default
    x = torch.randn(6)
    expected = torch.sigmoid(x)
    prefix = family_key(CallSignature.of(op, "cpu", [x])) + "-"
    publisher = KernelCache(tmp_path / "a", here)
    publisher.behind = remote.tier(server.url, here)
    publish_kernel(publisher, tmp_path, key=prefix + "0" * 8, op=qualified_name(op))  # the op's index, as published
    # Keys of the family planted in the index, as anyone who can write to the server could.
    index, planted = remote.keys_key(here, qualified_name(op)), [f"{prefix}{i:08d}" for i in range(1, 20001)]
    if server.client.type(index) == b"zset":
        server.client.zadd(index, dict.fromkeys(planted, 0))
    else:
        server.client.sadd(index, *planted)
    server.client.config_resetstat()
    aoti_eager.enable(["aten::sigmoid"], devices=["cpu"], cache_dir=tmp_path / "b", remote=server.url, compile="never")
    assert_same_as_eager(torch.sigmoid(x), expected)
    stats = server.client.info("commandstats")
    # Entries read: the signature's own, then at most the cap of its family's.
    reads = sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("eval", "evalsha", "hgetall"))
    assert 1 <= reads <= 1 + remote.MAX_LISTED_KEYS, stats


def test_an_entry_nobody_here_trusts_is_replaced_by_a_verified_one(server, keys, tmp_path, monkeypatch):
    # First on the keys: an entry signed by a key that nobody trusts, and garbage.
    signing.generate_key_pair(tmp_path / "stranger")
    monkeypatch.setenv(settings.signing_key.name, str(tmp_path / "stranger"))
    publish_kernel(machine(tmp_path / "x", server.url), tmp_path, key="k1", content=b"\x7fELF the stranger's")
    server.client.hset(_stored(server, "k2"), mapping={LIBRARY_FILE: b"\x7fELF garbage", remote.SIGNATURE_FIELD: b"[[["})
    monkeypatch.setenv(settings.signing_key.name, str(keys))
    publisher = machine(tmp_path / "a", server.url)
    for key in ("k1", "k2"):
        publish_kernel(publisher, tmp_path, key=key, content=b"\x7fELF trusted")
    for key in ("k1", "k2"):
        assert machine(tmp_path / f"c-{key}", server.url).lookup("aten::abs", key).library.read_bytes() == b"\x7fELF trusted"


def test_an_older_signed_entry_put_back_is_undone_by_the_next_publication(server, keys, tmp_path):
    publish_kernel(machine(tmp_path / "a", server.url), tmp_path, key="k", content=b"\x7fELF old")
    old = server.client.hgetall(_stored(server))
    server.client.delete(_stored(server))  # evicted, or removed by hand; then compiled again
    second = machine(tmp_path / "b", server.url)
    publish_kernel(second, tmp_path, key="k", content=b"\x7fELF new")
    server.client.delete(_stored(server))
    server.client.hset(_stored(server), mapping=old)  # the old signed entry put back
    # The next publication of the newer one (a push, or a compile after a lock expired) replaces it.
    assert second.behind.offer("aten::abs", "k", second.entry_dir("aten::abs", "k"))
    assert machine(tmp_path / "c", server.url).lookup("aten::abs", "k").library.read_bytes() == b"\x7fELF new"


def test_a_manifest_without_a_creation_time_is_accepted_as_the_oldest(server, keys, tmp_path, monkeypatch):
    with_time = signing.manifest_of
    monkeypatch.setattr(signing, "manifest_of", lambda members, created=None: json.dumps(
        {"format": signing.MANIFEST_FORMAT, "members": members}, indent=1, sort_keys=True).encode())
    publish_kernel(machine(tmp_path / "a", server.url), tmp_path, key="k", content=b"\x7fELF from before")
    monkeypatch.setattr(signing, "manifest_of", with_time)
    assert machine(tmp_path / "b", server.url).lookup("aten::abs", "k").library.read_bytes() == b"\x7fELF from before"
    assert signing.manifest_created(server.client.hget(_stored(server), remote.MANIFEST_FIELD)) == 0
    publish_kernel(machine(tmp_path / "c", server.url), tmp_path, key="k", content=b"\x7fELF dated")
    assert machine(tmp_path / "d", server.url).lookup("aten::abs", "k").library.read_bytes() == b"\x7fELF dated"


def test_a_refused_publication_releases_the_fleet_lock(keys, tmp_path, monkeypatch, caplog):
    remote.forget()
    full = RedisServer(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    try:
        cache = machine(tmp_path / "a", full.url)
        lock = remote.lock_key(ENVIRONMENT, "aten::abs", "k")
        with cache.lock_signature("aten::abs", "k"):
            assert full.client.get(lock) is not None
            publish_kernel(cache, tmp_path, key="k", content=os.urandom(4 << 20))  # out of memory: refused
        assert full.client.get(lock) is None
        said = refusals(caplog)
        assert len(said) == 1 and "maxmemory" in said[0], said
    finally:
        full.stop()


def test_a_lock_without_a_ttl_is_stale_after_the_lock_ttl(server, tmp_path, monkeypatch):
    monkeypatch.setenv(settings.remote_lock_ttl.name, "0.5")
    tier = machine(tmp_path / "a", server.url).behind
    lock = remote.lock_key(ENVIRONMENT, "aten::abs", "k")
    server.client.set(lock, "set by hand, with no TTL")
    with pytest.raises(TimeoutError):
        with tier.lock_signature("aten::abs", "k", timeout=0.2):
            pass
    assert 0 < server.client.pttl(lock) <= 500
    time.sleep(0.6)
    with tier.lock_signature("aten::abs", "k", timeout=0.2) as held:
        assert held and server.client.get(lock) != b"set by hand, with no TTL"


def _lock_of_a_sigmoid_call(server: RedisServer, x: torch.Tensor) -> str:
    """Sets by hand, with no TTL, the fleet lock that a sigmoid call of ``x`` would take; returns its key."""
    from aoti_eager.kernels import CallSignature
    from aoti_eager.kernels.compile import compile_options

    here = environment_name(torch.device("cpu"), compile_options("cpu"))
    signature = CallSignature.of(torch.ops.aten.sigmoid.default, "cpu", [x])
    lock = remote.lock_key(here, "aten::sigmoid", signature.key)
    server.client.set(lock, "set by hand, with no TTL")
    return lock


def test_a_call_finding_the_fleet_lock_taken_runs_eagerly_without_waiting(server, keys, tmp_path, monkeypatch):
    monkeypatch.setenv(settings.lock_timeout.name, "3")
    x = torch.randn(10)
    expected = torch.sigmoid(x)
    lock = _lock_of_a_sigmoid_call(server, x)
    aoti_eager.enable(["aten::sigmoid"], devices=["cpu"], cache_dir=tmp_path / "cache", remote=server.url)
    started = time.monotonic()
    for _ in range(3):
        assert_same_as_eager(torch.sigmoid(x), expected)
    assert time.monotonic() - started < 2, "a call waited for another machine's compile"
    assert aoti_eager.stats()["aten::sigmoid"]["compiles"] == 0
    assert 0 < server.client.pttl(lock) <= settings.remote_lock_ttl.get() * 1000


def test_a_wait_for_the_fleet_lock_leaves_the_compile_lock_free(server, keys, tmp_path, monkeypatch):
    from aoti_eager import _mechanism, _worker
    from aoti_eager.kernels import CallSignature, CompileRequest

    monkeypatch.setenv(settings.lock_timeout.name, "3")
    monkeypatch.setenv(settings.remote.name, server.url)
    x = torch.randn(10)
    _lock_of_a_sigmoid_call(server, x)
    signature = CallSignature.of(torch.ops.aten.sigmoid.default, "cpu", [x])
    request = CompileRequest("aten::sigmoid", "cpu", signature.key, signature.to_json())
    errors = []

    def warm() -> None:
        try:
            _worker.warm(request, tmp_path / "cache", fleet_wait=1.5)  # as a background worker waits
        except TimeoutError as e:
            errors.append(e)

    call = threading.Thread(target=warm)
    call.start()
    time.sleep(0.3)  # the worker is waiting for the fleet's lock
    free = _mechanism.compile_lock.acquire(timeout=0.5)
    if free:
        _mechanism.compile_lock.release()
    call.join()
    assert free, "the process-wide compile lock was held while waiting for another machine"
    assert len(errors) == 1, "the worker compiled under a lock another machine holds"


def test_a_listing_of_the_servers_entries_leaves_out_keys_that_no_entry_has(server, keys, tmp_path):
    publish_kernel(machine(tmp_path / "a", server.url), tmp_path, key="k")
    entry = f"{remote.NAMESPACE}:entry"
    # Planted by anyone who can write to the server: names that climb out of a cache, or do not parse.
    for planted in (f"{entry}:{ENVIRONMENT}:..:k", f"{entry}:{ENVIRONMENT}:aten.abs:../../../outside",
                    f"{entry}:{ENVIRONMENT}:aten.abs:k:more", f"{entry}:short", f"{entry}:{ENVIRONMENT}:aten.abs:"):
        server.client.hset(planted, LIBRARY_FILE, b"\x7fELF planted")
    for op in (None, "aten::abs"):
        listed = [(e.environment, e.op, e.signature_key) for e in remote.entries(remote.server(server.url), op=op)]
        assert listed == [(ENVIRONMENT, "aten::abs", "k")]


def test_a_scan_that_never_comes_back_to_its_start_is_given_up(keys, monkeypatch):
    remote.forget()
    monkeypatch.setattr(remote, "MAX_SCAN_PAGES", 5)
    with scripted_server(b"*2\r\n$1\r\n1\r\n*0\r\n") as (url, received):  # "more to come", forever
        with pytest.raises(remote.ServerUnavailable, match="did not end after 5 pages"):
            list(remote.entries(remote.server(url)))
        assert received == [b"SCAN"] * 5


def test_a_family_listing_holds_at_most_the_cap_whatever_the_server_answers(keys, monkeypatch):
    remote.forget()
    members = [b"p-%02d" % i for i in range(remote.MAX_LISTED_KEYS + 8)]  # LIMIT ignored
    reply = b"*%d\r\n" % len(members) + b"".join(b"$%d\r\n%s\r\n" % (len(m), m) for m in members)
    with scripted_server(reply) as (url, _):
        listed = remote.tier(url, ENVIRONMENT).keys("aten::abs", "p-")
    assert listed == [m.decode() for m in members[:remote.MAX_LISTED_KEYS]]
