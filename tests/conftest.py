from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import pytest
import torch

import aoti_eager
from aoti_eager import _mechanism, settings
from aoti_eager.cache import KernelCache, remote, signing
from aoti_eager.kernels import pipeline, toolchain
from aoti_eager.kernels.toolchain import environment_name
from helpers import REDIS_SERVER, RedisServer

# The tests check that compiled kernels run (hits, compiles); timing them
# against eager could keep tiny test calls eager. Off for the session, and
# for the child processes it starts; tests/test_speed.py turns it on.
os.environ["AOTI_EAGER_KEEP_FASTER"] = "0"

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory):
    """One cache for the tests that are not about the cold path, so that each
    signature is compiled once per session."""
    return tmp_path_factory.mktemp("aoti_eager_cache")


@pytest.fixture
def cache(tmp_path):
    """An empty store of this machine's CPU environment at ``tmp_path``, the
    CPU's ISA fixed (no probe)."""
    with toolchain.scope(cpu_isa=lambda: "avx2"):
        yield KernelCache(tmp_path, environment_name(torch.device("cpu")))


@pytest.fixture
def swap_compiler():
    """``swap_compiler(compile=..., check=..., timer=...)``: those parts of
    every compile's :class:`~aoti_eager.kernels.pipeline.Compiler` for the rest
    of the test (:func:`~aoti_eager.kernels.pipeline.scope`)."""
    with contextlib.ExitStack() as scopes:
        yield lambda **parts: scopes.enter_context(pipeline.scope(**parts))


@pytest.fixture
def swap_loading():
    """``swap_loading(library=...)``: what loads every library, for a
    compile's checks and for the calls its kernel serves, for the rest of the
    test (:func:`aoti_eager._mechanism.scope`)."""
    with contextlib.ExitStack() as scopes:
        yield lambda **parts: scopes.enter_context(_mechanism.scope(**parts))


@pytest.fixture
def swap_toolchain():
    """``swap_toolchain(cpu_isa=..., ...)``: those answers of the
    :class:`~aoti_eager.kernels.toolchain.Toolchain` for the rest of the test
    (:func:`~aoti_eager.kernels.toolchain.scope`)."""
    with contextlib.ExitStack() as scopes:
        yield lambda **answers: scopes.enter_context(toolchain.scope(**answers))


@pytest.fixture
def key(tmp_path):
    """A private signing key; its public key is beside it as ``key.pub``."""
    signing.generate_key_pair(tmp_path / "key")
    return tmp_path / "key"


@pytest.fixture(scope="session")
def redis_session(tmp_path_factory) -> Iterator[RedisServer]:
    """A redis-server for the session; a test asks for :func:`server`."""
    pytest.importorskip("redis", reason="the fleet cache's tests need the redis client: pip install 'aoti-eager[remote]'")
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (scripts/setup_env.sh installs it)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture
def server(redis_session) -> RedisServer:
    """The session's server, emptied, and this process's view of every
    server forgotten (breakers, warnings given)."""
    redis_session.client.flushall()
    remote.forget()
    return redis_session


@pytest.fixture
def keys(tmp_path, monkeypatch) -> Path:
    """A signing key set in the environment (what the fleet cache signs with), its
    public key trusted; returns the private key."""
    signing.generate_key_pair(tmp_path / "fleet-key")
    monkeypatch.setenv(settings.signing_key.name, str(tmp_path / "fleet-key"))
    monkeypatch.setenv(settings.trusted_keys.name, str(tmp_path / "fleet-key.pub"))
    return tmp_path / "fleet-key"


@pytest.fixture
def private_root(tmp_path, monkeypatch):
    """A private directory of the test's own (machine records, shared build
    products, compile scratch), for tests about what is kept there. The C++
    extension stays where the other tests find it, and what this process
    remembered of the machine is forgotten before and after."""
    from aoti_eager import _extension
    from aoti_eager.cache import layout
    from aoti_eager.kernels import toolchain
    from aoti_eager.kernels.inductor import scratch

    _extension.load()
    # Inductor's caches stay where other tests keep them: precompiled headers take seconds to build.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(scratch.root() / "inductor")))
    toolchain.forget()
    scratch.root.cache_clear()
    monkeypatch.setattr(layout, "private_root", lambda: tmp_path / "private")
    yield tmp_path / "private"
    toolchain.forget()
    scratch.root.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def _session_load_verdicts(tmp_path_factory):
    """The load probe's verdicts (kernels/inductor/load_probe.py) of this process are
    kept in a directory of the session's, not in the user's private
    directory: a verdict a test provokes is never believed outside it."""
    from aoti_eager.kernels.inductor import load_probe

    directory = tmp_path_factory.mktemp("load-probe")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(load_probe, "verdict_directory", lambda: directory)
        yield directory


@pytest.fixture
def load_verdicts(tmp_path, monkeypatch):
    """A directory of the test's own for the load probe's verdicts, with none
    yet, on disk or in this process: every environment is probed again."""
    from aoti_eager.kernels.inductor import load_probe

    directory = tmp_path / "load-probe"
    directory.mkdir()
    monkeypatch.setattr(load_probe, "verdict_directory", lambda: directory)
    monkeypatch.setattr(load_probe, "_verdicts", {})
    monkeypatch.setattr(load_probe, "_ahead", {})
    return directory


@pytest.fixture(autouse=True)
def _restore_kernels():
    yield
    aoti_eager.disable()
    # Each test starts as a new process would: from the cache, not from what an earlier test decided.
    aoti_eager._overrides.forget()
