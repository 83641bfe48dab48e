"""The reliability table ("| fault | guarantee | test |", in the README or a page of docs/) says
`-m slow` selects its tests: every test file a row names exists and holds a test marked slow,
by its own decorator or its module's ``pytestmark``. Read from the source, nothing imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADER = "| fault | guarantee | test |"


def fault_table() -> list[tuple[str, str]]:
    """(fault, test file) for each row of the table, wherever it lives."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    (page,) = [p for p in pages if HEADER in p.read_text()]
    lines = page.read_text().split(HEADER, 1)[1].splitlines()[2:]  # past the header's rule
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        fault, *_, test = [cell.strip() for cell in line.strip("|").split("|")]
        rows += [(fault, path) for path in re.findall(r"`(tests/[\w/]+\.py)`", test)]
    return rows


def marks_slow(decorators: list[ast.expr]) -> bool:
    return any("mark.slow" in ast.unparse(d) for d in decorators)


def slow_tests(path: Path) -> list[str]:
    """The test functions of ``path`` that `-m slow` selects."""
    tree = ast.parse(path.read_text())
    module_slow = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and "mark.slow" in ast.unparse(node.value)
        for node in tree.body
    )
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
        and (module_slow or marks_slow(node.decorator_list))
    ]


def test_the_fault_table_names_test_files_that_exist():
    rows = fault_table()
    assert len(rows) >= 10
    assert [path for _, path in rows if not (ROOT / path).is_file()] == []


def test_every_row_of_the_fault_table_has_a_test_that_minus_m_slow_selects():
    assert [(fault, path) for fault, path in fault_table() if not slow_tests(ROOT / path)] == []


def test_a_test_marked_slow_by_decorator_or_module_is_found(tmp_path):
    module = tmp_path / "test_m.py"
    module.write_text("import pytest\n\n@pytest.mark.slow\ndef test_a():\n    pass\n\ndef test_b():\n    pass\n")
    assert slow_tests(module) == ["test_a"]
    module.write_text(
        "import pytest\npytestmark = [pytest.mark.integration, pytest.mark.slow]\ndef test_b():\n    pass\n"
    )
    assert slow_tests(module) == ["test_b"]
    module.write_text("import pytest\npytestmark = pytest.mark.integration\ndef test_b():\n    pass\n")
    assert slow_tests(module) == []
