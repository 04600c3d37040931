"""ops_reached: the overloads a model reaches, in call order, and enabling them."""

from __future__ import annotations

import pytest
import torch

import aoti_eager
from aoti_eager import _overrides

A = torch.ops.aten
VIEW = "view or aliasing"


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(torch.nn.functional.gelu(self.linear(x)))
        return torch.softmax(y.view(-1, 4, 4), dim=-1)


# linear is t + addmm, layer_norm native_layer_norm, softmax _softmax by the time they reach a kernel.
FORWARD = [A.addmm.default, A.gelu.default, A.native_layer_norm.default, A._softmax.default]


@pytest.fixture
def block() -> Block:
    torch.manual_seed(0)
    return Block()


@pytest.mark.parametrize("mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
def test_the_overloads_reaching_kernels_in_call_order(block, mode):
    x = torch.randn(2, 8)
    with mode():
        # Twice: each overload once, at its first call.
        reached = aoti_eager.ops_reached(lambda: (block(x), block(x)))
    assert isinstance(reached, aoti_eager.ReachedOps) and list(reached) == FORWARD
    assert reached.names == ["aten::addmm", "aten::gelu", "aten::native_layer_norm", "aten::_softmax"]
    # Composite ops are never there: what they decompose into is, also where
    # inference mode hands them to the dispatch mode whole.
    assert VIEW in reached.refused["aten::view"] and VIEW in reached.refused["aten::t"]
    assert not {"aten::linear", "aten::layer_norm", "aten::softmax.int"} & set(reached.refused)


def test_backward_ops_are_reached_too(block):
    x = torch.randn(2, 8, requires_grad=True)
    reached = aoti_eager.ops_reached(lambda: block(x).sum().backward())
    assert reached[: len(FORWARD)] == FORWARD
    assert {A.gelu_backward.default, A.native_layer_norm_backward.default, A.mm.default} <= set(reached)


def test_args_and_kwargs_are_passed_on():
    reached = aoti_eager.ops_reached(torch.nn.functional.leaky_relu, torch.randn(4), negative_slope=0.2)
    assert list(reached) == [A.leaky_relu.default]


def test_ops_on_other_devices_and_refused_ops_carry_their_reason():
    reached = aoti_eager.ops_reached(lambda: (torch.ones(3, device="meta").abs(), torch.rand(3).abs()))
    assert list(reached) == [A.abs.default]  # eligible on cpu, whatever it did on meta
    assert "meta device" in reached.refused["aten::ones"]
    assert "random op" in reached.refused["aten::rand"]


def test_enabling_what_a_model_reaches(block, shared_cache):
    x = torch.randn(2, 8)
    expected = block(x)
    reached = aoti_eager.ops_reached(block, x)
    aoti_eager.enable(ops=reached, devices=["cpu"], cache_dir=shared_cache)
    assert {o.name for o in _overrides.installed()} == set(reached.names)
    torch.testing.assert_close(block(x), expected)
    stats = aoti_eager.stats()
    torch.testing.assert_close(block(x), expected)
    after = aoti_eager.stats()
    assert all(after[name]["hits"] > stats[name]["hits"] for name in reached.names), after

    # Enabled ops are still seen, and new signatures (another batch size) are
    # not compiled while observing: they are decided at their next call.
    assert aoti_eager.ops_reached(block, torch.randn(3, 8)) == reached
    assert [aoti_eager.stats()[name]["compiles"] for name in reached.names] == [after[name]["compiles"] for name in reached.names]


def test_what_fn_raises_is_raised():
    def fails():
        torch.ones(2).abs()
        raise KeyError("from fn")

    with pytest.raises(KeyError, match="from fn"):
        aoti_eager.ops_reached(fails)
