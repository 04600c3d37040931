"""The layers import only downward: aoti_eager/ (public API, runtime, CLI) ->
kernels/ (aoti_eager.kernels) -> cache/ (aoti_eager.cache), with
aoti_eager.settings and aoti_eager.version, stdlib-only leaves, open to every
layer. Checked on the source, imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"aoti_eager": "aoti_eager", "kernels": "aoti_eager.kernels", "cache": "aoti_eager.cache"}
LEAVES = {"aoti_eager.settings", "aoti_eager.version"}


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [package, *path.relative_to(ROOT / folder).with_suffix("").parts]
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it; ``from package import
    module`` counts as the module."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.add(submodule if submodule in MODULES else node.module)
    return names


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _in_layer(folder: str) -> list[str]:
    return [name for name, path in MODULES.items() if path.relative_to(ROOT).parts[0] == folder]


@pytest.mark.parametrize("name", _in_layer("cache"))
def test_the_store_imports_nothing_above_it(name):
    above = {
        i for i in imported(MODULES[name])
        if _within(i, "torch._inductor") or (_within(i, "aoti_eager") and not _within(i, "aoti_eager.cache") and i not in LEAVES)
    }
    assert not above


def test_only_the_schema_check_of_the_store_imports_torch():
    # Its keys are opaque names; torch is there to check what an entry tells
    # the C++ side against the op's schema.
    assert [name for name in _in_layer("cache") if any(_within(i, "torch") for i in imported(MODULES[name]))] == [
        "aoti_eager.cache.store"
    ]


@pytest.mark.parametrize("name", _in_layer("kernels"))
def test_kernels_import_nothing_of_the_runtime(name):
    above = {
        i for i in imported(MODULES[name])
        if _within(i, "aoti_eager") and not _within(i, "aoti_eager.kernels") and not _within(i, "aoti_eager.cache")
        and i not in LEAVES
    }
    assert not above


def test_there_are_no_import_cycles():
    # The runtime's workers call the public API (the package, aoti_eager/__init__.py)
    # at run time, as a user would: that is not an edge between modules' code.
    graph = {
        name: {i for i in imported(path) if i in MODULES and i not in (name, "aoti_eager")}
        for name, path in MODULES.items()
    }
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        for child in sorted(graph[name]):
            if child in path:
                cycles.append(path[path.index(child):] + [child])
            elif child not in done:
                visit(child, path + [child])
        done.add(name)

    done: set[str] = set()
    for name in sorted(graph):
        visit(name, [name])
    assert not cycles


def test_what_a_kernel_is_built_with_is_defined_in_one_module():
    facts = {"cpp_compiler", "compiler_identity", "linker", "cpu_isa", "usable_vec_isas", "environment_fields",
             "environment_name", "known_vec_isas", "machine_record"}
    defined = {
        (node.name, name)
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name in facts
    }
    home = {"known_vec_isas": "aoti_eager.kernels.inductor.vec_isa", "machine_record": "aoti_eager.cache.layout"}
    assert defined == {(fact, home.get(fact, "aoti_eager.kernels.toolchain")) for fact in facts}

