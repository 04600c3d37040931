"""aoti_eager.settings: each type's parsing, each bad value's message, and the
README's table of settings against the declarations."""

from __future__ import annotations

import grp
import os
import re
from pathlib import Path

import pytest

from aoti_eager import settings


def _readme_rows() -> list[str]:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("| `AOTI_EAGER_")]


def test_the_readme_lists_every_setting_as_declared():
    declared = [f"| `{s.name}` | {s.type.name} | {f'`{s.default}`' if s.default else 'unset'} | {s.doc} |"
                for s in settings.ALL]
    assert _readme_rows() == declared, "the README's table of settings should read:\n" + "\n".join(declared)


def test_every_variable_the_package_names_is_declared():
    package = Path(settings.__file__).parents[1]
    sources = [p for folder in ("aoti_eager", "kernels", "cache") for p in (package / folder).glob("*.py")]
    named = {name for p in sources for name in re.findall(r"AOTI_EAGER_[A-Z_]+", p.read_text())}
    assert named == {s.name for s in settings.ALL}


@pytest.mark.parametrize("setting, text, value", [
    (settings.cache_size, "10GiB", 10 << 30),
    (settings.cache_size, "500M", 500 << 20),
    (settings.cache_size, "1.5kb", 1536),
    (settings.cache_size, "4096", 4096),
    (settings.lock_timeout, "0.2", 0.2),
    (settings.max_value_variants, "2", 2),
    (settings.keep_faster, "0", False),
    (settings.keep_faster, "true", True),
    (settings.split_wrapper, "Off", False),
    (settings.verbose_build, "yes", True),
    (settings.cache_dir, "~/kernels", Path.home() / "kernels"),
    (settings.trusted_keys, "/a.pub::~/b.pub", [Path("/a.pub"), Path.home() / "b.pub"]),
    (settings.remote, "redis://cache-host:6379/0", "redis://cache-host:6379/0"),
    (settings.remote, "rediss://user:pw@cache-host:6380/1", "rediss://user:pw@cache-host:6380/1"),
    (settings.cache_group, str(os.getgid()), os.getgid()),
    (settings.cache_group, grp.getgrgid(os.getgid()).gr_name, os.getgid()),
])
def test_a_value_from_the_environment(monkeypatch, setting, text, value):
    monkeypatch.setenv(setting.name, text)
    assert setting.get() == value and setting.is_set()


@pytest.mark.parametrize("setting", settings.ALL, ids=lambda s: s.name)
@pytest.mark.parametrize("text", [None, ""], ids=["unset", "empty"])
def test_unset_or_empty_is_the_default(monkeypatch, setting, text):
    if text is None:
        monkeypatch.delenv(setting.name, raising=False)
    else:
        monkeypatch.setenv(setting.name, text)
    assert setting.get() == setting.type.parse(setting.default) and not setting.is_set()


def test_defaults(monkeypatch):
    for setting in settings.ALL:
        monkeypatch.delenv(setting.name, raising=False)
    assert {s.name: s.get() for s in settings.ALL} == {
        "AOTI_EAGER_CACHE_DIR": None, "AOTI_EAGER_CACHE_SIZE": 10 << 30, "AOTI_EAGER_CACHE_GROUP": None,
        "AOTI_EAGER_LOCK_TIMEOUT": 900.0, "AOTI_EAGER_MAX_VALUE_VARIANTS": 8, "AOTI_EAGER_MAX_SHAPE_COMPILES": 4,
        "AOTI_EAGER_MAX_MATMUL_SIZES": 8, "AOTI_EAGER_CPU_POOL": 512 << 20,
        "AOTI_EAGER_DYNAMIC_SHAPES": True, "AOTI_EAGER_BACKGROUND_JOBS": 0, "AOTI_EAGER_FORK_WORKERS": True,
        "AOTI_EAGER_KEEP_FASTER": True,
        "AOTI_EAGER_SPLIT_WRAPPER": True, "AOTI_EAGER_RECORD": None, "AOTI_EAGER_SIGNING_KEY": None,
        "AOTI_EAGER_TRUSTED_KEYS": [], "AOTI_EAGER_REMOTE": None, "AOTI_EAGER_REMOTE_CONNECT_TIMEOUT": 0.1,
        "AOTI_EAGER_REMOTE_TIMEOUT": 1.0, "AOTI_EAGER_REMOTE_MAX_ENTRY": 256 << 20, "AOTI_EAGER_REMOTE_RETRY": 60.0,
        "AOTI_EAGER_REMOTE_LOCK_TTL": 30.0,
        "AOTI_EAGER_VERBOSE_BUILD": False,
    }


def test_read_on_every_call(monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_MAX_VALUE_VARIANTS", "3")
    assert settings.max_value_variants.get() == 3
    monkeypatch.setenv("AOTI_EAGER_MAX_VALUE_VARIANTS", "5")
    assert settings.max_value_variants.get() == 5


@pytest.mark.parametrize("setting, text, message", [
    (settings.cache_size, "abc", "AOTI_EAGER_CACHE_SIZE='abc' is not a size (e.g. 10GiB, 500M, 4096)"),
    (settings.cache_size, "10 apples", "AOTI_EAGER_CACHE_SIZE='10 apples' is not a size (e.g. 10GiB, 500M, 4096)"),
    (settings.lock_timeout, "soon", "AOTI_EAGER_LOCK_TIMEOUT='soon' is not a number of seconds, finite and 0 or more (e.g. 900, 0.5)"),
    (settings.max_value_variants, "2.5", "AOTI_EAGER_MAX_VALUE_VARIANTS='2.5' is not a count (a whole number, 0 or more)"),
    (settings.max_value_variants, "-1", "AOTI_EAGER_MAX_VALUE_VARIANTS='-1' is not a count (a whole number, 0 or more)"),
    (settings.keep_faster, "maybe", "AOTI_EAGER_KEEP_FASTER='maybe' is not a boolean (1 or 0)"),
    (settings.cache_group, "nosuchgroup", "AOTI_EAGER_CACHE_GROUP='nosuchgroup' is not a group name or id on this machine"),
    (settings.remote, "http://cache-host", "AOTI_EAGER_REMOTE='http://cache-host' is not a Redis URL (redis://host:port/db, rediss:// for TLS, unix:///path)"),
])
def test_a_bad_value_names_the_variable_its_value_and_what_is_expected(monkeypatch, setting, text, message):
    monkeypatch.setenv(setting.name, text)
    with pytest.raises(ValueError) as raised:
        setting.get()
    assert str(raised.value) == message


@pytest.mark.parametrize("setting, text", [
    (settings.remote_lock_ttl, "nan"), (settings.remote_lock_ttl, "0"), (settings.remote_lock_ttl, "-1"),
    (settings.remote_timeout, "inf"), (settings.remote_timeout, "0"), (settings.remote_connect_timeout, "-0.5"),
    (settings.lock_timeout, "nan"), (settings.lock_timeout, "-inf"), (settings.lock_timeout, "-1"),
    (settings.remote_retry, "inf"),
])
def test_nan_inf_negatives_and_a_zero_timeout_are_refused_naming_the_range(monkeypatch, setting, text):
    monkeypatch.setenv(setting.name, text)
    with pytest.raises(ValueError) as raised:
        setting.get()
    allowed = "more than 0" if setting.type is settings.POSITIVE_SECONDS else "0 or more"
    assert str(raised.value) == f"{setting.name}={text!r} is not a number of seconds, finite and {allowed} (e.g. " \
        + ("30, 0.5)" if allowed == "more than 0" else "900, 0.5)")


def test_zero_is_taken_where_it_means_something(monkeypatch):
    monkeypatch.setenv("AOTI_EAGER_LOCK_TIMEOUT", "0")  # do not wait for another process's compile
    monkeypatch.setenv("AOTI_EAGER_REMOTE_RETRY", "0")
    assert settings.lock_timeout.get() == 0.0 and settings.remote_retry.get() == 0.0


def test_set_to_restores_the_environment(monkeypatch):
    monkeypatch.delenv("AOTI_EAGER_RECORD", raising=False)
    with settings.record.set_to("misses.jsonl"):
        assert settings.record.get() == Path("misses.jsonl")
    assert "AOTI_EAGER_RECORD" not in os.environ
    monkeypatch.setenv("AOTI_EAGER_RECORD", "mine.jsonl")
    with pytest.raises(KeyboardInterrupt), settings.record.set_to("other.jsonl"):
        raise KeyboardInterrupt
    assert os.environ["AOTI_EAGER_RECORD"] == "mine.jsonl"


def test_enable_refuses_a_bad_setting_up_front_not_on_every_call(monkeypatch):
    import aoti_eager

    monkeypatch.setenv("AOTI_EAGER_REMOTE_LOCK_TTL", "nan")
    with pytest.raises(ValueError, match=r"^AOTI_EAGER_REMOTE_LOCK_TTL='nan' is not a number of seconds, finite and more than 0"):
        aoti_eager.enable(["aten::abs"], devices=["cpu"])
