"""One tiny kernel through the whole path, for ``aoti-eager doctor``.

Finding the extension and a compiler proves little: what users need is that a
call compiles, loads, runs from the C++ hit path and gives eager's result. This
does exactly that, through the public API, in a throwaway cache.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass

import torch

import aoti_eager
from aoti_eager import settings

# The stage a miss failed in, by how the runtime's reason starts.
_STAGES = (
    ("torch.export failed", "export"),
    ("AOTInductor failed: the C++ compiler said", "C++ compile"),
    ("AOTInductor failed", "AOTInductor"),
    ("cached kernel failed to load", "load"),
    ("compiled kernel failed to run", "run"),
    ("compiled kernel disagrees with eager", "result"),
)


@dataclass
class SelfCheck:
    device: str
    seconds: float  # from the first call to its result: the compile, the load and the run
    failed_stage: str | None = None
    reason: str | None = None

    def to_json(self) -> dict:
        return vars(self)


def check_device(device: str) -> SelfCheck:
    """Compiles ``abs`` of a small tensor on ``device`` in a new empty cache,
    then calls it again, which must be a hit of the C++ path; both results must
    be eager's."""
    x = torch.linspace(-2.0, 2.0, 37, device=device)
    expected = torch.abs(x)
    # Eager may well be faster on 37 numbers: the kernel is what is checked here.
    with settings.keep_faster.set_to("0"), tempfile.TemporaryDirectory(prefix="aoti_eager-doctor-") as cache_dir:
        start = time.perf_counter()
        with aoti_eager.enabled(["aten::abs"], devices=[device], cache_dir=cache_dir, record=None, compile="now"):
            first = torch.abs(x)
            seconds = time.perf_counter() - start
            second = torch.abs(x)
            stats = aoti_eager.stats()["aten::abs"]
    check = SelfCheck(device, round(seconds, 3))
    reason = stats["fallback_reason"]
    if stats["compiles"] != 1 or reason:
        reason = reason or "nothing was compiled"
        check.failed_stage = next((stage for start, stage in _STAGES if reason.startswith(start)), "compile")
        check.reason = reason
    elif stats["hits"] != 1:
        check.failed_stage, check.reason = "hit path", f"the second call was not served by the kernel: {stats}"
    else:
        for result in (first, second):
            try:
                torch.testing.assert_close(result, expected, rtol=0, atol=0)
            except AssertionError as e:
                check.failed_stage, check.reason = "result", str(e).splitlines()[0]
    return check
