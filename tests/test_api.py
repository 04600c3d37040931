"""The public API: op names, refusals, enable/disable, the scoped form, stats."""

from __future__ import annotations

import warnings

import pytest
import torch

import aoti_eager
from aoti_eager import _ops, _overrides
from helpers import op_rows

A = torch.ops.aten


def overridden() -> set[tuple[str, str]]:
    return {(o.name, o.device) for o in _overrides.installed()}


@pytest.mark.parametrize(
    "spec",
    ["aten::add.Tensor", "add.Tensor", A.add.Tensor],
    ids=["qualified", "bare", "OpOverload"],
)
def test_single_overload_forms(spec, tmp_path):
    aoti_eager.enable([spec], devices=["cpu"], cache_dir=tmp_path)
    assert overridden() == {("aten::add.Tensor", "cpu")}


@pytest.mark.parametrize("spec", ["aten::add", "add", A.add], ids=["qualified", "bare", "OpOverloadPacket"])
def test_packet_forms_take_every_eligible_overload(spec, tmp_path):
    aoti_eager.enable([spec], devices=["cpu"], cache_dir=tmp_path)
    names = {name for name, _ in overridden()}
    assert {"aten::add.Tensor", "aten::add.Scalar", "aten::add.out"} <= names


def test_single_spec_without_list(tmp_path):
    aoti_eager.enable("aten::abs.default", devices=["cpu"], cache_dir=tmp_path)
    assert overridden() == {("aten::abs", "cpu")}


def test_unknown_op_and_overload():
    with pytest.raises(ValueError, match="no op named"):
        aoti_eager.enable(["aten::not_an_op"])
    with pytest.raises(ValueError, match="has no overload 'Bogus'"):
        aoti_eager.enable(["aten::add.Bogus"])


@pytest.mark.parametrize(
    "spec, reason",
    [
        ("aten::view", "view or aliasing"),
        ("aten::transpose.int", "view or aliasing"),
        ("aten::_unsafe_view", "view or aliasing"),  # a view without an alias annotation
        ("aten::unsafe_split.Tensor", "view or aliasing"),
        ("aten::bernoulli.p", "random op"),
        ("aten::randn_like", "random op"),
        ("aten::empty_like", "uninitialized memory"),
        ("aten::squeeze_.dim", "shape or strides in place"),
        ("aten::resize_", "shape or strides in place"),
        ("aten::empty.memory_format", "uninitialized memory"),
        ("aten::nonzero", "depends on the input data"),
        ("aten::masked_select", "depends on the input data"),
        ("aten::_unique2", "depends on the input data"),
        ("aten::item", "depends on the input data"),
        ("aten::softmax.int", "composite op"),
        # Kernels that would only call the eager op, through AOTInductor's proxy executor.
        ("aten::_linalg_svd", "no C shim for aten::_linalg_svd: a kernel would only call the eager op"),  # a fallback lowering
        ("aten::_fft_c2r", "no C shim for aten::_fft_c2r"),  # no lowering at all
        ("aten::nanmedian.dim", "no C shim for aten::nanmedian.dim"),
        ("aten::_foreach_norm.Scalar", "no C shim for aten::_foreach_norm.Scalar"),
    ],
)
def test_refusals_name_the_op_and_the_reason(spec, reason):
    name = _ops.qualified_name(_ops.resolve(spec).overloads[0])
    with pytest.raises(ValueError, match=reason) as info:
        aoti_eager.enable([spec if "." in spec else _ops.resolve(spec).overloads[0]])
    assert name in str(info.value)
    assert overridden() == set()


@pytest.mark.parametrize("spec", [
    "aten::add.Tensor", "aten::_fft_r2c", "aten::clone",  # a C shim; a lowering
    "aten::mm", "aten::_to_copy",  # a decomposition Inductor may apply
    "aten::upsample_bilinear2d", "aten::median.dim",  # decomposed while traced; a lowering that falls back for some inputs
    "aten::_foreach_add.ScalarList",  # traced as its .Scalar overload, which Inductor lowers
])
def test_ops_whose_kernels_may_do_more_than_call_eager_are_accepted(spec):
    assert _ops.refusal(_ops.resolve(spec).overloads[0]) is None


def test_packet_warns_about_what_it_leaves_to_eager(tmp_path):
    with pytest.warns(UserWarning, match=r"(?s).*aten::max.other \(it is a composite op") as record:
        aoti_eager.enable(["aten::max"], devices=["cpu"], cache_dir=tmp_path)
    assert len(record) == 1
    assert ("aten::max.dim", "cpu") in overridden()


def test_packet_with_nothing_eligible_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"no overload of aten::bernoulli .*random op"):
        aoti_eager.enable(["aten::bernoulli"], devices=["cpu"], cache_dir=tmp_path)


def test_enable_twice_adds_and_disable_restores(tmp_path):
    aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path)
    aoti_eager.enable(["aten::neg.default"], devices=["cpu"], cache_dir=tmp_path)
    assert overridden() == {("aten::abs", "cpu"), ("aten::neg", "cpu")}
    assert "aoti_eager" in torch._C._dispatch_dump("aten::abs")
    aoti_eager.disable(["aten::abs.default"])
    assert overridden() == {("aten::neg", "cpu")}
    aoti_eager.disable()
    assert overridden() == set()
    for name in ("aten::abs", "aten::neg"):
        assert "aoti_eager" not in torch._C._dispatch_dump(name)
    assert op_rows() == {}


def test_enabled_scope_keeps_what_was_enabled_before(tmp_path):
    aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path)
    with aoti_eager.enabled(["aten::neg.default", "aten::abs.default"], devices=["cpu"], cache_dir=tmp_path):
        assert overridden() == {("aten::abs", "cpu"), ("aten::neg", "cpu")}
    assert overridden() == {("aten::abs", "cpu")}


def test_enabled_scope_restores_on_error(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with aoti_eager.enabled(["aten::neg.default"], devices=["cpu"], cache_dir=tmp_path):
            raise RuntimeError("boom")
    assert overridden() == set()


def test_devices_are_checked():
    with pytest.raises(ValueError, match="devices are"):
        aoti_eager.enable(["aten::abs.default"], devices=["tpu"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            aoti_eager.enable(["aten::abs.default"], devices=["cuda"])


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setattr(aoti_eager, "_root", None)
    monkeypatch.setenv("AOTI_EAGER_CACHE_DIR", str(tmp_path / "from-env"))
    assert aoti_eager.cache_dir() == tmp_path / "from-env"
    monkeypatch.delenv("AOTI_EAGER_CACHE_DIR")
    assert aoti_eager.cache_dir().name == "aoti_eager"


@pytest.mark.parametrize("call", ["enable", "fuse"])
def test_a_cache_dir_given_is_the_default_of_later_calls(call, tmp_path, monkeypatch):
    monkeypatch.setattr(aoti_eager, "_root", None)
    if call == "enable":
        aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path / "given")
    else:
        aoti_eager.fuse(torch.nn.Sequential(torch.nn.Linear(2, 2)), cache_dir=tmp_path / "given")
    assert aoti_eager.cache_dir() == tmp_path / "given"
    with pytest.raises(ValueError, match='compile is "now", "background" or "never", not \'later\''):
        aoti_eager.fuse(torch.nn.Sequential(), compile="later", cache_dir=tmp_path / "other")
    assert aoti_eager.cache_dir() == tmp_path / "given"  # a refused call changes nothing


def test_stats_keys(tmp_path):
    aoti_eager.enable(["aten::abs.default"], devices=["cpu"], cache_dir=tmp_path)
    assert aoti_eager.stats()["aten::abs"] == dict(
        calls=0, hits=0, misses=0, compiles=0, cache_loads=0, fallbacks=0, fallback_reason=None, compile_seconds=0.0,
        queued=0, compiling=0,
    )


def test_enable_emits_no_warning_for_a_single_overload(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aoti_eager.enable(["aten::sigmoid.default"], devices=["cpu"], cache_dir=tmp_path)
