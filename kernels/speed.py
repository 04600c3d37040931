"""A freshly validated kernel is timed once against the original kernel, on
copies of the call that compiled it, so that a signature where eager is
faster can stay eager (the runtime records the verdict in the cache: it is
measured once per machine, not once per process).

Both are called from Python, the kernel through its runner and the original
through the dispatcher, in interleaved rounds within a small time budget: a
comparison of kernel time on this machine, not of the C++ dispatch overhead
(``scripts/bench_dispatch.py`` measures that). The eager side goes through
``torch.ops``, whose binding costs a few microseconds more per call than
torch's own functions, so for calls of a few microseconds the comparison
leans toward the kernel; what it is for is a kernel that does real work more
slowly than ATen (a reduction or normalization Inductor schedules worse).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from aoti_eager.kernels.compile import flat_tensor_inputs, split_arguments
from aoti_eager.kernels.signature import CallSignature, clone_args

# Seconds one measurement may take (both sides, warm-up excluded) for calls
# that are cheap; a call that takes longer than the budget allows still gets
# MIN_ROUNDS rounds of one call each.
BUDGET_SECONDS = 0.1
WARMUP_CALLS = 3
MIN_ROUNDS, MAX_ROUNDS = 3, 7
MAX_CALLS_PER_ROUND = 2000
# A kernel is set aside for eager when it is slower, twice: a single noisy
# measurement must not flip a verdict. A tie keeps the kernel, but a kernel a
# few percent slower does not stay: its loss adds up over a whole workload.
SLOWER_THAN_EAGER = 1.0
# A kernel that only calls eager's own kernels (an extern matmul) is kept on
# CPU only where it saves a clear share of a long call: its one gain there is
# its outputs' memory (csrc/cpu_output_pool.h), and the Python binding's few
# microseconds of bias toward the kernel must not decide.
CLEAR_SAVING_SHARE = 0.1
CLEAR_SAVING_SECONDS = 50e-6

# Times a kernel against eager: (kernel, signature, op) -> Timing.
Timer = Callable[[Any, CallSignature, torch._ops.OpOverload], "Timing"]


@dataclass(frozen=True)
class Timing:
    """Seconds per call of the compiled kernel and of eager."""

    kernel_seconds: float
    eager_seconds: float

    @property
    def eager_faster(self) -> bool:
        return self.ratio > SLOWER_THAN_EAGER

    @property
    def clearly_faster(self) -> bool:
        saving = self.eager_seconds - self.kernel_seconds
        return saving >= CLEAR_SAVING_SHARE * self.eager_seconds and saving >= CLEAR_SAVING_SECONDS

    @property
    def ratio(self) -> float:
        """Kernel time over eager's: above 1, eager is faster."""
        return self.kernel_seconds / self.eager_seconds if self.eager_seconds > 0 else float("inf")

    @classmethod
    def of_json(cls, data: dict[str, float]) -> "Timing":
        return cls(data["kernel_us"] / 1e6, data["eager_us"] / 1e6)

    def to_json(self) -> dict[str, float]:
        return {
            "kernel_us": round(self.kernel_seconds * 1e6, 3),
            "eager_us": round(self.eager_seconds * 1e6, 3),
            "ratio": round(self.ratio, 3),
        }


def _seconds_per_call(fn: Callable[[], Any], calls: int, device: torch.device) -> float:
    if device.type == "cuda":
        # The device's own clock: the host's waits and launches do not count.
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    start_s = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start_s) / calls


def time_against_eager(
    kernel: Any, signature: CallSignature, op: torch._ops.OpOverload, budget: float = BUDGET_SECONDS
) -> Timing:
    """Times ``kernel`` against ``op``'s original kernel on copies of ``signature``'s call.

    Each side runs on its own copies (an in-place or ``out=`` call writes into
    them, never into the caller's tensors), the same number of times. After a
    few warm-up calls, rounds of each alternate, so that both see the same
    machine load; each side's fastest round is returned, since other work on
    the machine only ever adds time (a preempted OpenMP thread adds a whole
    time slice to a round). On CUDA a round is timed with CUDA events on the
    current stream.
    """
    kernel_inputs = flat_tensor_inputs(signature, clone_args(signature.args))
    positional, keywords = split_arguments(op, clone_args(signature.args))
    return time_both(lambda: kernel.run(kernel_inputs), lambda: op(*positional, **keywords), signature.device, budget)


def time_region_against_eager(kernel: Any, inputs: list[torch.Tensor], eager: Callable[[], Any],
                              budget: float = BUDGET_SECONDS) -> Timing:
    """Times a region's ``kernel`` on ``inputs`` against ``eager``, its
    original forward on the same values (see :func:`time_both`)."""
    return time_both(lambda: kernel.run(inputs), eager, inputs[0].device, budget)


def time_both(run_kernel: Callable[[], Any], run_eager: Callable[[], Any], device: torch.device,
              budget: float = BUDGET_SECONDS) -> Timing:
    """The seconds per call of ``run_kernel`` and ``run_eager`` in their fastest
    of interleaved rounds after a few warm-up calls (see :func:`time_against_eager`)."""
    with torch.no_grad():
        per_call = max(_seconds_per_call(run_kernel, WARMUP_CALLS, device), _seconds_per_call(run_eager, WARMUP_CALLS, device))
        rounds = min(MAX_ROUNDS, max(MIN_ROUNDS, int(budget / (2 * max(per_call, 1e-9)))))
        calls = min(MAX_CALLS_PER_ROUND, max(1, int(budget / (2 * rounds * max(per_call, 1e-9)))))
        kernel_times, eager_times = [], []
        for i in range(rounds):
            # Which side goes first alternates too: neither always follows the other.
            order = ((run_kernel, kernel_times), (run_eager, eager_times))
            for fn, times in order if i % 2 == 0 else reversed(order):
                times.append(_seconds_per_call(fn, calls, device))
    return Timing(min(kernel_times), min(eager_times))


def measured(kernel: Any, signature: Any, op: Any, timer: Timer = time_against_eager) -> Timing:
    """``timer``'s timing of ``kernel`` against eager, taken a second time
    where the first says eager is faster: the kernel's better showing, so
    that eager wins only on two measurements. ``signature`` and ``op`` are
    what ``timer`` takes besides the kernel (a region's: its inputs and its
    forward)."""
    timing = timer(kernel, signature, op)
    if timing.eager_faster:
        again = timer(kernel, signature, op)
        timing = min(timing, again, key=lambda t: t.ratio)
    return timing
