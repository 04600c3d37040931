import functools
import json
import os
import threading

import pytest
import torch
from torch._inductor import codecache, cpu_vec_isa
from torch._inductor import config as inductor_config

from aoti_eager.kernels.inductor import headers, scratch, vec_isa
from aoti_eager.kernels.compile import compile_options

HEADER = "torch/csrc/inductor/cpp_prefix.h"
ISA = next(iter(cpu_vec_isa.supported_vec_isa_list))
ARGUMENTS = {"aot_mode": True, "device_type": "cpu", "use_mmap_weights": False, "use_mmap_weights_external": False,
             "use_relative_path": False, "vec_isa": ISA}


per_context = pytest.mark.skipif(not headers._settings_per_context(),
                                 reason="this torch keeps Inductor's settings in module globals: no checks ahead")


@pytest.fixture
def inductors_check(monkeypatch):
    """Inductor's check replaced by one that names the thread it ran in, memoized as Inductor's is."""
    monkeypatch.setattr(headers, "_started", {})
    calls = []

    @functools.cache
    def precompile_header(header, hashable_cmd_line, **compile_command):
        calls.append(threading.current_thread().name)
        return f"{header} checked"

    monkeypatch.setattr(codecache, "_precompile_header", precompile_header)
    return calls


def _compile(shared_dir, command):
    """What a compile does of the check: Inductor calls it once per header."""
    with headers.checked_ahead(shared_dir):
        return codecache._precompile_header(HEADER, command, **ARGUMENTS)


@per_context
def test_a_check_recorded_runs_ahead_and_answers_inductor(inductors_check, tmp_path):
    command = headers._command(ARGUMENTS)
    assert _compile(tmp_path, command) == f"{HEADER} checked"
    assert inductors_check == ["MainThread"]

    headers._started.clear()  # a new process
    inductors_check.clear()
    codecache._precompile_header.cache_clear()
    assert _compile(tmp_path, command) == f"{HEADER} checked"
    assert inductors_check == ["aoti_eager-header-check"]


@per_context
def test_a_check_recorded_under_other_settings_is_left_to_inductor(inductors_check, tmp_path):
    _compile(tmp_path, "another compiler command")
    headers._started.clear()
    inductors_check.clear()
    codecache._precompile_header.cache_clear()
    assert _compile(tmp_path, "another compiler command") == f"{HEADER} checked"
    assert inductors_check == ["MainThread"]


@pytest.mark.parametrize("record", [
    "not json",
    json.dumps({"a": "dict"}),
    json.dumps([json.dumps(["/etc/passwd", "command", {}])]),
    json.dumps([json.dumps([HEADER, "command", {"extra_flags": "-o /tmp/x"}])]),
    json.dumps([json.dumps([HEADER, "command", {"vec_isa": "no such ISA"}])]),
    json.dumps([json.dumps([HEADER, "command", {"aot_mode": ["a list"]}])]),
])
def test_a_record_that_is_not_inductors_arguments_starts_nothing(inductors_check, tmp_path, record):
    (tmp_path / headers._RECORD).write_text(record)
    with headers.checked_ahead(tmp_path):
        pass
    assert headers._started == {} and inductors_check == []


@per_context
def test_the_check_ahead_gives_inductors_answer_under_the_compiles_settings(tmp_path):
    """Inductor's real check, in the thread, under the settings a compile
    patches in (the compiler, no line tables): the precompiled header it
    names is the one Inductor's own check names."""
    arguments = {**ARGUMENTS, "vec_isa": cpu_vec_isa.pick_vec_isa()}  # the headers the other tests' compiles built
    with scratch.compiling(), inductor_config.patch(compile_options("cpu")):
        command = headers._command(arguments)
        own = codecache._precompile_header.__wrapped__(HEADER, command, **arguments)
        key = headers._key(HEADER, command, arguments)
        (tmp_path / headers._RECORD).write_text(json.dumps([key]))
        try:
            with headers.checked_ahead(tmp_path):
                ahead = headers._started[key].result()
        finally:
            headers._started.pop(key, None)
    assert ahead == own


@per_context
def test_a_child_forked_during_a_check_starts_its_own(inductors_check, tmp_path, monkeypatch):
    """Its parent's thread is not in the child: waiting for its answer would be forever."""
    command = headers._command(ARGUMENTS)
    _compile(tmp_path, command)
    headers._started.clear()
    codecache._precompile_header.cache_clear()
    release = threading.Event()
    monkeypatch.setattr(headers, "_check", lambda *args: release.wait(60) and None)
    with headers.checked_ahead(tmp_path):
        assert not headers._started[headers._key(HEADER, command, ARGUMENTS)].done()
        pid = os.fork()
        if pid == 0:
            os._exit(0 if headers._started == {} else 1)
        release.set()
    assert os.waitpid(pid, 0)[1] == 0


def test_where_settings_are_module_globals_inductor_checks_as_it_did(inductors_check, tmp_path, monkeypatch):
    command = headers._command(ARGUMENTS)
    (tmp_path / headers._RECORD).write_text(json.dumps([headers._key(HEADER, command, ARGUMENTS)]))
    monkeypatch.setattr(headers, "_settings_per_context", lambda: False)
    assert _compile(tmp_path, command) == f"{HEADER} checked"
    assert headers._started == {} and inductors_check == ["MainThread"]


def test_the_calls_are_recorded_where_settings_are_module_globals_too(inductors_check, tmp_path, monkeypatch):
    """Torch 2.11's compiles record them for the process workers fork from (check_recorded)."""
    monkeypatch.setattr(headers, "_settings_per_context", lambda: False)
    command = headers._command(ARGUMENTS)
    _compile(tmp_path, command)
    assert json.loads((tmp_path / headers._RECORD).read_text()) == [headers._key(HEADER, command, ARGUMENTS)]


def test_checks_made_before_a_fork_answer_the_forked_compiles(inductors_check, private_root, monkeypatch, swap_toolchain):
    """The zygote makes the recorded checks under each device's compile
    options; a worker's compile then takes Inductor's memo, which tells the
    order of the keywords apart: Inductor passes the wrapper header's
    ``min_optimize`` first."""
    monkeypatch.setattr(headers, "_settings_per_context", lambda: False)
    usable = {str(ISA): []}
    swap_toolchain(remembered_vec_isas=lambda: usable)
    with inductor_config.patch(compile_options("cpu")), vec_isa.known_vec_isas(usable):
        command = headers._command(ARGUMENTS)
    arguments = {"min_optimize": True, **ARGUMENTS}
    shared = private_root / "shared" / "cpu-some-environment"
    shared.mkdir(parents=True)
    with headers.checked_ahead(shared):  # a compile records Inductor's call
        codecache._precompile_header(HEADER, command, **arguments)
    codecache._precompile_header.cache_clear()  # a new process
    inductors_check.clear()
    with (shared / headers._RECORD).open("r+") as record:
        keys = json.load(record) + [headers._key(HEADER, "another compiler command", ARGUMENTS)]
        record.seek(0)
        json.dump(keys, record)
    headers.check_recorded(compile_options)
    assert inductors_check == ["MainThread"]  # the one whose command is still this compile's

    child = os.fork()
    if child == 0:  # a worker: Inductor's call takes the answer, and checks nothing
        with headers.checked_ahead(shared):
            answer = codecache._precompile_header(HEADER, command, **arguments)
        os._exit(0 if answer == f"{HEADER} checked" and inductors_check == ["MainThread"] else 1)
    assert os.waitpid(child, 0)[1] == 0


def test_without_a_record_of_the_vector_isas_nothing_is_checked(inductors_check, private_root, swap_toolchain):
    """Their probe takes up to a minute: the compiles pay it, not the zygote."""
    shared = private_root / "shared" / "cpu-some-environment"
    shared.mkdir(parents=True)
    (shared / headers._RECORD).write_text(json.dumps([headers._key(HEADER, headers._command(ARGUMENTS), ARGUMENTS)]))
    probe = lambda: pytest.fail("probed the vector ISAs")  # noqa: E731
    swap_toolchain(remembered_vec_isas=lambda: None, vec_isas_known=lambda: False, cpu_isa=probe, usable_vec_isas=probe)
    headers.check_recorded(compile_options)
    assert inductors_check == []


def test_the_checks_stop_when_asked(inductors_check, private_root, swap_toolchain):
    swap_toolchain(remembered_vec_isas=lambda: {})
    shared = private_root / "shared" / "cpu-some-environment"
    shared.mkdir(parents=True)
    (shared / headers._RECORD).write_text(json.dumps([headers._key(HEADER, headers._command(ARGUMENTS), ARGUMENTS)]))
    headers.check_recorded(compile_options, until=lambda: True)
    assert inductors_check == []


def test_a_header_not_built_yet_is_left_to_the_compiles(private_root, tmp_path, monkeypatch, swap_toolchain):
    """Building one takes seconds that the zygote, about to fork, must not
    spend: its check answers nothing, and Inductor memoizes nothing."""
    usable = {str(ISA): []}
    swap_toolchain(remembered_vec_isas=lambda: usable)
    with inductor_config.patch(compile_options("cpu")), vec_isa.known_vec_isas(usable):
        command = headers._command(ARGUMENTS)
    shared = private_root / "shared" / "cpu-some-environment"
    shared.mkdir(parents=True)
    (shared / headers._RECORD).write_text(json.dumps([headers._key(HEADER, command, ARGUMENTS)]))
    monkeypatch.setattr(codecache, "_HEADER_DIR", str(tmp_path / "headers"))  # none built there
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", str(tmp_path / "headers" / "locks"))
    monkeypatch.setattr(codecache, "_precompile_header", functools.cache(codecache._precompile_header.__wrapped__))
    headers.check_recorded(compile_options)
    assert codecache._precompile_header.cache_info().misses == 1  # Inductor's check ran
    assert codecache._precompile_header.cache_info().currsize == 0
    assert not list((tmp_path / "headers").rglob("*.gch"))
