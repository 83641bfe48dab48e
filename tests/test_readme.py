"""README.md is the front door: short, every page of docs/ reachable from it, its example files real."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(((?:docs/|deploy/)?[\w./-]*\.md)?(?:#([\w-]+))?\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_the_readme_is_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_every_page_of_docs_is_linked_from_the_readme():
    linked = {m[1] for m in LINK.finditer(README.read_text()) if m[1]}
    assert {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} <= linked


def test_every_link_between_the_pages_reaches_a_page_and_heading_that_exist():
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for m in LINK.finditer(page.read_text()):
            target = (
                ROOT / m[1] if m[1] and m[1].startswith(("docs/", "deploy/")) else page.parent / (m[1] or page.name)
            )
            assert target.exists(), f"{page.name}: {m[0]}"
            assert not m[2] or m[2] in anchors(target), f"{page.name}: {m[0]} has no heading {m[2]!r}"


def test_the_readme_quotes_the_example_files_it_runs():
    readme = README.read_text()
    assert "--dataset examples/capitals.jsonl --reward examples.rewards:contains_answer" in readme
    assert (ROOT / "examples" / "capitals.jsonl").read_text() in re.sub(r"\n  ", "\n", readme)
    function = (ROOT / "examples" / "rewards.py").read_text().split("\n\n\n", 1)[1]
    assert function.replace("\n", "\n  ") in readme
