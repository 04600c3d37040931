"""Fused regions shared as ops' kernels are: in signed bundles, through the
fleet cache (a real redis-server), listed and cleared by the command line."""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

import aoti_eager
from aoti_eager import cli, settings
from aoti_eager.cache import remote
from helpers import (
    REDIS_SERVER, Block, Model, compile_block, cpu_cache, delta_since, free_port, publish_kernel, refusals, rewrite, row,
    row_in_a_child, with_crafted_library,
)

needs_redis_server = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not installed (scripts/setup_env.sh installs it)")

REGION = f"region::{Block.__module__}.Block"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """A cache holding the region of :class:`Block` for a call on a (4, 16) tensor; copy it to change it."""
    root = tmp_path_factory.mktemp("region-cache")
    compile_block(root, Block)
    return root


def _copy(compiled: Path, to: Path) -> Path:
    shutil.copytree(compiled, to, symlinks=True)
    return to


def _key(root: Path) -> str:
    [(op, key)] = cpu_cache(root).entries()
    assert op == REGION
    return key


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _bundle(capsys, root: Path, key: Path, path: Path) -> Path:
    code, out, err = _cli(capsys, "--cache-dir", str(root), "cache", "export", str(path), "--sign-key", str(key))
    assert code == 0 and "exported 1 entries" in out, out + err
    return path


def test_a_region_imported_from_a_signed_bundle_makes_no_compile_in_a_new_process(compiled, key, tmp_path, capsys):
    path = _bundle(capsys, compiled, key, tmp_path / "regions.tar.gz")
    target = tmp_path / "b"
    code, out, err = _cli(capsys, "--cache-dir", str(target), "cache", "import", str(path), "--trust-key", f"{key}.pub")
    assert code == 0 and "imported 1 entries" in out, out + err
    assert _key(target) == _key(compiled)
    row = row_in_a_child(target, Block)
    # Its first forward: the kernel loaded from the imported entry, every call after the first (which records what the
    # forward reads) a hit, eager's result (the child compares).
    assert (row["compiles"], row["cache_loads"], row["calls"], row["hits"], row["eager_calls"]) == (0, 1, 2, 1, 1), row


def test_a_tampered_region_bundle_is_refused_with_one_line(compiled, key, tmp_path, capsys):
    path = _bundle(capsys, compiled, key, tmp_path / "regions.tar.gz")
    target = tmp_path / "b"
    crafted = rewrite(path, with_crafted_library)  # another library, entry.json's sha256 made to match it
    code, out, err = _cli(capsys, "--cache-dir", str(target), "cache", "import", str(crafted), "--trust-key", f"{key}.pub")
    assert code == 1 and len(err.splitlines()) == 1 and "do not match its signed manifest" in err, out + err
    assert list(cpu_cache(target).entries()) == []


def test_a_tampered_region_entry_is_set_aside_never_loaded(compiled, tmp_path, caplog):
    root = _copy(compiled, tmp_path / "cache")
    library = cpu_cache(root).entry_dir(REGION, _key(root)) / "kernel.so"
    data = bytearray(library.read_bytes())
    data[len(data) // 2] ^= 0xFF
    library.write_bytes(bytes(data))
    torch.manual_seed(0)
    model, x = Model(Block).eval(), torch.randn(4, 16)
    with torch.no_grad():
        expected = model.blocks[0](x)
        aoti_eager.fuse(model, cache_dir=root, compile="never")
        before = row(Block)
        actual = model.blocks[0](x)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert delta_since(before, Block) == {"calls": 1, "hits": 0, "fallbacks": 1, "compiles": 0, "cache_loads": 0}
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "set aside" in r.getMessage()]
    assert len(said) == 1 and "artifact does not match its recorded sha256" in said[0], said
    assert list(cpu_cache(root).entries()) == [] and len(list((root / "quarantine").iterdir())) == 1


def test_cache_list_names_the_region_and_clear_op_removes_it_alone(compiled, tmp_path, capsys):
    root = _copy(compiled, tmp_path / "cache")
    publish_kernel(cpu_cache(root), tmp_path, key="k")  # an op's entry beside it
    code, out, _ = _cli(capsys, "--cache-dir", str(root), "cache", "list")
    assert code == 0 and f"{REGION}: 1 entries" in out and "(args[0]=float32[4, 16])" in out, out
    code, out, _ = _cli(capsys, "--cache-dir", str(root), "cache", "list", "--op", REGION, "--json")
    [row] = json.loads(out)
    assert (row["op"], row["key"], row["signature"], row["eager_reason"]) == (REGION, _key(compiled), "args[0]=float32[4, 16]", None)
    code, out, _ = _cli(capsys, "--cache-dir", str(root), "cache", "clear", "--op", REGION)
    assert code == 0 and "removed 1 entries" in out, out
    assert list(cpu_cache(root).entries()) == [("aten::abs", "k")]


def test_fuse_refuses_a_remote_that_is_not_a_url():
    with pytest.raises(ValueError, match="remote='cache-host' is not"):
        aoti_eager.fuse(Model(Block), remote="cache-host")


@needs_redis_server
def test_a_region_published_to_the_fleet_is_loaded_by_another_machine(server, keys, tmp_path, monkeypatch):
    monkeypatch.delenv(settings.remote.name, raising=False)  # fuse(remote=...) names it
    first = row_in_a_child(tmp_path / "machine-a", Block, server.url)
    assert (first["compiles"], first["cache_loads"], first["hits"]) == (1, 0, 1), first
    listed = [(e.op, e.signature_key) for e in remote.entries(remote.server(server.url))]
    assert listed == [(REGION, _key(tmp_path / "machine-a"))]
    second = row_in_a_child(tmp_path / "machine-b", Block, server.url)
    # An empty local cache: the fleet's entry verified, published locally and loaded; no compile.
    assert (second["compiles"], second["cache_loads"], second["hits"], second["eager_calls"]) == (0, 1, 1, 1), second
    assert _key(tmp_path / "machine-b") == listed[0][1]


def test_a_fleet_that_does_not_answer_leaves_regions_on_the_local_cache(compiled, keys, tmp_path, monkeypatch, caplog):
    remote.forget()
    dead = f"redis://127.0.0.1:{free_port()}/0"
    torch.manual_seed(0)
    model, x, y = Model(Block).eval(), torch.randn(4, 16), torch.randn(5, 16)
    reference = copy.deepcopy(model)
    aoti_eager.fuse(model, cache_dir=_copy(compiled, tmp_path / "cache"), remote=dead)
    before = row(Block)
    with torch.no_grad():
        # A local entry: the fleet is never asked.
        for block, eager in zip(model.blocks, reference.blocks):
            torch.testing.assert_close(block(x), eager(x))
        assert refusals(caplog) == []
        # A miss: the fleet is asked, fails, and the region compiles here.
        for block, eager in zip(model.blocks, reference.blocks):
            torch.testing.assert_close(block(y), eager(y))
    # The local entry's first call runs the original forward, whose result checks what the entry keeps.
    assert delta_since(before, Block) == {"calls": 6, "hits": 5, "fallbacks": 0, "compiles": 1, "cache_loads": 1}
    said = refusals(caplog)
    assert len(said) == 1 and "cannot connect" in said[0], said


class ElsewhereCompiling:
    """Another machine holding the fleet lock of :class:`Block`'s call on a (4, 16) tensor, the kernel
    of ``compiled`` its compile's; and a fused model, whose first block's calls the tests make."""

    def __init__(self, compiled: Path, server, root: Path, compile: str):
        self.compiled, self.key = compiled, _key(compiled)
        self.tier = remote.tier(server.url, cpu_cache(compiled).directory.name)
        self.lock = remote.lock_key(self.tier.environment, REGION, self.key)
        self.server = server
        server.client.set(self.lock, "another machine's compile")
        torch.manual_seed(0)
        self.model, self.x = Model(Block).eval(), torch.randn(4, 16)
        with torch.no_grad():
            self.expected = self.model.blocks[0](self.x)
        aoti_eager.fuse(self.model, cache_dir=root, remote=server.url, compile=compile)
        self.before = row(Block)

    def call(self, **exact) -> None:
        with torch.no_grad():
            torch.testing.assert_close(self.model.blocks[0](self.x), self.expected, **exact)

    def publish(self) -> None:
        """The other machine publishes its kernel and lets its lock go."""
        assert self.tier.offer(REGION, self.key, cpu_cache(self.compiled).entry_dir(REGION, self.key))
        self.server.client.delete(self.lock)


@needs_redis_server
def test_a_region_another_machine_compiles_runs_eagerly_then_loads_its_kernel(compiled, server, keys, tmp_path):
    elsewhere = ElsewhereCompiling(compiled, server, tmp_path / "cache", "now")
    elsewhere.call(rtol=0, atol=0)
    assert delta_since(elsewhere.before, Block) == {"calls": 1, "hits": 0, "fallbacks": 1, "compiles": 0, "cache_loads": 0}
    assert "another machine is compiling it" in row(Block)["fallback_reason"]
    elsewhere.publish()
    elsewhere.call()  # the next call loads it, and runs the original forward, whose result checks the entry
    elsewhere.call()
    assert delta_since(elsewhere.before, Block) == {"calls": 3, "hits": 1, "fallbacks": 1, "compiles": 0, "cache_loads": 1}


@needs_redis_server
def test_a_background_compile_another_machine_outlasts_is_tried_again_at_the_next_call(compiled, server, keys, tmp_path, monkeypatch):
    monkeypatch.setenv(settings.lock_timeout.name, "1")
    elsewhere = ElsewhereCompiling(compiled, server, tmp_path / "cache", "background")
    elsewhere.call(rtol=0, atol=0)
    assert aoti_eager.wait(timeout=60)  # its wait for the other machine's lock ran out
    elsewhere.call(rtol=0, atol=0)
    assert "another machine is compiling it" in row(Block)["fallback_reason"]
    elsewhere.publish()
    elsewhere.call()
    elsewhere.call()
    assert delta_since(elsewhere.before, Block) == {"calls": 4, "hits": 1, "fallbacks": 2, "compiles": 0, "cache_loads": 1}
