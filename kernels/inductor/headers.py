"""Inductor's check of its precompiled headers, started ahead in a process.

Before it builds a library, AOTInductor makes sure that the precompiled
headers it builds with (the wrapper's and, on CPU, the kernels') are current:
it preprocesses each header and hashes the text, once per process, one header
after the other, after the lowering: a share of a process's first compile
(BENCHMARKS.md, "Compile time of a new signature").

The arguments of each check are kept beside the environment's shared wrapper
part; a process's first compile starts Inductor's own check with them in a
thread, where the preprocessor runs beside the export and the lowering, and
Inductor's call waits for that thread's answer instead of checking again.
Arguments that are no longer Inductor's only cost the thread's work. Only
where the thread sees the compile's Inductor settings and no others (see
:func:`_settings_per_context`).

Where compiles run in workers forked from one process (:mod:`aoti_eager._zygote`),
that process makes the recorded checks before its first fork
(:func:`check_recorded`), one after the other, and each worker inherits
Inductor's answers, which every worker's first compile would otherwise make.

Torch internals it touches (:data:`INTERNALS`), checked with torch 2.11, 2.13
and 2.14.1: ``torch._inductor.codecache._precompile_header``, replaced within
:func:`checked_ahead` and called with the recorded arguments (keywords among
``_KEYWORDS``); ``torch._inductor.codecache._worker_compile_cpp``, replaced
while :func:`check_recorded` checks; ``torch._inductor.cpp_builder.CppBuilder.__init__``,
``torch._inductor.cpp_builder.CppBuilder.get_command_line`` and
``torch._inductor.cpp_builder.CppTorchDeviceOptions.__init__``, which give the
compiler command a header is named by; ``torch._inductor.cpu_vec_isa.invalid_vec_isa``,
a recorded ISA. Where torch keeps Inductor's settings in module globals
(torch 2.11: no ``torch._inductor.config._hash_dirty_var``), no check is
started ahead. Where one of the internals has moved (``missing(INTERNALS)``), nothing
is replaced and nothing is checked ahead: Inductor checks its headers itself,
as it does without this package.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import json
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

from aoti_eager.cache import layout
from aoti_eager.kernels.inductor.internals import missing
from aoti_eager.kernels.inductor.vec_isa import vec_isa_named

INTERNALS = (
    "torch._inductor.codecache._precompile_header(header, hashable_cmd_line)",
    "torch._inductor.codecache._worker_compile_cpp(lock_path)",
    "torch._inductor.cpp_builder.CppBuilder.__init__(name, sources, BuildOption)",
    "torch._inductor.cpp_builder.CppBuilder.get_command_line(self)",
    "torch._inductor.cpp_builder.CppTorchDeviceOptions.__init__(vec_isa, device_type, aot_mode)",
    "torch._inductor.cpu_vec_isa.invalid_vec_isa",
)

_RECORD = "precompiled_headers.json"
_KEYWORDS = {"aot_mode", "device_type", "use_mmap_weights", "use_mmap_weights_external", "use_relative_path",
             "min_optimize", "vec_isa"}

# Checks started in this process, by their arguments. A child forked while
# one ran would wait for it forever: a child starts its own.
_started: dict[str, concurrent.futures.Future] = {}
os.register_at_fork(after_in_child=lambda: _started.clear())


@contextlib.contextmanager
def checked_ahead(shared_dir: Path | None) -> Iterator[None]:
    """Within the block (a compile), the header checks recorded in
    ``shared_dir`` run in threads from its start, and Inductor's own calls take
    their answers; the arguments of Inductor's calls are recorded for the next
    process. The block ends once the threads have: the checks use the scratch
    directories of :func:`aoti_eager.kernels.inductor.scratch.compiling`, which must be
    in effect around the block. Where an internal has moved (``missing(INTERNALS)``),
    the block changes nothing."""
    from torch._inductor import codecache

    if shared_dir is None or missing(INTERNALS):
        yield
        return
    original = codecache._precompile_header
    record = shared_dir / _RECORD
    calls = []

    def precompile_header(header: str, hashable_cmd_line: str, **compile_command: Any) -> str:
        key = _key(header, hashable_cmd_line, compile_command)
        calls.append(key)
        started = _started.get(key)
        if started is not None and started.exception() is None and started.result() is not None:
            return started.result()
        return original(header, hashable_cmd_line, **compile_command)

    recorded = _recorded(record)
    started = []
    for key, arguments in recorded.items() if _settings_per_context() else ():
        if key not in _started:
            _started[key] = _in_a_thread(_check, original, arguments)
            started.append(_started[key])
    codecache._precompile_header = precompile_header
    try:
        yield
    finally:
        codecache._precompile_header = original
        concurrent.futures.wait(started)
        if calls and calls != list(recorded):
            with contextlib.suppress(OSError):
                layout.atomic_write_text(record, json.dumps(calls))


def _settings_per_context() -> bool:
    """Whether torch keeps Inductor's settings in context variables, so that a
    thread checks under the compile's settings, whatever the compile's own
    thread patches meanwhile (torch 2.13). Torch 2.11 keeps them in module
    globals: there, on the H100, checks ahead named other precompiled headers
    than Inductor's own, and a first compile rebuilt a header and the shared
    wrapper part."""
    from torch._inductor import config as inductor_config

    return isinstance(getattr(inductor_config, "_hash_dirty_var", None), contextvars.ContextVar)


def _in_a_thread(function: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """``function(*args)`` in a new thread, in a copy of this thread's context,
    which holds Inductor's settings (see :func:`_settings_per_context`)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            future.set_result(context.run(function, *args))
        except BaseException as e:  # noqa: BLE001 - the caller's to see
            future.set_exception(e)

    threading.Thread(target=run, name="aoti_eager-header-check", daemon=True).start()
    return future


def _key(header: str, hashable_cmd_line: str, compile_command: dict[str, Any]) -> str:
    """The call's arguments, its keywords in the order of the call: Inductor's
    memo (``functools.cache``) tells two orders apart, so a check made with
    the keywords sorted answered no compile of a forked worker."""
    arguments = {name: str(value) if name == "vec_isa" else value for name, value in compile_command.items()}
    return json.dumps([header, hashable_cmd_line, arguments])


def _recorded(record: Path) -> dict[str, tuple[str, str, dict[str, Any]]]:
    """The recorded checks that Inductor's check can take, by key, with their
    arguments: its own headers, keywords it passes (plain values) and a
    vector ISA of this torch."""
    try:
        keys = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(keys, list):
        return {}
    return {key: arguments for key in keys if isinstance(key, str) and (arguments := _arguments(key)) is not None}


def _arguments(key: str) -> tuple[str, str, dict[str, Any]] | None:
    from torch._inductor import cpu_vec_isa

    try:
        header, hashable_cmd_line, arguments = json.loads(key)
    except (ValueError, TypeError):
        return None
    if not (isinstance(header, str) and header.startswith("torch/csrc/inductor/") and header.endswith(".h")
            and isinstance(hashable_cmd_line, str) and isinstance(arguments, dict)
            and set(arguments) <= _KEYWORDS
            and all(isinstance(value, (bool, str, type(None))) for value in arguments.values())):
        return None
    if "vec_isa" in arguments:
        name = arguments["vec_isa"]
        isa = cpu_vec_isa.invalid_vec_isa if name == str(cpu_vec_isa.invalid_vec_isa) else vec_isa_named(name)
        if isa is None:
            return None
        arguments["vec_isa"] = isa
    return header, hashable_cmd_line, arguments


def _check(precompile_header: Any, arguments: tuple[str, str, dict[str, Any]]) -> str | None:
    """Inductor's check of one recorded header, where Inductor's settings give
    the same compiler command as when it was recorded: else ``None``."""
    header, hashable_cmd_line, keywords = arguments
    if _command(keywords) != hashable_cmd_line:
        return None
    return precompile_header(header, hashable_cmd_line, **keywords)


def _command(arguments: dict[str, Any]) -> str:
    """The compiler command Inductor names a header's flags by (its ``cpp_command``)."""
    from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions

    options = CppTorchDeviceOptions(
        vec_isa=arguments.get("vec_isa"), device_type=arguments.get("device_type"), aot_mode=arguments.get("aot_mode"),
    )
    return repr(CppBuilder(name="o", sources="i", BuildOption=options).get_command_line())


def check_recorded(compile_options: Callable[[str], dict[str, Any]], until: Callable[[], bool] = lambda: False) -> None:
    """Makes the checks recorded in this user's environments, the most recently
    recorded first, each under its device's ``compile_options(device_type)`` as
    a compile would, until ``until()``: this process and the processes it forks
    later take the answers from Inductor's memo. For a process that has
    compiled nothing and runs no thread (:mod:`aoti_eager._zygote`): Inductor's
    settings are then these alone, whichever torch keeps them. Where no process
    has probed the vector ISAs yet, it checks nothing (the probe takes up to a
    minute), nor where an internal has moved (``missing(INTERNALS)``)."""
    from torch._inductor import codecache
    from torch._inductor import config as inductor_config

    from aoti_eager.kernels.inductor import scratch
    from aoti_eager.kernels.inductor.vec_isa import known_vec_isas
    from aoti_eager.kernels.toolchain import remembered_vec_isas

    vec_isas = None if missing(INTERNALS) else remembered_vec_isas()
    if vec_isas is None:
        return

    def recorded_at(record: Path) -> float:
        with contextlib.suppress(OSError):
            return record.stat().st_mtime
        return 0.0

    records = sorted((layout.private_root() / "shared").glob(f"*/{_RECORD}"), key=recorded_at, reverse=True)
    for record in records:
        for arguments in _recorded(record).values():
            if until():
                return
            device_type = arguments[2].get("device_type")
            if device_type in ("cpu", "cuda"):
                isas = vec_isas if device_type == "cpu" else {}  # as vec_isas_for gives a compile
                with (contextlib.suppress(_WouldBuild), scratch.compiling(),
                      inductor_config.patch(compile_options(device_type)), known_vec_isas(isas), _nothing_built()):
                    _check(codecache._precompile_header, arguments)


class _WouldBuild(Exception):
    pass


@contextlib.contextmanager
def _nothing_built() -> Iterator[None]:
    """Within the block, Inductor's check of a header that is not built yet
    raises :class:`_WouldBuild` instead of building it (seconds of a
    compiler, which a process about to fork must not spend; a worker builds it under
    Inductor's lock while the others go on). Inductor memoizes no answer then."""
    from torch._inductor import codecache

    build = codecache._worker_compile_cpp

    def build_only_what_is_built(lock_path: str, builders: Any) -> None:
        if not all(os.path.isfile(builder.get_target_file_path()) for builder in builders):
            raise _WouldBuild
        build(lock_path, builders)

    codecache._worker_compile_cpp = build_only_what_is_built
    try:
        yield
    finally:
        codecache._worker_compile_cpp = build
