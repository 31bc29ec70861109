"""The package's layering, read from the source: shared pieces never import a workload, no workload
imports another (except serve, which serves the LLM), and no module imports itself back through
others (type-only imports under `if TYPE_CHECKING:` do not run and are not counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import genfast

ROOT = Path(genfast.__file__).parent
WORKLOADS = ("llm", "sam", "diffusion", "serve")
ALLOWED = {("serve", "llm")}  # (importer, imported)
ENTRY_POINTS = ("genfast.cli", "genfast.__main__")  # above every workload: they register and run them


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(tree: ast.AST) -> list[str]:
    """Modules imported by statements that run (anything but `if TYPE_CHECKING:` blocks)."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
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


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in _runtime_imports(ast.parse(path.read_text())):
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
        if module in ENTRY_POINTS:
            continue
        for target in targets:
            mine, theirs = _workload(module), _workload(target)
            if theirs is not None and mine != theirs and (mine, theirs) not in ALLOWED:
                wrong.append(f"{module} -> {target}")
    assert not wrong, wrong


def test_workload_packages_import_nothing_on_their_own():
    kernel_packages = [p.parent.relative_to(ROOT) for p in (ROOT / "kernels").rglob("__init__.py")]
    for package in (*WORKLOADS, "bench", "quant", *kernel_packages):
        tree = ast.parse((ROOT / package / "__init__.py").read_text())
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
    graph = import_graph()
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
