"""What a compile prints, kept off the user's terminal.

Export, Inductor, the C++ compiler, AOTInductor's generated code and the C
shim all print: torch's loggers (``symbolic_shapes``' "Unable to find user
code", an FX graph), Python warnings, and C++ writes straight to the
process's file descriptors 1 and 2 (a failed shim call's ``Error: ... API
call failed``). None of it is the user's concern: the runtime logs one line
per op and reason. :func:`captured` collects it all into the compile's log
instead, which the runtime logs at DEBUG level.

The redirection is the process's, not the thread's: another thread's output
during a compile lands in the compile's log too.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import sys
import tempfile
import threading
import warnings
from typing import Any, Iterator

_PROJECT_LOGGER = "aoti_eager"


class _Held(logging.Handler):
    """Keeps the project's own records until the output is the user's again."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _flush_c_streams() -> None:
    """Flushes C's stdio buffers, where C++ code's ``printf`` and ``std::cout`` wait."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def _file_descriptors_into(sink: int) -> Iterator[None]:
    """Descriptors 1 and 2 write into ``sink`` within the block (unchanged
    where the process has none to redirect)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    try:
        saved = [os.dup(1), os.dup(2)]
    except OSError:
        yield
        return
    try:
        os.dup2(sink, 1)
        os.dup2(sink, 2)
        yield
    finally:
        _flush_c_streams()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)


@contextlib.contextmanager
def _torch_loggers_into(stream: io.StringIO) -> Iterator[None]:
    """torch's loggers write into ``stream`` within the block."""
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    top = logging.getLogger("torch")
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict) if name.startswith("torch.")]
    # torch's own handlers, and the root's (where torch's records go up to) are passed by.
    saved = [(logger, logger.handlers[:], logger.propagate) for logger in [top, *loggers] if logger is top or logger.handlers]
    for logger, _, _ in saved:
        logger.handlers = [handler] if logger is top else []
        logger.propagate = logger is not top
    try:
        yield
    finally:
        for logger, handlers, propagate in saved:
            logger.handlers, logger.propagate = handlers, propagate


@contextlib.contextmanager
def _project_records_held() -> Iterator[None]:
    """The project's own records reach their handlers after the block, not
    into the captured output."""
    logger = logging.getLogger(_PROJECT_LOGGER)
    held = _Held()
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [held], False
    try:
        yield
    finally:
        logger.handlers, logger.propagate = saved
        for record in held.records:
            logger.handle(record)


@contextlib.contextmanager
def captured(log: list[str], this_thread_only: bool = False) -> Iterator[None]:
    """Within the block, everything the process prints (file descriptors 1
    and 2, ``sys.stdout`` and ``sys.stderr``), torch's log records and Python
    warnings are appended to ``log`` (as one text, if there was any), not
    shown. The project's own log records are shown as usual, after it.

    ``this_thread_only``: what this thread prints through Python
    (``sys.stdout``, ``sys.stderr``, warnings, torch's log records), while
    the other threads, the user's calls, print as usual; what C++ writes
    straight to the file descriptors is not taken."""
    if this_thread_only:
        text = io.StringIO()
        try:
            with _this_thread_into(text):
                yield
        finally:
            if text.getvalue().strip():
                log.append(text.getvalue().strip())
        return
    text = io.StringIO()
    caught: list[warnings.WarningMessage] = []
    with tempfile.TemporaryFile() as sink:
        try:
            with _project_records_held(), warnings.catch_warnings(record=True) as recorded, \
                    _file_descriptors_into(sink.fileno()), contextlib.redirect_stdout(text), \
                    contextlib.redirect_stderr(text), _torch_loggers_into(text):
                warnings.simplefilter("always")
                caught = recorded
                yield
        finally:
            sink.seek(0)
            printed = sink.read().decode(errors="replace")
            said = "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
            output = (printed + text.getvalue() + said).strip()
            if output:
                log.append(output)


class _ByThread:
    """A stream that writes what one thread writes into ``into``, and what
    the others write into ``others``, which is what they see of it
    (``fileno``, ``isatty``, ``encoding``)."""

    def __init__(self, others: Any, into: io.StringIO, thread: int):
        self.others, self.into, self.thread = others, into, thread

    def write(self, text: str) -> int:
        return (self.into if threading.get_ident() == self.thread else self.others).write(text)

    def flush(self) -> None:
        self.others.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.others, name)


class _ThreadRecords(logging.Filter):
    """Takes torch's records of one thread off every handler, into ``into``."""

    def __init__(self, into: io.StringIO, thread: int):
        super().__init__()
        self.into, self.thread, self.taken = into, thread, set()
        self.formatter = logging.Formatter("%(levelname)s %(name)s: %(message)s")

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self.thread or not record.name.startswith("torch"):
            return True
        if id(record) not in self.taken:  # once, however many handlers it reaches
            self.taken.add(id(record))
            self.into.write(self.formatter.format(record) + "\n")
        return False


@contextlib.contextmanager
def _this_thread_into(text: io.StringIO) -> Iterator[None]:
    """What this thread prints through Python goes into ``text`` within the block (see :func:`captured`)."""
    thread = threading.get_ident()
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (_ByThread(stream, text, thread) for stream in streams)
    show = warnings.showwarning

    def showwarning(message: Any, category: type, *args: Any, **kwargs: Any) -> None:
        if threading.get_ident() == thread:
            text.write(f"{category.__name__}: {message}\n")
        else:
            show(message, category, *args, **kwargs)

    warnings.showwarning = showwarning
    records = _ThreadRecords(text, thread)
    names = [name for name in list(logging.root.manager.loggerDict) if name.startswith("torch")]
    loggers = [logging.root, *map(logging.getLogger, names)]
    handlers = {h for logger in loggers for h in logger.handlers} | ({logging.lastResort} if logging.lastResort else set())
    for handler in handlers:
        handler.addFilter(records)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(records)
        if warnings.showwarning is showwarning:  # unless another thread set its own meanwhile
            warnings.showwarning = show
        for name, stream in zip(("stdout", "stderr"), streams):
            if isinstance(getattr(sys, name), _ByThread) and getattr(sys, name).others is stream:
                setattr(sys, name, stream)
