"""The persistent kernel cache: where entries live and how they are published
so that every process of the user can share them. Its keys (the environment,
the signature) are names it is given."""

from aoti_eager.cache.layout import default_root
from aoti_eager.cache.store import DamagedEntry, Entry, KernelCache, UntrustedEntry

__all__ = ["DamagedEntry", "Entry", "KernelCache", "UntrustedEntry", "default_root"]
