"""Where the cache lives (aoti_eager.cache.layout): its roots, the user's
private directory, and the names and directories made there."""

from __future__ import annotations

import os
import re
import stat

import pytest
import torch

from aoti_eager.cache import KernelCache, layout
from aoti_eager.kernels import toolchain
from aoti_eager.kernels.toolchain import environment_name
from helpers import publish_kernel

CPU = torch.device("cpu")


@pytest.mark.parametrize("xdg", [None, "elsewhere"])
def test_default_root_is_per_user(monkeypatch, tmp_path, xdg):
    monkeypatch.delenv("AOTI_EAGER_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    # A user's cache directory need not lie under their home.
    if xdg:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / xdg))
    else:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    expected = tmp_path / (xdg or "home/.cache") / "aoti_eager"
    assert layout.default_root() == expected


def test_a_shared_cache_is_created_for_the_group(tmp_path, monkeypatch, swap_toolchain):
    monkeypatch.setenv("AOTI_EAGER_CACHE_GROUP", str(os.getgid()))
    swap_toolchain(cpu_isa=lambda: "avx2")
    cache = KernelCache(tmp_path / "team", environment_name(CPU))
    published = publish_kernel(cache, tmp_path)
    for path in (published.library.parent, published.library.parent.parent, tmp_path / "team"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o2770 and path.stat().st_gid == os.getgid(), path
    assert stat.S_IMODE(published.library.stat().st_mode) == 0o640
    assert cache.lookup("aten::abs", "sig") is not None


def test_cache_directories_are_private_at_every_level_made(tmp_path, monkeypatch):
    monkeypatch.delenv("AOTI_EAGER_CACHE_GROUP", raising=False)
    os.chmod(tmp_path, 0o755)
    layout.make_cache_dirs(tmp_path / "a" / "b" / "c")
    for path in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o755  # what existed is left as it was


@pytest.mark.parametrize("text", ["avx512 avx512_vnni", "team cache/caché-κ-日本", "cpu-avx2-torch2.13.0+cpu-0123abcd"])
def test_safe_names_replace_each_other_character(text):
    name = layout.safe_name(text)
    assert len(name) == len(text)
    assert all(a == b if re.fullmatch(r"[A-Za-z0-9._+-]", b) else a == "_" for a, b in zip(name, text)), name


def test_the_private_directory_is_believed_only_as_this_users_alone(private_root, tmp_path):
    """Machine records, the extension and shared build products are believed
    or loaded unchecked: their directory must be this user's, and nobody else's
    to write."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    private_root.parent.mkdir(parents=True, exist_ok=True)
    private_root.symlink_to(elsewhere)
    with pytest.raises(PermissionError, match="not a directory of this user's"):
        layout.private_directory("machine")
    assert list(elsewhere.iterdir()) == []
    private_root.unlink()
    private_root.mkdir(mode=0o777)
    os.chmod(private_root, 0o777)
    layout.private_directory("machine")
    assert private_root.stat().st_mode & 0o777 == 0o700

