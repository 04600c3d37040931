"""The torch internals a module of this package relies on, and whether the
installed torch still has them.

An internal is named by its dotted path, a module then attributes
(``torch._inductor.codecache._precompile_header``); where the module calls
it, the parameters it passes by name follow in parentheses
(``torch._inductor.codecache._precompile_header(header, hashable_cmd_line)``):
the internal must then be callable and take each of them.

    >>> missing(["os.path.join(path)", "os.no_such_function", "os.sep()"])
    ['os.path.join: takes no parameter named path', 'os.no_such_function: not found', 'os.sep: not callable']
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Iterable


class InternalMoved(LookupError):
    """A torch internal a module relies on is not where it was (the message names it)."""


def resolve(internal: str) -> Any:
    """The object ``internal`` names (its parameters, if any, ignored).

    Raises InternalMoved naming it where its module or an attribute is missing."""
    path = internal.split("(", 1)[0]
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:end]))
        except ImportError:
            continue
        for attribute in parts[end:]:
            try:
                found = getattr(found, attribute)
            except AttributeError:
                raise InternalMoved(f"{path}: not found") from None
        return found
    raise InternalMoved(f"{path}: not found")


def problem(internal: str) -> str | None:
    """What is wrong with ``internal`` in the installed torch, or None."""
    try:
        found = resolve(internal)
    except InternalMoved as e:
        return str(e)
    name, _, parameters = internal.partition("(")
    if not parameters:
        return None
    if not callable(found):
        return f"{name}: not callable"
    try:
        taken = inspect.signature(found).parameters
    except (TypeError, ValueError):  # a builtin without a signature: callable is all that can be told
        return None
    for parameter in filter(None, (p.strip() for p in parameters.rstrip(")").split(","))):
        if parameter not in taken:
            return f"{name}: takes no parameter named {parameter}"
    return None


def missing(internals: Iterable[str]) -> list[str]:
    """What is wrong with each of ``internals`` that moved or changed shape, one line each."""
    return [found for found in map(problem, internals) if found is not None]


def named(internal: str) -> str:
    """The dotted path of ``internal``, without its parameters."""
    return internal.split("(", 1)[0]
