"""Every setting of aoti_eager: the ``AOTI_EAGER_*`` environment variables.

Each is declared once below, with its type, its default and one line of doc
(the README's table of settings is checked against these declarations), and
nothing else in the package reads ``AOTI_EAGER_*`` variables. A setting is read
from the environment each time it is asked for, so a variable changed at run
time counts from the next call::

    from aoti_eager import settings

    settings.cache_size.get()    # 10737418240, or $AOTI_EAGER_CACHE_SIZE in bytes

A value that does not parse raises ValueError naming the variable, its value
and what is expected. An empty value is the same as an unset one.

Standard library only: every layer imports this module, including ``cache/``
and ``kernels/``, which must not import the runtime.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Type(Generic[T]):
    """How a setting's text becomes a value."""

    name: str  # as the README's table names it
    parse: Callable[[str], T]  # raises ValueError on text it does not take; "" is unset
    expected: str  # what a bad value is told it is not


@dataclass(frozen=True)
class Setting(Generic[T]):
    name: str  # the environment variable
    type: Type[T]
    default: str  # as it would be written in the environment; "" is unset
    doc: str

    def get(self) -> T:
        """The value: the environment's, else the default."""
        text = self.text()
        try:
            return self.type.parse(text)
        except ValueError:
            raise ValueError(f"{self.name}={text!r} is not {self.type.expected}") from None

    def text(self) -> str:
        """The value as written: the environment's, else the default."""
        return os.environ.get(self.name) or self.default

    def is_set(self) -> bool:
        """Whether the environment gives a value (else the default is used)."""
        return bool(os.environ.get(self.name))

    @contextlib.contextmanager
    def set_to(self, text: str) -> Iterator[None]:
        """Sets the variable for the duration (for this process and the
        processes it starts), then restores it as it was."""
        before = os.environ.get(self.name)
        os.environ[self.name] = text
        try:
            yield
        finally:
            if before is None:
                del os.environ[self.name]
            else:
                os.environ[self.name] = before


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"10GiB"``, ``"10G"``, ``"500MB"``, ``"4096"`` -> bytes (units are binary)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)(?:i?b)?", text.strip().lower())
    if match is None:
        raise ValueError(text)
    return int(float(match[1]) * _SIZE_UNITS[match[2]])


def _seconds(text: str, positive: bool) -> float:
    """A finite number of seconds, 0 or more (more than 0 if ``positive``):
    nan, inf and negative values break every timeout they reach."""
    seconds = float(text)
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        raise ValueError(text)
    return seconds


def _count(text: str) -> int:
    count = int(text)
    if count < 0:
        raise ValueError(text)
    return count


_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def _boolean(text: str) -> bool:
    try:
        return _BOOLEANS[text.strip().lower()]
    except KeyError:
        raise ValueError(text) from None


def _path(text: str) -> Path | None:
    return Path(text).expanduser() if text else None


def _paths(text: str) -> list[Path]:
    return [Path(path).expanduser() for path in text.split(":") if path]


def _remote_url(text: str) -> str | None:
    """A Redis server's URL: ``redis://`` (plain), ``rediss://`` (TLS) or ``unix://``."""
    if not text:
        return None
    if text.split("://", 1)[0] not in ("redis", "rediss", "unix") or "://" not in text:
        raise ValueError(text)
    return text


def _group_id(text: str) -> int | None:
    """A group's name or id -> its id."""
    if not text:
        return None
    import grp  # POSIX only, like the cache's file modes

    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        if text.isdigit():
            return int(text)
        raise ValueError(text) from None


SIZE = Type("size", parse_size, "a size (e.g. 10GiB, 500M, 4096)")
SECONDS = Type("seconds", functools.partial(_seconds, positive=False),
               "a number of seconds, finite and 0 or more (e.g. 900, 0.5)")
# Where 0 would mean giving up at once (a timeout) or a lock that is never held (its lifetime).
POSITIVE_SECONDS = Type("seconds", functools.partial(_seconds, positive=True),
                        "a number of seconds, finite and more than 0 (e.g. 30, 0.5)")
COUNT = Type("count", _count, "a count (a whole number, 0 or more)")
BOOLEAN = Type("boolean", _boolean, "a boolean (1 or 0)")
PATH = Type("path", _path, "a path")
PATHS = Type("paths", _paths, "paths separated by ':'")
GROUP = Type("group", _group_id, "a group name or id on this machine")
URL = Type("url", _remote_url, "a Redis URL (redis://host:port/db, rediss:// for TLS, unix:///path)")

cache_dir = Setting("AOTI_EAGER_CACHE_DIR", PATH, "",
                    "the kernel cache (unset: the platform's per-user cache directory)")
cache_size = Setting("AOTI_EAGER_CACHE_SIZE", SIZE, "10GiB",
                     "the most the kernel cache holds before its least recently used entries are evicted")
cache_group = Setting("AOTI_EAGER_CACHE_GROUP", GROUP, "",
                      "a team cache: the group whose members may write it (unset: only this user)")
lock_timeout = Setting("AOTI_EAGER_LOCK_TIMEOUT", SECONDS, "900",
                       "how long a miss waits for another process compiling the same signature before running eagerly")
max_value_variants = Setting("AOTI_EAGER_MAX_VALUE_VARIANTS", COUNT, "8",
                             "compiles of one op and signature shape that differ only in numbers compiled in; "
                             "further values run eagerly")
max_shape_compiles = Setting("AOTI_EAGER_MAX_SHAPE_COMPILES", COUNT, "4",
                             "compiles of one op and shape family (calls that differ only in tensor sizes), static "
                             "and dynamic-shape kernels together; further shapes run eagerly")
max_matmul_sizes = Setting("AOTI_EAGER_MAX_MATMUL_SIZES", COUNT, "8",
                           "reduction and column sizes of one 16-bit CUDA matmul op that compile Triton kernels "
                           "(each its own shape family); further sizes run eagerly, on cuBLAS")
cpu_pool = Setting("AOTI_EAGER_CPU_POOL", SIZE, "512MiB",
                   "freed outputs of CPU kernels above 64 KiB kept for the next output of their size, as CUDA's "
                   "caching allocator keeps blocks (eager maps each large output afresh); 0: none kept")
dynamic_shapes = Setting("AOTI_EAGER_DYNAMIC_SHAPES", BOOLEAN, "1",
                         "compile a dynamic-shape kernel when a second shape of a family arrives; 0: every shape "
                         "compiles its own kernel")
background_jobs = Setting("AOTI_EAGER_BACKGROUND_JOBS", COUNT, "0",
                          "worker processes compiling `compile=\"background\"` misses at once; 0: one per core, "
                          "as memory allows (as `prewarm`)")
fork_workers = Setting("AOTI_EAGER_FORK_WORKERS", BOOLEAN, "1",
                       "fork compile workers from one process that has imported torch and Inductor, instead of "
                       "starting each anew")
keep_faster = Setting("AOTI_EAGER_KEEP_FASTER", BOOLEAN, "1",
                      "time each new kernel against eager, and keep the signature eager where eager is faster")
split_wrapper = Setting("AOTI_EAGER_SPLIT_WRAPPER", BOOLEAN, "1",
                        "compile the half of a CPU wrapper that every signature shares once per environment")
record = Setting("AOTI_EAGER_RECORD", PATH, "",
                 "a manifest that `enable()` and `fuse()` append every cache miss to, for prewarm")
signing_key = Setting("AOTI_EAGER_SIGNING_KEY", PATH, "",
                      "the private key that `cache export` signs bundles with, and the fleet cache's entries")
trusted_keys = Setting("AOTI_EAGER_TRUSTED_KEYS", PATHS, "",
                       "the public keys whose bundles `cache import` and whose entries the fleet cache accept, "
                       "separated by `:`")
remote = Setting("AOTI_EAGER_REMOTE", URL, "",
                 "the fleet cache: a Redis server behind the local cache (unset: local only)")
remote_connect_timeout = Setting("AOTI_EAGER_REMOTE_CONNECT_TIMEOUT", POSITIVE_SECONDS, "0.1",
                                 "how long connecting to the fleet cache's server may take")
remote_timeout = Setting("AOTI_EAGER_REMOTE_TIMEOUT", POSITIVE_SECONDS, "1",
                         "how long one command to the fleet cache's server may take (an entry's transfer included)")
remote_max_entry = Setting("AOTI_EAGER_REMOTE_MAX_ENTRY", SIZE, "256MiB",
                           "the largest fleet cache entry (its files together) that is fetched or published; larger "
                           "ones are refused unread")
remote_retry = Setting("AOTI_EAGER_REMOTE_RETRY", SECONDS, "60",
                       "after the fleet cache's server fails, how long a process runs local-only before trying it again")
remote_lock_ttl = Setting("AOTI_EAGER_REMOTE_LOCK_TTL", POSITIVE_SECONDS, "30",
                          "the fleet-wide compile lock's lifetime, renewed while its holder compiles: how soon a dead "
                          "holder's lock is taken over")
verbose_build = Setting("AOTI_EAGER_VERBOSE_BUILD", BOOLEAN, "0",
                        "show the compiler's commands when the C++ extension is built")

# Every setting, in the order declared above: the README's table and
# `aoti-eager doctor` list them so.
ALL: list[Setting] = [value for value in dict(globals()).values() if isinstance(value, Setting)]


def check_all() -> None:
    """Raises ValueError for the first setting whose value is refused, so
    that a bad value is told once, up front, not as a failure of each call."""
    for setting in ALL:
        setting.get()
