"""The house's shape, read from the code (docs/architecture.md): no import cycles, no hand-written module over
600 lines, and the layering the architecture page states."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMIT = 600  # lines of one hand-written module
GENERATED = ("_pb2.py", "_pb2_grpc.py")  # grpcio-tools' stubs (island_jax/comm/generate_stubs.py)


def modules() -> dict[str, str]:
    """{dotted module name: path} of every module of island_jax/ (a package by its __init__)."""
    found = {}
    for folder, _, names in os.walk(os.path.join(ROOT, "island_jax")):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


class _Imports(ast.NodeVisitor):
    """The modules a file imports, at module level or inside functions, except under `if TYPE_CHECKING:`.
    `from p import x` names p.x where `is_module(p.x)`, else p."""

    def __init__(self, package: str, is_module=lambda name: False):
        self.package, self.is_module, self.names = package, is_module, set()

    def visit_If(self, node):
        test = node.test
        if getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING":
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node):
        self.names.update(alias.name for alias in node.names)

    def visit_ImportFrom(self, node):
        source = node.module or ""
        if node.level:  # relative: from the file's package, up level - 1 packages
            parts = self.package.split(".")
            source = ".".join(parts[: len(parts) - node.level + 1] + ([source] if source else []))
        for alias in node.names:
            self.names.add(f"{source}.{alias.name}" if self.is_module(f"{source}.{alias.name}") else source)


def imports(name: str, path: str, is_module=lambda name: False) -> set[str]:
    """The dotted names module `name` (at `path`) imports."""
    visitor = _Imports(name if path.endswith("__init__.py") else name.rpartition(".")[0], is_module)
    visitor.visit(ast.parse(open(path, encoding="utf-8").read(), path))
    return visitor.names


def import_graph() -> dict[str, set[str]]:
    """{module: the island_jax modules it imports}; a package's __init__ importing its own submodules (its
    face) is not an edge."""
    found = modules()

    def resolve(name):  # `import a.b.c` of a name inside module a.b: a.b
        while name and name not in found:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in found.items():
        targets = {resolve(n) for n in imports(name, path, found.__contains__) if n.split(".")[0] == "island_jax"}
        graph[name] = {t for t in targets if t and t != name
                       and not (path.endswith("__init__.py") and t.startswith(name + "."))}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, modules in sorted order)."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_reader_finds_a_cycle_and_names_it():
    graph = {"island_jax.a": {"island_jax.b"}, "island_jax.b": {"island_jax.c"}, "island_jax.c": {"island_jax.a"},
             "island_jax.d": {"island_jax.a"}}
    assert find_cycle(graph) == ["island_jax.a", "island_jax.b", "island_jax.c", "island_jax.a"]
    assert find_cycle({"island_jax.a": {"island_jax.b"}, "island_jax.b": set()}) is None


def test_the_reader_sees_imports_inside_functions_but_not_type_checking_blocks():
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from island_jax.coordinator import Coordinator\n"
        "def f():\n    from island_jax.outer import codec\n    import island_jax.mesh\n"
        "from .step import x\n"
    )
    visitor = _Imports("island_jax.island", {"island_jax.outer.codec", "island_jax.island.step"}.__contains__)
    visitor.visit(tree)
    assert visitor.names == {"typing", "island_jax.outer.codec", "island_jax.mesh", "island_jax.island.step"}


def test_there_is_no_import_cycle():
    assert find_cycle(import_graph()) is None, f"import cycle: {' -> '.join(find_cycle(import_graph()))}"


def test_no_hand_written_module_is_over_600_lines():
    over = {name: sum(1 for _ in open(path, encoding="utf-8")) for name, path in modules().items()
            if not path.endswith(GENERATED)}
    over = {name: lines for name, lines in over.items() if lines > LIMIT}
    assert over == {}, f"modules over {LIMIT} lines (cut each into modules of one idea): {over}"


# (importer, imported): the importer's package never imports the other's (docs/architecture.md)
FORBIDDEN = [
    ("island_jax.comm", "island_jax.coordinator"),
    ("island_jax.island", "island_jax.coordinator"),
    ("island_jax.coordinator", "island_jax.comm"),
    ("island_jax.island", "island_jax.comm"),
    ("island_jax.protocol", "island_jax"),
]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("importer,imported", FORBIDDEN, ids=[f"{a}-{b}" for a, b in FORBIDDEN])
def test_the_layering_holds(importer, imported):
    crossed = sorted(f"{m} -> {d}" for m, ds in import_graph().items() if _within(m, importer)
                     for d in ds if _within(d, imported) and not _within(d, importer))
    assert crossed == []


def test_the_library_imports_nothing_from_the_folders_beside_it():
    outside = {"experiments", "launch", "benchmarks", "tests"}
    found = []
    for name, path in modules().items():
        found += [f"{name} -> {n}" for n in sorted(imports(name, path)) if n.split(".")[0] in outside]
    assert found == []
