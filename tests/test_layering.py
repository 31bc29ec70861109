"""The package's layering, read from the source: shared pieces never import a workload, no workload
imports another (except serve, which serves the LLM), and no module imports itself back through
others, not even for type hints alone (imports under `if TYPE_CHECKING:` do not run, so they count
for circles but not for the layers)."""

from __future__ import annotations

import ast
from pathlib import Path

import genfast

ROOT = Path(genfast.__file__).parent
WORKLOADS = ("llm", "sam", "diffusion", "serve")
ALLOWED = {("serve", "llm")}  # (importer, imported)
ENTRY_POINTS = ("genfast.cli", "genfast.__main__")  # above every workload: they register and run them
# Above the workloads too: the package's public names (`genfast.LLM`, imported lazily by its
# __getattr__) and the Ray integration, which runs every workload's objects on a cluster.
INTEGRATIONS = ("genfast", "genfast.ray")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST, type_only: bool = False) -> list[str]:
    """Modules imported by statements that run (anything but `if TYPE_CHECKING:` blocks), and with
    `type_only` those blocks' too."""
    found = []

    def visit(node: ast.AST) -> None:
        type_checking = isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        if type_checking and not type_only:
            return
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
            found.extend(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in _runtime_imports(ast.parse(path.read_text()), type_only):
            # Importing genfast.x.y also runs genfast/x/__init__.py; those package files are kept
            # empty of imports (checked below), so the edge to the package itself is left out.
            if target in modules and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def _workload(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WORKLOADS else None


def test_shared_pieces_import_no_workload_and_workloads_import_no_other():
    wrong = []
    for module, targets in import_graph().items():
        if module in ENTRY_POINTS or any(module == i or module.startswith(i + ".") for i in INTEGRATIONS[1:]):
            continue
        if module == "genfast":
            continue
        for target in targets:
            mine, theirs = _workload(module), _workload(target)
            if theirs is not None and mine != theirs and (mine, theirs) not in ALLOWED:
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


# Packages whose __init__ is a module of its own, imported by name: the LLM families' registry and
# the SAM model classes that mirror the original package's `modeling`.
REGISTRY_PACKAGES = ("llm/model/families", "sam/modeling")


def test_packages_import_nothing_on_their_own():
    for init in sorted(ROOT.rglob("__init__.py")):
        package = init.parent.relative_to(ROOT)
        if package.as_posix() in REGISTRY_PACKAGES:
            continue
        tree = ast.parse(init.read_text())
        if package == Path("."):  # the public names, imported when first used (`def __getattr__`)
            tree.body = [
                node for node in tree.body if not (isinstance(node, ast.FunctionDef) and node.name == "__getattr__")
            ]
        assert not [t for t in _runtime_imports(tree) if t.startswith("genfast")], package


def test_kernels_import_no_workload_and_nothing_that_calls_them():
    """genfast.kernels sits below everything that calls a kernel: the workloads, genfast.quant and
    genfast.nn import it, never the reverse."""
    callers = ("genfast.quant", "genfast.nn", *(f"genfast.{w}" for w in WORKLOADS))

    def under(module: str, package: str) -> bool:
        return module == package or module.startswith(package + ".")

    wrong = [
        f"{module} -> {target}"
        for module, targets in import_graph().items()
        if under(module, "genfast.kernels")
        for target in targets
        if any(under(target, caller) for caller in callers)
    ]
    assert not wrong, wrong


def test_there_is_no_import_cycle():
    graph = import_graph(type_only=True)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                raise AssertionError(" -> ".join(path[path.index(target) :] + [target]))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
