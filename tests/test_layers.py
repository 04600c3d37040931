"""The layers import only downward: aoti_eager/ (public API, runtime, CLI) ->
kernels/ (aoti_eager.kernels) -> cache/ (aoti_eager.cache), with
aoti_eager.settings and aoti_eager.version, stdlib-only leaves, open to every
layer. Inside aoti_eager/ too, each module imports only those below it in
RUNTIME_ORDER. Checked on the source, imports inside functions included.
The tests' modules import no test module: what they share is in
tests/helpers.py, and their fixtures in tests/conftest.py."""

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

# The modules of aoti_eager/, lowest first: each imports only those before it
# (and kernels/, cache/ and the leaves, which are below them all).
RUNTIME_ORDER = [
    "aoti_eager._decisions", "aoti_eager._stats", "aoti_eager._ops", "aoti_eager._zygote", "aoti_eager.manifest", "aoti_eager._options", "aoti_eager._extension",
    "aoti_eager._planner", "aoti_eager._mechanism", "aoti_eager._worker", "aoti_eager._background",
    "aoti_eager._region_state", "aoti_eager._region_misses", "aoti_eager._region_calls", "aoti_eager._regions", "aoti_eager._prewarm", "aoti_eager._runtime", "aoti_eager._overrides", "aoti_eager._reach", "aoti_eager", "aoti_eager._selfcheck", "aoti_eager._cli_cache", "aoti_eager.cli", "aoti_eager.__main__",
]


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


def test_every_module_of_the_runtime_has_its_place_in_the_order():
    assert sorted(RUNTIME_ORDER) == sorted(set(_in_layer("aoti_eager")) - LEAVES)


@pytest.mark.parametrize("name", RUNTIME_ORDER)
def test_a_module_of_the_runtime_imports_only_those_below_it(name):
    below = set(RUNTIME_ORDER[:RUNTIME_ORDER.index(name)])
    above = {i for i in imported(MODULES[name]) if i in RUNTIME_ORDER and i != name and i not in below}
    assert not above


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_function_imports_the_package(name):
    # What a function needs of the package is passed in, or imported at the top where the order allows.
    inside = [
        node.lineno
        for function in ast.walk(ast.parse(MODULES[name].read_text()))
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
        if isinstance(node, ast.Import) and any(alias.name == "aoti_eager" for alias in node.names)
    ]
    assert not inside


def test_there_are_no_import_cycles():
    graph = {name: {i for i in imported(path) if i in MODULES and i != name} for name, path in MODULES.items()}
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


def test_no_module_of_the_tests_imports_a_test_module():
    tests = ROOT / "tests"
    test_modules = {path.stem for path in tests.glob("test_*.py")}
    found = sorted(
        f"{path.name} imports {name}"
        for path in tests.glob("*.py")
        for name in imported(path)
        if name.split(".")[0] in test_modules
    )
    assert not found
