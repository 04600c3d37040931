"""The persistent kernel cache: where entries live, how they are keyed, and how
they are published so that every process of the user can share them."""

from aoti_eager.cache.layout import default_root, environment_key
from aoti_eager.cache.store import DamagedEntry, Entry, KernelCache, UntrustedEntry

__all__ = ["DamagedEntry", "Entry", "KernelCache", "UntrustedEntry", "default_root", "environment_key"]
