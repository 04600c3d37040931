"""The ``aoti-eager`` command line (also ``python -m aoti_eager``)."""

from __future__ import annotations

import argparse
import sys

from aoti_eager.cache import default_root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aoti-eager", description="Eager PyTorch with AOTInductor kernels.")
    parser.add_argument("--version", action="version", version="aoti_eager 0.1.0")
    commands = parser.add_subparsers(dest="command", required=True)
    cache = commands.add_parser("cache", help="the persistent kernel cache").add_subparsers(dest="action", required=True)
    cache.add_parser("path", help="print the cache directory ($AOTI_EAGER_CACHE_DIR or the per-user cache dir)")
    args = parser.parse_args(argv)
    if (args.command, args.action) == ("cache", "path"):
        print(default_root())
    return 0


if __name__ == "__main__":
    sys.exit(main())
