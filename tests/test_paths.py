"""Kernels compile whatever the cache root's name and whatever Inductor calls
the CPU's ISA; a compiler that cannot compile says why, once."""

from __future__ import annotations

import logging

import pytest
import torch

import aoti_eager
from aoti_eager import _mechanism
from aoti_eager.cache import layout
from aoti_eager.kernels import toolchain
from helpers import assert_same_as_eager


def compile_then_hit(root, n):
    x = torch.randn(n)
    with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=root):
        results = [torch.abs(x) for _ in range(3)]
        stats = aoti_eager.stats()["aten::abs"]
    for result in results:
        assert_same_as_eager(result, x.abs())
    assert (stats["compiles"], stats["hits"], stats["fallbacks"]) == (1, 2, 0), stats
    return stats


@pytest.mark.parametrize("name", ["team cache", "caché-κ-日本"])
def test_a_cache_root_with_spaces_or_other_letters_compiles(tmp_path, name):
    root = tmp_path / name / "kernels"
    compile_then_hit(root, 51)
    (environment,) = (root / layout.LAYOUT_VERSION).iterdir()
    assert layout.safe_name(environment.name) == environment.name


def test_an_isa_name_with_a_space_compiles(tmp_path, private_root, monkeypatch):
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    if not isa:
        pytest.skip("Inductor finds no vector ISA on this CPU")
    name = str(isa)
    # As Inductor names an AVX-512 VNNI CPU "avx512 avx512_vnni" (fma: a flag
    # every such CPU has, so that Inductor still finds the ISA usable).
    monkeypatch.setattr(type(isa), "__str__", lambda self: f"{name} fma")
    assert " " in toolchain.cpu_isa()
    compile_then_hit(tmp_path / "cache", 52)
    (environment,) = (tmp_path / "cache" / layout.LAYOUT_VERSION).iterdir()
    assert " " not in environment.name and "fma" in environment.name


def test_a_failing_compiler_says_why_and_is_given_up_after_a_few_signatures(tmp_path, monkeypatch, caplog):
    from torch._inductor.exc import CppCompileError

    monkeypatch.setattr(_mechanism, "compiler_failures", _mechanism.CompilerFailures())
    attempts = []

    def compiler_fails(*args, **kwargs):
        attempts.append(1)
        where = f"/tmp/scratch-{len(attempts)}/c{len(attempts)}abcdef12.cpp"
        raise CppCompileError(["g++", where], f"{where}:1:1: error: injected failure\ncompilation terminated.")

    monkeypatch.setattr(torch._inductor, "aot_compile", compiler_fails)
    xs = [torch.randn(n) for n in range(60, 66)]
    with caplog.at_level(logging.WARNING, logger="aoti_eager"):
        with aoti_eager.enabled(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
            results = [torch.abs(x) for x in xs + xs]
            stats = aoti_eager.stats()["aten::abs"]
    for result, x in zip(results, xs + xs):
        assert_same_as_eager(result, x.abs())
    assert len(attempts) == _mechanism.CompilerFailures.GIVE_UP_AFTER
    assert stats["compiles"] == 0 and "error: injected failure" in stats["fallback_reason"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "error: injected failure" in errors[0]
