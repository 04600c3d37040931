"""CPU kernels take their outputs from a pool of freed blocks (csrc/cpu_output_pool.cpp)."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

import aoti_eager
from aoti_eager import _extension, settings
from helpers import assert_same_as_eager


def pooled(t: torch.Tensor) -> bool:
    return _extension.load().from_cpu_output_pool(t)


@pytest.fixture
def a():
    return torch.randn(64, 64)


@pytest.fixture
def b():
    return torch.randn(64, 64)


@pytest.fixture
def add_enabled(shared_cache):
    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=shared_cache):
        yield


def test_a_freed_output_is_reused_for_the_next_of_its_size(a, b, add_enabled):
    expected = a.clone().add_(b)  # in place: add_ is not overridden
    live = [torch.add(a, b) for _ in range(4)]
    assert all(pooled(out) for out in live)
    assert len({out.data_ptr() for out in live}) == 4
    freed = live.pop().data_ptr()
    again = torch.add(a, b)
    assert again.data_ptr() == freed
    for out in [*live, again]:
        assert_same_as_eager(out, expected)


LARGE = 256, 128  # float32: 128 KiB, a size class of its own


@pytest.fixture
def pool_limit():
    """Sets the pool's limit on large blocks for the test; the setting's after."""
    extension = _extension.load()
    yield extension.set_cpu_pool_limit
    extension.set_cpu_pool_limit(settings.cpu_pool.get())


def held() -> int:
    return _extension.load().cpu_pool_held_bytes()


def test_a_freed_large_output_is_reused_for_the_next_of_its_size(add_enabled, pool_limit):
    x, y = torch.randn(LARGE), torch.randn(LARGE)
    torch.add(x, y)  # compiled or loaded
    pool_limit(1 << 20)
    out = torch.add(x, y)
    assert aoti_eager.stats()["aten::add.Tensor"]["hits"] >= 1 and pooled(out)
    freed = out.data_ptr()
    del out
    assert held() >= 128 << 10
    again = torch.add(x, y)
    assert again.data_ptr() == freed
    assert_same_as_eager(again, x.clone().add_(y))


def test_the_pool_holds_large_blocks_up_to_its_limit_the_oldest_out_first(add_enabled, pool_limit):
    x = torch.randn(LARGE)
    torch.add(x, x)  # compiled or loaded
    pool_limit(0)
    assert held() == 0
    pool_limit(3 * (128 << 10))
    live = [torch.add(x, x) for _ in range(4)]
    addresses = [out.data_ptr() for out in live]
    while live:
        live.pop(0)  # the first freed is the oldest: back to c10 when the fourth comes in
    assert held() == 3 * (128 << 10)
    again = [torch.add(x, x) for _ in range(3)]
    assert {out.data_ptr() for out in again} == set(addresses[1:])
    assert held() == 0
    for out in again:
        assert_same_as_eager(out, x + x)


def test_the_setting_sizes_the_pool_as_a_cpu_kernel_loads(shared_cache, pool_limit, monkeypatch):
    x = torch.randn(LARGE)
    pool_limit(0)
    monkeypatch.setenv("AOTI_EAGER_CPU_POOL", "128KiB")
    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=shared_cache):
        torch.add(x, x)  # compiled or loaded: the pool takes the setting's limit
        torch.add(x, x)  # freed at once, and kept
    assert held() == 128 << 10  # after disable() too
    monkeypatch.setenv("AOTI_EAGER_CPU_POOL", "0")
    aoti_eager._overrides.forget()  # the kernel loads again, as in a new process
    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=shared_cache):
        assert_same_as_eager(torch.add(x, x), x + x)
    assert held() == 0


def test_a_pooled_output_resizes_as_eager_s_does(a, b, add_enabled):
    out = torch.add(a, b)
    kept = a.clone().add_(b).flatten()
    for rows in (80, 1024):  # within the small blocks' sizes, then above them
        out.resize_(rows, 64)
        assert out.shape == (rows, 64) and out.stride() == (64, 1)
        torch.testing.assert_close(out.flatten()[:kept.numel()], kept)
        out.fill_(rows)
        kept = out.flatten().clone()


def test_a_pooled_output_clones_lazily(a, b, add_enabled):
    out = torch.add(a, b)
    expected = out.clone()
    clone = torch._lazy_clone(out)
    clone.mul_(2)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(clone, expected * 2)


@pytest.mark.parametrize("size", [(64, 64), LARGE], ids=["small", "large"])
def test_outputs_freed_on_other_threads(size, add_enabled):
    a, b = torch.randn(size), torch.randn(size)
    expected = a.clone().add_(b)
    made: queue.Queue = queue.Queue(maxsize=8)
    errors: list[BaseException] = []

    def make():
        for _ in range(300):
            made.put(torch.add(a, b))

    def check():
        try:
            for _ in range(300):
                out = made.get()
                torch.testing.assert_close(out, expected, rtol=0, atol=0)
                out.zero_()  # then freed here, while other threads allocate
                del out
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            while True:
                made.get()

    threads = [threading.Thread(target=make) for _ in range(4)]
    threads += [threading.Thread(target=check, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads[:4]:
        t.join()
    assert not errors, errors[0]


def test_the_memory_profiler_sees_outputs_as_it_sees_eager_s(a, b, shared_cache):
    def allocated_by_add():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
            out = torch.add(a, b)
        return out, sum(e.cpu_memory_usage for e in profile.key_averages() if e.key == "aten::add")

    eager_out, eager_bytes = allocated_by_add()
    with aoti_eager.enabled(["aten::add.Tensor"], devices=["cpu"], cache_dir=shared_cache):
        torch.add(a, b)  # compiled or loaded
        out, bytes_ = allocated_by_add()
        hits = aoti_eager.stats()["aten::add.Tensor"]["hits"]
    assert hits == 1
    assert not pooled(out)
    assert eager_bytes == 64 * 64 * 4 and bytes_ == eager_bytes
    assert_same_as_eager(out, eager_out)


def test_outputs_come_from_another_cpu_allocator_where_one_is_set(a, b, add_enabled):
    torch.add(a, b)  # compiled or loaded
    torch._C._set_default_mobile_cpu_allocator()
    try:
        out = torch.add(a, b)
        hits = aoti_eager.stats()["aten::add.Tensor"]["hits"]
    finally:
        torch._C._unset_default_mobile_cpu_allocator()
    assert hits >= 1
    assert not pooled(out)
    assert_same_as_eager(out, a.clone().add_(b))
    assert pooled(torch.add(a, b))
