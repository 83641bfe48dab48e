"""The layout shows the architecture (docs/design.md, section 1): no service imports another, and
``shared/`` holds only what two or more of the packages agree on.

The import graph is read with ``ast`` from every module of the four packages; tests, scripts and
fuzz harnesses are not users. A shared module imported by another shared module counts for that
module's users too (``shared/wire.py`` is used by the proxy through ``shared/response_arrays.py``).
The same holds name by name: every public function, class and constant of ``shared/`` has two
users, directly or through another name of ``shared/``, but for the few ``ONE_USER_NAMES`` says why.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVICES = ("rollout_worker", "router_proxy", "trainer_service")
PACKAGES = (*SERVICES, "centerline")


def module_of(name: str) -> str | None:
    """The module of this repository that the dotted ``name`` is or lies in (``centerline.up.run_spec`` for
    ``centerline.up.run_spec.RunSpec``; a package's ``__init__.py`` is the package), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        path = REPO.joinpath(*parts[:end])
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts[:end])
    return None


def module_name(path: Path) -> str:
    """``centerline.up.prepare`` for ``centerline/up/prepare.py``, ``centerline.up`` for its ``__init__.py``."""
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """The modules of this repository that ``source``, the text of ``module`` (a package's
    ``__init__.py`` where ``is_package``), imports anywhere in it (inside a function, under
    ``TYPE_CHECKING``): for ``from package import name``, the submodule ``name`` where it is one,
    else ``package`` itself."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source, module)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: ``level - 1`` packages up from this module's own
                here = package.split(".")
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {module for module in map(module_of, names) if module is not None}
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of the four packages and ``shared/`` (subpackages' modules one by one) -> the modules
    of this repository it imports."""
    graph = {}
    for package in (*PACKAGES, "shared"):
        for path in sorted((REPO / package).rglob("*.py")):
            module = module_name(path)
            graph.setdefault(module, set()).update(imported_modules(path.read_text(), module, path.stem == "__init__"))
    return graph


def shared_users(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module of ``shared/`` -> the packages that import it, directly or through shared modules."""
    users = {module: set() for module in graph if module.startswith("shared.")}
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


# Public names of shared/ that one package uses, on purpose (module, name): why.
ONE_USER_NAMES = {
    ("contract", "RULES"): "the contract's rule names, which audit events and dead letters carry; the proxy extends it",
    (
        "response_arrays",
        "encode",
    ): "the proxy's half of the binary answer; the worker decodes it (one format, one file)",
    ("pieces", "cut"): "the worker's half of the pieces of a part; the gate parses them (one format, one file)",
    ("pieces", "parse"): "the gate's half of the pieces of a part; the worker cuts them (one format, one file)",
    ("config", "main"): "`centerline config` prints the resolution as every command sees it (config's own _build)",
    ("batch_algebra", "concat_batches"): "the trainer's step batch; batch algebra is one module, the worker selects",
    ("batch_algebra", "assign_shards"): "the trainer's shards; batch algebra is one module, the worker selects",
    ("settings", "LOSS_NAMES"): "the losses beside their type, one place; the trainer has them by LossSettings",
    ("settings", "IMPORTANCE_WEIGHTS"): "as LOSS_NAMES: the experiment's grid and the loss bench list them",
}


def top_level_names(tree: ast.Module) -> dict[str, ast.stmt]:
    """The functions, classes and assigned names at a module's top level."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        found[name.id] = node
    return found


def shared_names_used(node: ast.AST, aliases: dict[str, str] | None = None) -> set[tuple[str, str]]:
    """``(module, name)`` of ``shared/`` that ``node`` imports or reads as ``module.name``; ``aliases``, the
    shared modules' local names around ``node``, takes those imported in it."""
    used, aliases = set(), {} if aliases is None else aliases
    for item in ast.walk(node):
        if isinstance(item, ast.ImportFrom) and (item.module or "").startswith("shared."):
            used |= {(item.module.split(".")[1], alias.name) for alias in item.names}
        elif isinstance(item, ast.ImportFrom) and item.module == "shared":
            aliases |= {alias.asname or alias.name: alias.name for alias in item.names}
        elif isinstance(item, ast.Import):
            aliases |= {
                alias.asname or alias.name: alias.name.split(".")[1]
                for alias in item.names
                if alias.name.startswith("shared.")
            }
    for item in ast.walk(node):
        if isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id in aliases:
            used.add((aliases[item.value.id], item.attr))
        elif isinstance(item, ast.Constant) and isinstance(item.value, str) and item.value.startswith("shared."):
            module, _, name = item.value.removeprefix("shared.").partition(":")  # a "module:function" target
            used.add((module, name))
    return used


def test_every_public_name_of_shared_has_two_users():
    """A function, class or constant of ``shared/`` is used by two of the packages (tests, scripts and
    fuzz harnesses are none), directly or through another name of ``shared/`` that is. A name one
    module of ``shared/`` imports from another is the other's to its users (``shared.config.Config`` is
    ``shared.settings.Config``)."""
    defs, refers, moved = {}, {}, {}
    for path in sorted((REPO / "shared").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = top_level_names(tree)
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shared."):
                moved |= {(path.stem, a.asname or a.name): (node.module.split(".")[1], a.name) for a in node.names}
        aliases: dict[str, str] = {}
        imported = shared_names_used(tree, aliases)
        for name, node in names.items():
            read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            defs[(path.stem, name)] = node
            refers[(path.stem, name)] = (
                {(path.stem, n) for n in read & names.keys() - {name}}
                | {key for key in imported if key[1] in read}
                | shared_names_used(node, dict(aliases))
            )
    users = {key: set() for key in defs}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            for key in shared_names_used(ast.parse(path.read_text())):
                while key in moved:
                    key = moved[key]
                if key in users:
                    users[key].add(package)
    changed = True
    while changed:  # a name's users include those of every name of shared/ that reads it
        changed = False
        for key, read in refers.items():
            for other in read & users.keys():
                if not users[key] <= users[other]:
                    users[other] |= users[key]
                    changed = True
    single = {
        f"{module}.{name}": sorted(users[(module, name)])
        for module, name in defs
        if not name.startswith("_") and len(users[(module, name)]) < 2 and (module, name) not in ONE_USER_NAMES
    }
    assert single == {}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``, each as the modules around it (the first repeated last)."""
    cycles, done, path = [], set(), []

    def visit(module: str) -> None:
        path.append(module)
        for imported in sorted(graph.get(module, ())):
            if imported in path:
                cycles.append(path[path.index(imported) :] + [imported])
            elif imported not in done and imported in graph:
                visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        if module not in done:
            visit(module)
    return cycles


def test_no_import_cycle_anywhere():
    """A module never imports, even lazily inside a function or only for type checking, one that
    imports it back: each module reads only from those below it. Modules inside a subpackage
    (``centerline/up/``) count one by one."""
    assert import_cycles(import_graph()) == []


def test_the_import_graph_sees_type_checking_lazy_and_relative_imports_of_submodules():
    source = """
import typing
if typing.TYPE_CHECKING:
    from centerline.up.prepare import Prepared
def later():
    from centerline.up import run_spec
from . import console
from .. import cli
import orjson
"""
    expected = {"centerline.up.prepare", "centerline.up.run_spec", "centerline.up.console", "centerline.cli"}
    assert imported_modules(source, "centerline.up.launcher") == expected
    assert import_cycles({"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


# Modules stay a screenful or two (../shared/STYLE.md: well under 400 lines); these are longer, and say why.
MAX_LINES = 400
LONG_MODULES = {
    "shared/contract.py": "the completeness contract, one check per named rule, in one file (docs/design.md section 4)",
    "trainer_service/gate.py": "the gate's NATS side: fetch, hold, settle, dead-letter; the decision is admission.py",
}


def source_lines() -> dict[str, int]:
    roots = [*(REPO / p for p in (*PACKAGES, "shared")), REPO / "scripts"]
    return {
        str(path.relative_to(REPO)): len(path.read_text().splitlines()) for root in roots for path in root.rglob("*.py")
    }


def test_modules_are_under_400_lines_or_say_why():
    lines = source_lines()
    long = {path: n for path, n in lines.items() if n > MAX_LINES}
    assert sorted(set(long) - set(LONG_MODULES)) == [], f"over {MAX_LINES} lines: {long}; split it or say why here"
    assert sorted(path for path in LONG_MODULES if lines.get(path, 0) <= MAX_LINES) == [], "no longer long: drop it"
