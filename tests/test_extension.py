"""The C++ extension: built once per torch build and user, and loaded only as built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from aoti_eager import _extension
from aoti_eager.cache import layout


def test_the_extension_is_built_once_per_user_not_per_cache_root(tmp_path):
    """Kernel cache roots come and go; the extension stays where it was built."""
    script = "import aoti_eager, torch; aoti_eager.enable(['aten::abs'], devices=['cpu'], compile='never', cache_dir={!r}); print(aoti_eager._extension.build_directory())"
    directories = {
        subprocess.run([sys.executable, "-c", script.format(str(tmp_path / name))], capture_output=True, text=True,
                       check=True, env={**os.environ, "AOTI_EAGER_CACHE_DIR": str(tmp_path / name)}).stdout.strip()
        for name in ("one", "two")
    }
    assert len(directories) == 1
    assert directories.pop().startswith(str(layout.private_root()))


@pytest.fixture
def built(tmp_path, monkeypatch):
    """A copy of the built extension, with its record, standing in for the real
    one; tests call ``load`` past its cache, which keeps the real module."""
    _extension.load()
    real = _extension.build_directory()
    copy = tmp_path / "extension"
    copy.mkdir(mode=0o700)
    for name in ("_C.so", _extension._RECORD):
        shutil.copy2(real / name, copy / name)
    monkeypatch.setattr(_extension, "build_directory", lambda: copy)
    rebuilt = []
    monkeypatch.setattr(_extension, "_build", lambda directory: rebuilt.append(1) or shutil.copy2(real / "_C.so", directory / "_C.so"))
    monkeypatch.setattr(_extension, "_import_from", lambda library: library)
    return copy / "_C.so", rebuilt


def test_the_extension_as_built_is_loaded_without_building(built):
    library, rebuilt = built
    assert _extension._why_untrusted(library) is None
    assert _extension.load.__wrapped__() == library and rebuilt == []


@pytest.mark.parametrize("damage", ["truncated", "replaced", "writable by others", "record missing"])
def test_an_extension_that_is_not_as_built_is_built_again_never_loaded(built, damage):
    library, rebuilt = built
    if damage == "truncated":
        # Loading a truncated library kills the process with SIGBUS before Python can raise.
        os.truncate(library, library.stat().st_size // 2)
    elif damage == "replaced":
        library.write_bytes(library.read_bytes()[:-16] + b"\0" * 16)
    elif damage == "writable by others":
        os.chmod(library, 0o777)
    else:
        library.with_name(_extension._RECORD).unlink()
    assert _extension._why_untrusted(library) is not None
    assert _extension.load.__wrapped__() == library and rebuilt == [1]
    assert _extension._why_untrusted(library) is None
