"""Symbolic links planted in the cache: no command that removes, moves or
sizes things follows one out of the cache."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from aoti_eager.cache import KernelCache, inventory, layout
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE
from aoti_eager.cli import main
from aoti_eager.kernels import toolchain
from aoti_eager.kernels.toolchain import environment_name
from helpers import publish_kernel


@pytest.fixture
def cache(tmp_path, swap_toolchain):
    swap_toolchain(cpu_isa=lambda: "avx2")
    cache = KernelCache(tmp_path / "cache", environment_name(torch.device("cpu")))
    publish_kernel(cache, tmp_path, "sig")
    return cache


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory out of the cache shaped like every level of it, each holding a canary."""
    outside = tmp_path / "outside"
    for directory in ["", "victim", ".shared", ".tmp-victim", "victim/victim"]:
        (outside / directory).mkdir(exist_ok=True)
        (outside / directory / "canary").write_text("still here")
    (outside / "victim" / ENTRY_FILE).write_text("{")  # a damaged "entry", for verify --quarantine
    return outside


def snapshot(directory: Path) -> dict[str, str | None]:
    return {str(p.relative_to(directory)): None if p.is_dir() else p.read_text() for p in sorted(directory.rglob("*"))}


def plant(cache: KernelCache, outside: Path, level: str) -> Path:
    """A link to ``outside`` in place of a directory (or file) of the cache."""
    op_dir = cache.entry_dir("aten::abs", "sig").parent
    where = {
        "environment": cache.root / layout.LAYOUT_VERSION / "cpu-linked",
        "op": op_dir.parent / "aten.abs.Tensor",
        "entry": op_dir / "linked",
        "library": cache.entry_dir("aten::abs", "sig") / LIBRARY_FILE,
        "temporary": op_dir / ".tmp-linked",
        "shared": op_dir.parent / ".shared",
        "quarantine": cache.root / "quarantine",
    }[level]
    if where.exists():
        where.unlink() if where.is_file() else shutil.rmtree(where)
    where.symlink_to(outside / "victim" / "canary" if level == "library" else outside)
    return where


LEVELS = ["environment", "op", "entry", "library", "temporary", "shared", "quarantine"]
COMMANDS = [
    ["cache", "clear"],
    ["cache", "clear", "--op", "abs"],
    ["cache", "prune", "--max-size", "0"],
    ["cache", "verify", "--quarantine"],
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_no_command_follows_a_link_out_of_the_cache(cache, outside, level, command, capsys):
    before = snapshot(outside)
    link = plant(cache, outside, level)
    code = main(["--cache-dir", str(cache.root), *command])
    assert code in (0, 1), capsys.readouterr()
    assert snapshot(outside) == before
    out_of_scope = "--op" in command and level in ("environment", "shared", "quarantine")
    if command[1] == "clear" and not out_of_scope:
        assert not os.path.lexists(link), "clear removes a link it finds (the link, not its target)"


@pytest.mark.parametrize("level", ["environment", "op", "entry"])
def test_automatic_eviction_removes_the_link_not_its_target(cache, outside, level):
    before = snapshot(outside)
    link = plant(cache, outside, level)
    eviction = inventory.evict(cache.root, max_bytes=0)
    assert snapshot(outside) == before
    assert eviction.links_removed == [link] and not os.path.lexists(link)
    assert [listing.directory.name for listing in eviction.removed] == ["sig"]


@pytest.mark.parametrize("level", ["environment", "op", "entry", "library"])
def test_verify_reports_a_link(cache, outside, level, capsys):
    link = plant(cache, outside, level)
    assert main(["--cache-dir", str(cache.root), "cache", "verify"]) == 1
    out = capsys.readouterr().out
    assert f"BAD {link if level != 'library' else link.parent}: " in out and "symbolic link" in out


def test_sizes_do_not_count_what_a_link_points_to(cache, outside):
    (outside / "big").write_bytes(b"x" * 100_000)
    library = plant(cache, outside, "library")
    library.unlink()
    library.symlink_to(outside / "big")
    plant(cache, outside, "entry")
    (listing,) = inventory.entries(cache.root)
    assert listing.bytes < 10_000


def test_a_linked_entry_is_never_loaded(cache, outside):
    shutil.copytree(cache.entry_dir("aten::abs", "sig"), outside / "copy")
    (cache.entry_dir("aten::abs", "sig").parent / "linked").symlink_to(outside / "copy")
    with pytest.raises(Exception, match="symbolic link"):
        cache.lookup("aten::abs", "linked")
    assert (outside / "copy" / LIBRARY_FILE).exists()
