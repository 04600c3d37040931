"""Whether AOTInductor's runtime loads kernels without crashing here.

A library can crash the process (a segmentation fault) when AOTInductor
creates its model container, e.g. one built by a compiler that links its own
libstdc++ (see :mod:`aoti_eager.kernels.toolchain`, which avoids the known
case). A crash cannot be caught, so the first kernel of each cache environment
is loaded once in a child process and the verdict is kept beside the
environment's entries.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_CHILD = (
    "import json, sys, aoti_eager._extension as e; "
    "e.load().CompiledKernel(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))"
)
VERDICT_FILE = "load-probe.json"


class UnsafeToLoad(RuntimeError):
    """Loading a kernel crashed a child process: kernels here stay eager."""


# Environment directory -> the reason its kernels are unsafe, or None.
_verdicts: dict[Path, str | None] = {}


def check_loads(environment_dir: Path, library: Path, device: str, output_counts: list[int]) -> None:
    """Raises UnsafeToLoad unless kernels of ``environment_dir`` load safely;
    ``library`` is the one tried if the environment has no verdict yet."""
    if environment_dir not in _verdicts:
        _verdicts[environment_dir] = _verdict(environment_dir, str(library), device, output_counts)
    if _verdicts[environment_dir] is not None:
        raise UnsafeToLoad(_verdicts[environment_dir])


def _verdict(environment_dir: Path, library: str, device: str, output_counts: list[int]) -> str | None:
    record = environment_dir / VERDICT_FILE
    try:
        return json.loads(record.read_text())["reason"]
    except (OSError, ValueError, KeyError):
        pass
    from aoti_eager.cache.layout import atomic_write_text

    child = subprocess.run(
        [sys.executable, "-c", _CHILD, library, device, json.dumps(output_counts)], capture_output=True, text=True
    )
    reason = None
    if child.returncode != 0:
        how = f"signal {-child.returncode}" if child.returncode < 0 else f"exit code {child.returncode}"
        last = (child.stderr.strip().splitlines() or [""])[-1][:200]
        reason = f"AOTInductor's runtime crashed a test process loading a {device} kernel ({how}) {last}".strip()
    atomic_write_text(record, json.dumps({"reason": reason, "library": library}))
    return reason
