"""What the test modules share, besides fixtures (tests/conftest.py): no test
module imports another. Comparisons against eager; cache entries, stand-in
kernels and compiles; bundles rewritten; a redis-server of the tests' own and
the fleet cache's machines; the fused regions' models, their stats rows and a
new process that loads them."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import logging
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import aoti_eager
from aoti_eager._planner import Planner
from aoti_eager.cache import Entry, KernelCache, remote
from aoti_eager.cache.store import ENTRY_FILE, LIBRARY_FILE, metadata_digest
from aoti_eager.kernels import CallSignature, CompileRequest
from aoti_eager.kernels.compile import Artifact, compile_options
from aoti_eager.kernels.region import REGION_PREFIX
from aoti_eager.kernels.toolchain import environment_name

# The repository's root: a new process of a test finds the package and tests/ there.
ROOT = Path(__file__).resolve().parent.parent

SIGNATURE = [{"name": "self", "kind": "tensor", "dtype": "float32", "device": "cpu", "sizes": [4], "strides": [1], "aligned": True}]


def publish_kernel(cache: KernelCache, tmp_path: Path, key: str = "sig", content: bytes = b"\x7fELF kernel",
                   op: str = "aten::abs", sidecar: str | None = None) -> Entry:
    """Publishes a stand-in kernel (bytes, never loaded) under ``key``, with
    ``sidecar`` as its kernel.json if given."""
    library = tmp_path / f"built-{key}-{uuid.uuid4().hex}.so"
    library.write_bytes(content)
    files = {LIBRARY_FILE: library}
    if sidecar is not None:
        files["kernel.json"] = library.with_suffix(".json")
        files["kernel.json"].write_text(sidecar)
    entry = Entry(op=op, signature=SIGNATURE, output_counts=[-1], library=library, compile_seconds=1.5)
    return cache.publish(key, entry, files)


def edit_entry_json(directory: Path, redigest: bool = False, **fields: Any) -> None:
    """Changes fields of an entry's ``entry.json`` by hand; ``redigest`` records
    its digest again, as someone who knew the format would."""
    data = json.loads((directory / ENTRY_FILE).read_text())
    data.update(fields)
    if redigest:
        data["metadata_sha256"] = metadata_digest(data)
    (directory / ENTRY_FILE).write_text(json.dumps(data))


class FakeKernel:
    """A kernel written in Python, with what check_matches_eager uses of a
    compiled one: ``run`` takes the call's tensors in schema order and returns
    the outputs that are not arguments; ``output_counts`` says how they make
    up each return (-1: one tensor, n: a list of n, 0: an argument written into)."""

    def __init__(self, run: Callable[[list[torch.Tensor]], list[torch.Tensor]], output_counts: list[int]):
        self.run = run
        self.output_counts = output_counts


def op_rows() -> dict[str, dict[str, Any]]:
    """:func:`aoti_eager.stats`'s rows of ops: a region's row stays while a
    fused model of an earlier test is alive (a reference cycle not collected yet)."""
    return {name: row for name, row in aoti_eager.stats().items() if not name.startswith(REGION_PREFIX)}


class Wrapped:
    """A loaded kernel whose ``run`` is ``run(kernel, inputs)``: a stand-in
    that checks, records or alters what the kernel does, handed out by
    ``swap_loading`` (tests/conftest.py). Everything else is the kernel's."""

    def __init__(self, kernel: Any, run: Callable[[Any, list[torch.Tensor]], list[torch.Tensor]]):
        self.kernel, self._run = kernel, run

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        return self._run(self.kernel, inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


@contextlib.contextmanager
def calls_to(*functions: Callable[..., Any]) -> Iterator[collections.Counter]:
    """Counts, by qualified name, the calls of ``functions`` that the block
    makes in any thread, watching (``sys.setprofile``) rather than replacing
    them."""
    watched = {getattr(f, "__func__", f) for f in functions}
    codes = {f.__code__: f.__qualname__ for f in watched if hasattr(f, "__code__")}
    counted: collections.Counter = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            counted[codes[frame.f_code]] += 1
        elif event == "c_call" and arg in watched:
            counted[arg.__qualname__] += 1

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield counted
    finally:
        sys.setprofile(None)
        threading.setprofile(None)


def clone_tree(value: Any, memo: dict[int, torch.Tensor] | None = None) -> Any:
    """Copies every tensor with its exact sizes, strides and storage offset; a
    tensor that appears twice is copied once (aliasing is kept)."""
    memo = {} if memo is None else memo
    if isinstance(value, torch.Tensor):
        if id(value) not in memo:
            copy = torch.empty(0, dtype=value.dtype, device=value.device)
            copy.set_(value.untyped_storage().clone(), value.storage_offset(), value.size(), value.stride())
            memo[id(value)] = copy
        return memo[id(value)]
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tree(v, memo) for v in value)
    if isinstance(value, dict):
        return {k: clone_tree(v, memo) for k, v in value.items()}
    return value


def assert_same_as_eager(actual: Any, expected: Any, what: str = "result", **tolerances: float) -> None:
    """Values (assert_close, with ``atol``/``rtol`` if given), dtype, shape and,
    where eager defines them, strides."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: {type(actual)}"
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
        assert actual.device == expected.device, f"{what}: device {actual.device} != {expected.device}"
        if expected.numel() > 1:
            dims = [i for i, n in enumerate(expected.shape) if n > 1]
            assert [actual.stride(i) for i in dims] == [expected.stride(i) for i in dims], (
                f"{what}: strides {actual.stride()} != {expected.stride()}"
            )
        torch.testing.assert_close(actual, expected, equal_nan=True, msg=lambda m: f"{what}: {m}", **tolerances)
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{what}: {actual!r}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_as_eager(a, e, f"{what}[{i}]", **tolerances)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), f"{what}: {actual.keys()} != {expected.keys()}"
        for k in expected:
            assert_same_as_eager(actual[k], expected[k], f"{what}[{k!r}]", **tolerances)
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def run_shapes(op_name: str, cache_dir: Path, op: Callable, shapes: list, make: Callable, device: str = "cpu",
               **options: Any) -> tuple[list[int], dict[str, Any]]:
    """Each call of ``op`` on ``make(shape)`` with the op enabled (``options``:
    more of enable()'s), compared with eager; the compiles each call made, and
    the op's stats."""
    compiles, results = [], []
    with aoti_eager.enabled([op_name], devices=[device], cache_dir=cache_dir, **options):
        for shape in shapes:
            args = make(shape)
            before = aoti_eager.stats()[op_name]["compiles"]
            results.append((op(*args), args))
            compiles.append(aoti_eager.stats()[op_name]["compiles"] - before)
        stats = aoti_eager.stats()[op_name]
    for result, args in results:
        assert_same_as_eager(result, op(*args), atol=0, rtol=0)
    return compiles, stats


def xfail_if_kernels_cannot_load(stats: dict[str, Any]) -> None:
    """Where AOTInductor's runtime crashes loading kernels (the runtime then
    runs everything eagerly), a test about the compiled path cannot pass."""
    reason = stats.get("fallback_reason") or ""
    if "crashed a test process" in reason:
        import pytest

        pytest.xfail(f"results equal eager's, but kernels cannot be loaded here: {reason}")


# Compiles: the planner's, and the pipeline's stand-in.


def compiled(planner: Planner, signature: CallSignature) -> CompileRequest:
    """What ``planner`` compiles for ``signature``, told that the compile made a kernel."""
    request = planner.to_compile(signature)
    assert isinstance(request, CompileRequest), request
    planner.compiled(signature, None, kernel=True)
    return request


def fake_artifact(tmp_path: Path):
    """A compile (the pipeline's ``compile`` or ``compile_module``) that makes a
    stand-in library (bytes, never loaded) in a directory of its own under ``tmp_path``."""
    def compile_call(signature, *args, **kwargs):
        workdir = tempfile.TemporaryDirectory(dir=tmp_path)
        library = Path(workdir.name) / LIBRARY_FILE
        library.write_bytes(b"\x7fELF never loaded")
        return Artifact(library, [-1], {"export": 0.0}, workdir)
    return compile_call


# Bundles.


def rewrite(path: Path, change, name: str = "changed.tar") -> Path:
    """A copy of the bundle ``path`` whose members went through ``change(info, data)``
    (returning None drops a member)."""
    copy = path.with_name(name)
    with tarfile.open(path) as source, tarfile.open(copy, "w") as target:
        for info in source.getmembers():
            changed = change(info, source.extractfile(info).read())
            if changed is not None:
                info, data = changed
                info.size = len(data)
                target.addfile(info, io.BytesIO(data))
    return copy


def with_crafted_library(info: tarfile.TarInfo, data: bytes):
    """The attack, a ``change`` for :func:`rewrite`: another library, with entry.json's sha256 made to match it."""
    if info.name.endswith(LIBRARY_FILE):
        return info, b"attacker's library"
    if info.name.endswith(ENTRY_FILE):
        entry = json.loads(data)
        entry["sha256"] = hashlib.sha256(b"attacker's library").hexdigest()
        return info, json.dumps(entry).encode()
    return info, data


# The fleet cache: a real redis-server (the fixtures redis_session and server in conftest.py).

REDIS_SERVER = shutil.which("redis-server")


def free_port() -> int:
    """A loopback port that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A ``redis-server`` of the test's own, on a free loopback port, keeping nothing on disk."""

    def __init__(self, directory: Path, *options: str):
        import redis

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(directory), *options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(host="127.0.0.1", port=self.port, password=self._password(options))
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                assert self.process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)

    @staticmethod
    def _password(options: tuple[str, ...]) -> str | None:
        return options[options.index("--requirepass") + 1] if "--requirepass" in options else None

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


ENVIRONMENT = "cpu-test-environment"


def machine(root: Path, url: str) -> KernelCache:
    """A machine's local cache at ``root``, the fleet cache at ``url`` behind it."""
    cache = KernelCache(root, ENVIRONMENT)
    cache.behind = remote.tier(url, ENVIRONMENT)
    return cache


def refusals(caplog) -> list[str]:
    """The package's warnings that ``caplog`` holds."""
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "aoti_eager" in r.getMessage()]


# Fused regions. A region is named after its class's module: Block's is region::helpers.Block
# in every test module that fuses it.


class Block(torch.nn.Module):
    """A 2-layer MLP with a residual and a norm."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.fc2 = torch.nn.Linear(2 * width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class Model(torch.nn.Module):
    """``blocks`` blocks of the class ``block`` and a head; of a block's tuple result, the first element goes on."""

    def __init__(self, block=Block, blocks: int = 3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(block() for _ in range(blocks))
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            x = x[0] if isinstance(x, tuple) else x
        return self.head(x)


def row(region: type) -> dict:
    """The stats row of ``region``'s class, zeros while no fused module of it is alive."""
    return aoti_eager.stats().get(f"region::{region.__module__}.{region.__qualname__}", {
        "calls": 0, "hits": 0, "fallbacks": 0, "fallback_reason": None, "compiles": 0, "compile_seconds": 0.0, "cache_loads": 0,
        "queued": 0, "compiling": 0,
    })


def delta_since(before: dict, region: type) -> dict:
    """What ``region``'s counts grew by since its row was ``before``."""
    after = row(region)
    return {k: after[k] - before[k] for k in ("calls", "hits", "fallbacks", "compiles", "cache_loads")}


def cpu_cache(root: Path) -> KernelCache:
    """The cache at ``root`` of this machine's CPU environment."""
    return KernelCache(root, environment_name(torch.device("cpu"), compile_options("cpu")))


def cache_entries(root: Path) -> list[tuple[str, str]]:
    """The (op, key) of each entry of :func:`cpu_cache`."""
    return list(cpu_cache(root).entries())


def compile_block(cache: Path, block: type) -> None:
    """Compiles the region of ``block`` for a call on a (4, 16) tensor into ``cache``."""
    torch.manual_seed(0)
    model = Model(block).eval()
    aoti_eager.fuse(model, cache_dir=cache)
    with torch.no_grad():
        model.blocks[0](torch.randn(4, 16))


# A new process fuses a Model of the block class ARGV[5] of the module ARGV[4] with the cache ARGV[1]
# (the fleet cache ARGV[6] behind it, if given), calls two of its blocks, compares each result with
# eager's, and prints the region's stats row with eager_calls, the calls of the original forward.
ROW_IN_A_CHILD = """
import copy, json, sys, importlib
import torch, aoti_eager
import torch.utils._pytree as pytree
sys.path[:0] = [sys.argv[2], sys.argv[3]]
from helpers import Model, row
block = getattr(importlib.import_module(sys.argv[4]), sys.argv[5])
torch.manual_seed(0)
model, x = Model(block).eval(), torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
reference = copy.deepcopy(model)
aoti_eager.fuse(model, cache_dir=sys.argv[1], remote=(sys.argv[6:] or [None])[0])
original, eager_calls = block.forward, []
def counted(*args, **kwargs):
    eager_calls.append(1)
    return original(*args, **kwargs)
block.forward = counted  # fused instances run their class's forward where they run eagerly
with torch.no_grad():
    results = [model.blocks[0](x), model.blocks[1](x)]
    block.forward = original
    expected = reference.blocks[0](x), reference.blocks[1](x)
for r, e in zip(results, expected):
    assert type(r) is type(e) and pytree.tree_structure(r) == pytree.tree_structure(e)
    torch.testing.assert_close(pytree.tree_leaves(r), pytree.tree_leaves(e))
print(json.dumps({**row(block), "eager_calls": len(eager_calls)}))
"""


def row_in_a_child(cache: Path, block: type, fleet: str | None = None) -> dict:
    """The stats row of ``block``'s region in a new process that calls two fused blocks (with the
    fleet cache at the URL ``fleet`` behind ``cache``), with ``eager_calls``: the calls of the original forward."""
    argv = [str(cache), str(ROOT), str(ROOT / "tests"), block.__module__, block.__name__, *([fleet] if fleet else [])]
    child = subprocess.run([sys.executable, "-c", ROW_IN_A_CHILD, *argv], capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-2000:]
    return {**json.loads(child.stdout.strip().splitlines()[-1]), "stderr": child.stderr}
