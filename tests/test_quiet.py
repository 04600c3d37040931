"""What a compile prints is kept in its log, off the user's terminal; the
project's own log records are still shown."""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings

from aoti_eager.kernels import quiet


def test_what_a_compile_prints_goes_into_its_log_and_the_projects_records_after_it(capfd, caplog):
    log: list[str] = []
    with caplog.at_level(logging.INFO), quiet.captured(log):
        os.write(1, b"printed by C++ on stdout\n")
        os.write(2, b"Error: aoti_torch_proxy_executor_call_function(...) API call failed\n")
        print("def forward(self, arg0_1):")
        print("to sys.stderr", file=sys.stderr)
        warnings.warn("a warning raised inside the compile")
        logging.getLogger("torch.fx.experimental.symbolic_shapes").warning("Unable to find user code corresponding to {zuf0}")
        logging.getLogger("aoti_eager").info("aoti_eager: the project's own record")
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    (text,) = log
    for said in ("printed by C++ on stdout", "API call failed", "def forward(self, arg0_1):", "to sys.stderr",
                 "a warning raised inside the compile", "Unable to find user code"):
        assert said in text
    assert "the project's own record" not in text
    assert [r.getMessage() for r in caplog.records if r.name == "aoti_eager"] == ["aoti_eager: the project's own record"]


def test_nothing_printed_adds_nothing_to_the_log():
    log: list[str] = []
    with quiet.captured(log):
        pass
    assert log == []


def test_a_background_compile_takes_its_own_threads_output_only(capsys, caplog):
    log: list[str] = []
    inside, done = threading.Event(), threading.Event()

    def compile_here():
        with quiet.captured(log, this_thread_only=True):
            print("def forward(self, arg0_1):")
            warnings.warn("a warning raised inside the compile")
            logging.getLogger("torch.fx.experimental.symbolic_shapes").warning("Unable to find user code")
            inside.set()
            assert done.wait(timeout=60)

    thread = threading.Thread(target=compile_here)
    with caplog.at_level(logging.INFO):
        thread.start()
        assert inside.wait(timeout=60)
        print("the user's own line")  # meanwhile, in the user's thread
        encoding = sys.stdout.encoding  # what the user's thread sees of its stream is its stream's
        logging.getLogger("torch.distributed").warning("the user's torch record")
        done.set()
        thread.join()
    assert capsys.readouterr().out == "the user's own line\n"
    assert encoding == sys.stdout.encoding is not None
    assert [r.getMessage() for r in caplog.records] == ["the user's torch record"]
    assert log == ["def forward(self, arg0_1):\nUserWarning: a warning raised inside the compile\n"
                   "WARNING torch.fx.experimental.symbolic_shapes: Unable to find user code"]
