"""The command line."""

from __future__ import annotations

import os
import subprocess
import sys


def test_cache_path_follows_the_environment(tmp_path):
    env_dir = tmp_path / "cache"
    out = subprocess.run(
        [sys.executable, "-m", "aoti_eager", "cache", "path"],
        capture_output=True, text=True, env={**os.environ, "AOTI_EAGER_CACHE_DIR": str(env_dir)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(env_dir)


def test_unknown_command_exits_2():
    out = subprocess.run([sys.executable, "-m", "aoti_eager", "bogus"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "invalid choice" in out.stderr
