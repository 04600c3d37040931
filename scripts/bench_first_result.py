"""Seconds from ``enable()`` to the first result of a new signature, in this new process.

Run it with ``AOTI_EAGER_CACHE_DIR`` set to a new directory to measure what a
new cache root costs (for a user who has used aoti_eager before: the C++
extension, the machine records and the shared wrapper half are the user's, not
the root's):

    AOTI_EAGER_KEEP_FASTER=0 AOTI_EAGER_CACHE_DIR=$(mktemp -d) python scripts/bench_first_result.py [--device cuda] [--size N]
"""

from __future__ import annotations

import argparse
import time

start = time.perf_counter()

import torch  # noqa: E402

import aoti_eager  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size", type=int, default=1003, help="a length no earlier run used: a new signature")
    args = parser.parse_args()
    x = torch.randn(args.size, device=args.device)
    enabled = time.perf_counter()
    aoti_eager.enable(["aten::abs.default"], devices=[args.device])
    y = torch.abs(x)
    if args.device == "cuda":
        torch.cuda.synchronize()
    done = time.perf_counter()
    torch.testing.assert_close(y, x.abs())
    stats = aoti_eager.stats()["aten::abs"]
    print(f"{args.device}: first result {done - enabled:.1f} s (process {done - start:.1f} s), "
          f"compiles {stats['compiles']}, fallback reason {stats['fallback_reason']}")


if __name__ == "__main__":
    main()
