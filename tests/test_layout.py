"""The layout shows the architecture (docs/design.md, section 1): no service imports another, and
``shared/`` holds only what two or more of the packages agree on.

The import graph is read with ``ast`` from every module of the four packages; tests, scripts and
fuzz harnesses are not users. A shared module imported by another shared module counts for that
module's users too (``shared/wire.py`` is used by the proxy through ``shared/response_arrays.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("rollout_worker", "router_proxy", "trainer_service")
PACKAGES = (*SERVICES, "centerline")


def imported_modules(path: Path) -> set[str]:
    """The ``package.module`` names of this repository that ``path`` imports (anywhere in it)."""
    package = path.relative_to(REPO).parts[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package if node.level else node.module or ""
            if node.level and node.module:
                base = f"{package}.{node.module}"
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            package_name, _, rest = name.partition(".")
            module = rest.split(".")[0]
            if module and ((REPO / package_name / f"{module}.py").is_file() or (REPO / package_name / module).is_dir()):
                found.add(f"{package_name}.{module}")
            elif package_name in (*PACKAGES, "shared"):
                found.add(package_name)
    return found


def import_graph() -> dict[str, set[str]]:
    """``package.module`` -> the modules it imports, over the four packages and ``shared/``."""
    graph = {}
    for package in (*PACKAGES, "shared"):
        for path in sorted((REPO / package).rglob("*.py")):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts[:2])
            graph.setdefault(module, set()).update(imported_modules(path))
    return graph


def shared_users(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module of ``shared/`` -> the packages that import it, directly or through shared modules."""
    users = {module: set() for module in graph if module.startswith("shared.") and module != "shared.__init__"}
    for module, imports in graph.items():
        package = module.split(".")[0]
        if package == "shared":
            continue
        seen, todo = set(), [m for m in imports if m in users]
        while todo:
            current = todo.pop()
            if current not in seen:
                seen.add(current)
                todo.extend(m for m in graph[current] if m in users)
        for current in seen:
            users[current].add(package)
    return users


def test_no_service_imports_another():
    crossing = sorted(
        (module, imported)
        for module, imports in import_graph().items()
        if module.split(".")[0] in SERVICES
        for imported in imports
        if imported.split(".")[0] in SERVICES and imported.split(".")[0] != module.split(".")[0]
    )
    assert crossing == []


def test_services_and_shared_import_no_launcher():
    graph = import_graph()
    upward = sorted(
        (module, imported)
        for module, imports in graph.items()
        if module.split(".")[0] in (*SERVICES, "shared")
        for imported in imports
        if imported.split(".")[0] == "centerline"
    )
    assert upward == []


def test_shared_imports_no_service():
    upward = sorted(
        (module, imported)
        for module, imports in import_graph().items()
        if module.startswith("shared")
        for imported in imports
        if imported.split(".")[0] in PACKAGES
    )
    assert upward == []


def test_every_shared_module_has_two_users():
    single = {
        module: sorted(packages) for module, packages in shared_users(import_graph()).items() if len(packages) < 2
    }
    assert single == {}
