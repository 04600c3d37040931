"""Where compiles run: a private directory at a path compiler command lines take as it is."""

from __future__ import annotations

import os
import subprocess
import sys

from aoti_eager.cache import layout
from aoti_eager.kernels.inductor import scratch


def test_compiles_run_at_a_path_without_spaces_even_when_the_private_directory_has_one(private_root, monkeypatch, tmp_path):
    from aoti_eager.cache import layout

    monkeypatch.setattr(layout, "private_root", lambda: tmp_path / "with space" / "private")
    monkeypatch.setattr(scratch.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    scratch.root.cache_clear()
    workdir = scratch.compile_directory()
    assert " " not in workdir.name and workdir.name.startswith(str(tmp_path / "tmp"))
    workdir.cleanup()


def test_what_dead_compiles_left_is_removed_by_the_next_compile(private_root):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = scratch.root() / f"{layout.process_prefix('compile')}{dead.stdout.strip()}-x1"
    another_host = scratch.root() / f"compile-elsewhere-{dead.stdout.strip()}-x2"
    for directory in (abandoned, another_host):
        directory.mkdir()
        (directory / "kernel.cpp").write_text("// half written")
    running = scratch.compile_directory()  # this process's: kept
    later = scratch.compile_directory()
    assert not abandoned.exists()
    assert another_host.exists(), "a process of another host sharing the directory may still run"
    assert running.name != later.name and os.path.isdir(running.name) and os.path.isdir(later.name)
    running.cleanup()
    later.cleanup()


def test_python_temporary_files_go_to_the_scratch_root_with_the_environment_untouched(private_root):
    environment, before = dict(os.environ), scratch.tempfile.gettempdir()
    with scratch.python_temporary_files():
        with scratch.tempfile.NamedTemporaryFile() as f:
            assert os.path.dirname(f.name) == str(scratch.root() / "tmp")
        assert dict(os.environ) == environment
    assert scratch.tempfile.gettempdir() == before


def test_a_compile_sends_temporary_files_and_inductors_cache_to_the_scratch_root(private_root, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    environment, before = dict(os.environ), scratch.tempfile.gettempdir()
    with scratch.compiling():
        assert os.environ["TMPDIR"] == scratch.tempfile.gettempdir() == str(scratch.root() / "tmp")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(scratch.root() / "inductor")
    assert dict(os.environ) == environment and scratch.tempfile.gettempdir() == before
