"""Compiles one manifest entry in a process of its own.

Prewarming and background compiles run each entry in a child process
(``python -m aoti_eager._worker CACHE_DIR``, the entry as JSON on stdin): a
compiler that crashes or runs out of memory then takes down only the child.
The child rebuilds the call from its signature and makes it with the op
enabled, so the entry is compiled, validated and published exactly as the
miss of a real call would be.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from aoti_eager.manifest import ManifestEntry

# The command that runs a worker (tests replace it to make workers fail).
COMMAND = [sys.executable, "-m", "aoti_eager._worker"]


@dataclass
class Outcome:
    """What became of one entry: ``compiled``, ``cached`` (someone else
    compiled it), ``eager`` (decided eager, see ``reason``) or ``failed``."""

    status: str
    reason: str | None = None
    seconds: float = 0.0


def warm(entry: ManifestEntry, root: Path) -> Outcome:
    """Makes ``entry``'s call with its op enabled; runs in the worker process."""
    import torch

    import aoti_eager
    from aoti_eager import _ops
    from aoti_eager.cache import KernelCache
    from aoti_eager.kernels.compile import call_op, compile_options
    from aoti_eager.kernels.examples import example_arguments

    op = _ops.overload_named(entry.op)
    device = torch.device(entry.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    args = example_arguments(entry.signature, device)
    aoti_eager.enable([op], devices=[entry.device], cache_dir=root, record=None)
    try:
        call_op(op, args)
        stats = aoti_eager.stats()[entry.op]
    finally:
        aoti_eager.disable()
    published = KernelCache(root, device, compile_options(device.type, root)).lookup(entry.op, entry.key)
    if published is None:
        reason = stats["fallback_reason"] or "the rebuilt call did not produce the recorded cache entry"
        return Outcome("failed", reason)
    if published.library is None:
        return Outcome("eager", published.reason)
    return Outcome("compiled" if stats["compiles"] else "cached", seconds=stats["compile_seconds"])


# Workers running now, so that an interrupted parent can stop them.
_running: set[subprocess.Popen] = set()
_running_lock = threading.Lock()
# Set at exit (see shutdown()): no worker starts any more.
stopped = False


def run(entry: ManifestEntry, root: Path, timeout: float | None = None) -> Outcome:
    """Runs :func:`warm` for ``entry`` in a child process; never raises for
    what happens in the child (a crash or timeout is a ``failed`` outcome)."""
    env = {k: v for k, v in os.environ.items() if k != "AOTI_EAGER_RECORD"}
    with _running_lock:
        if stopped:
            return Outcome("failed", "the process is exiting")
        process = subprocess.Popen(
            [*COMMAND, str(root)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env,
        )
        _running.add(process)
    try:
        out, err = process.communicate(json.dumps(asdict(entry)), timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return Outcome("failed", f"the compile took over {timeout:.0f} s and was stopped")
    finally:
        with _running_lock:
            _running.discard(process)
    if process.returncode < 0:
        name = signal.Signals(-process.returncode).name
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        return Outcome("failed", f"the compiling process died of {name}{hint}")
    try:
        return Outcome(**json.loads(out.strip().splitlines()[-1]))
    except (ValueError, TypeError, IndexError):
        last = (err.strip().splitlines() or ["no output"])[-1]
        return Outcome("failed", f"the compiling process exited with code {process.returncode}: {last[:300]}")


def stop_all() -> None:
    """Kills every running worker; what they leave is cleaned up by the next compile of their op."""
    with _running_lock:
        for process in _running:
            process.kill()


def shutdown() -> None:
    """Kills every running worker and starts no more (at exit)."""
    global stopped
    with _running_lock:
        stopped = True
    stop_all()


def main() -> int:
    entry = ManifestEntry(**json.loads(sys.stdin.read()))
    try:
        outcome = warm(entry, Path(sys.argv[1]))
    except Exception as e:  # noqa: BLE001 - reported to the parent as the reason
        outcome = Outcome("failed", f"{type(e).__name__}: {e}")
    print(json.dumps(asdict(outcome)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
