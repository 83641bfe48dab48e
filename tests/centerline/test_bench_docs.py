"""The docs' benchmark figures are generated from the figure files in docs/bench/ and docs/runs/, and
those files are as their writers wrote them (scripts/gen_bench_docs.py, centerline/runs/run_figures.py)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from centerline.runs.run_figures import digest, stamped

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, "scripts/gen_bench_docs.py"]
FIG = re.compile(r"<!-- fig [\w-]+ [\w.-]+(?: \S+)? -->")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIX = "run python scripts/gen_bench_docs.py"


def gen(*argv):
    return subprocess.run([*SCRIPT, *argv], capture_output=True, text=True, cwd=ROOT, timeout=60)


def site(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of README.md and docs/ (its pages and figure files) to edit: (readme, docs)."""
    readme, docs = tmp_path / "README.md", tmp_path / "docs"
    readme.write_text((ROOT / "README.md").read_text())
    shutil.copytree(ROOT / "docs", docs, ignore=shutil.ignore_patterns("img"))
    return readme, docs


def on(readme: Path, docs: Path) -> tuple[str, ...]:
    return ("--readme", str(readme), "--docs", str(docs))


def test_the_docs_benchmark_figures_are_generated_from_the_figure_files():
    run = gen("--check")
    assert run.returncode == 0, run.stderr
    quoted = sum(len(FIG.findall(p.read_text())) for p in PAGES)
    where = ", ".join(
        p.name for p in PAGES if p.name == "README.md" or FIG.search(p.read_text()) or "<!-- bench:" in p.read_text()
    )
    files = sorted([*(ROOT / "docs" / "bench").glob("*.json"), *(ROOT / "docs" / "runs").glob("*.json")])
    digested = sum("digest" in json.loads(f.read_text()) for f in files)
    assert run.stdout == (
        f"README.md: the benchmark parts are current; the {quoted} figures quoted in {where} too; "
        f"{len(files)} figure files unedited: {digested} by their digest, {len(files) - digested} pinned in LEGACY\n"
    )
    text = "".join(p.read_text() for p in PAGES)
    for path in sorted((ROOT / "docs" / "bench").glob("*.json")):  # each rendered as a part, or quoted in prose
        parts = (text.count(f"<!-- bench:{path.stem} begin"), text.count(f"<!-- bench:{path.stem} end -->"))
        assert parts == (1, 1) or (parts == (0, 0) and f"<!-- fig {path.stem} " in text), path.name


def part(name: str) -> str:
    text = "".join(p.read_text() for p in PAGES)
    return text.split(f"<!-- bench:{name} begin")[1].split(f"<!-- bench:{name} end -->")[0]


def test_figures_from_another_machine_are_marked_as_such():
    text = "".join(p.read_text() for p in PAGES)
    for path in sorted((ROOT / "docs" / "bench").glob("*.json")):
        if f"<!-- bench:{path.stem} begin" not in text:
            continue  # quoted in prose only: its figures carry no part to mark
        fig = json.loads(path.read_text())
        machine = fig["machine"]
        if "note" in machine:
            assert machine["note"].startswith("measured on another machine")
            assert machine["note"][1:] in part(path.stem) and "not regenerated here" in part(path.stem)
        else:
            at = f" at commit `{fig['commit'][:12]}`" if fig.get("commit") else ""
            assert f"{at} on {machine['cpu_model']} ({machine['nproc']} CPUs, host `{machine['hostname']}`)" in part(
                path.stem
            )


def test_check_names_the_stale_part_and_writing_brings_it_back(tmp_path):
    readme, docs = site(tmp_path)
    page = next(p for p in [readme, *sorted(docs.glob("*.md"))] if "<!-- bench:proxy begin" in p.read_text())
    text = page.read_text()
    before, rest = text.split("<!-- bench:proxy begin", 1)
    head, tail = rest.split("-->\n", 1)
    page.write_text(before + "<!-- bench:proxy begin" + head + "-->\n| an edited figure |\n" + tail)
    run = gen("--check", *on(readme, docs))
    assert run.returncode == 1
    assert run.stderr == f"{page.name}: the benchmark part 'proxy' differs from docs/bench/proxy.json; {FIX}\n"
    written = gen(*on(readme, docs))
    assert written.returncode == 0, written.stderr
    assert f"wrote {page.name} (1 benchmark parts changed: proxy; 0 figures)\n" in written.stdout
    assert page.read_text() == text


def test_a_missing_part_is_named(tmp_path):
    readme, docs = site(tmp_path)
    for page in [readme, *docs.glob("*.md")]:
        text = page.read_text()
        if "<!-- bench:loss begin" in text:
            start = text.index("<!-- bench:loss begin")
            end = text.index("<!-- bench:loss end -->") + len("<!-- bench:loss end -->")
            page.write_text(text[:start] + text[end:])
    run = gen("--check", *on(readme, docs))
    assert run.returncode == 1
    assert "bench parts missing ['loss'], unknown [], twice []" in run.stderr


def test_a_part_in_two_pages_is_named(tmp_path):
    readme, docs = site(tmp_path)
    (docs / "again.md").write_text("<!-- bench:wire begin -->\n<!-- bench:wire end -->\n")
    run = gen("--check", *on(readme, docs))
    assert run.returncode == 1
    assert "bench parts missing [], unknown [], twice ['wire']" in run.stderr


def test_a_figure_quoted_in_prose_is_checked_and_rewritten_from_its_file(tmp_path):
    readme, docs = site(tmp_path)
    figures = json.loads((docs / "bench" / "sessions.json").read_text())
    requests = figures["single"]["requests"]
    quoted = (
        "<!-- fig sessions single.requests -->{}<!-- /fig --> single requests, a share of "
        "<!-- fig sessions policies.manual.cache_share_later_turns .1% -->{}<!-- /fig -->\n"
    )
    (docs / "notes.md").write_text(quoted.format(requests + 1, "1%"))
    (docs / "plain.md").write_text("no figures here\n")
    run = gen("--check", *on(readme, docs))
    assert run.returncode == 1
    assert run.stderr == (
        f"notes.md: the figure 'sessions single.requests' differs from docs/bench/sessions.json; {FIX}\n"
        "notes.md: the figure 'sessions policies.manual.cache_share_later_turns' differs from "
        f"docs/bench/sessions.json; {FIX}\n"
    )
    written = gen(*on(readme, docs))
    assert written.returncode == 0, written.stderr
    share = figures["policies"]["manual"]["cache_share_later_turns"]
    assert (docs / "notes.md").read_text() == quoted.format(requests, f"{share:.1%}")
    assert (docs / "plain.md").read_text() == "no figures here\n"
    assert gen("--check", *on(readme, docs)).returncode == 0


def test_a_figure_naming_a_key_its_file_lacks_is_named(tmp_path):
    readme, docs = site(tmp_path)
    (docs / "notes.md").write_text("<!-- fig sessions policies.nope.tokens_per_s -->1<!-- /fig -->\n")
    run = gen("--check", *on(readme, docs))
    assert run.returncode == 1
    assert (
        run.stderr == "<!-- fig sessions policies.nope.tokens_per_s -->: docs/bench/sessions.json has no 'nope' there\n"
    )


def edit_by_hand(path: Path) -> dict:
    """``path``'s first number among its figures raised by one, as someone would type it."""
    doc = json.loads(path.read_text())
    key = next(k for k, v in doc.items() if isinstance(v, int | float) and not isinstance(v, bool))
    doc[key] += 1
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def test_a_bench_file_edited_by_hand_fails_the_check_naming_it_and_its_command(tmp_path):
    readme, docs = site(tmp_path)
    doc = edit_by_hand(docs / "bench" / "wire.json")
    gen(*on(readme, docs))  # the pages brought in line with the edited file: only the file itself is wrong
    run = gen("--check", *on(readme, docs))
    assert run.returncode == 1
    if "digest" in doc:
        assert run.stderr.startswith(
            f"docs/bench/wire.json: its figures are not what its writer wrote (digest {doc['digest'][:12]} "
        )
        assert run.stderr.endswith(f"edited by hand? regenerate it with `{doc['command']}`\n")
    else:
        assert run.stderr == (
            "docs/bench/wire.json: edited since it was pinned in LEGACY (written before digests); "
            f"regenerate it with `{doc['command']}`\n"
        )


def test_a_stamped_file_passes_and_its_hand_edit_fails(tmp_path):
    readme, docs = site(tmp_path)
    legacy = json.loads((docs / "bench" / "contract.json").read_text())
    figures = {k: v for k, v in legacy.items() if k not in ("command", "commit", "machine", "digest")}
    (docs / "bench" / "contract.json").write_text(json.dumps(stamped(figures, "centerline bench contract"), indent=2))
    script = (ROOT / "scripts" / "gen_bench_docs.py").read_text()
    # the copy of the script run here has contract.json's pin dropped, as its regeneration would
    pins = [line for line in script.splitlines() if '"docs/bench/contract.json"' in line]  # none once regenerated
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "gen_bench_docs.py").write_text(
        script.replace("".join(line + "\n" for line in pins), "").replace(
            "ROOT = Path(__file__).resolve().parents[1]", f"ROOT = Path({str(ROOT)!r})"
        )
    )
    local = [sys.executable, str(tmp_path / "scripts" / "gen_bench_docs.py")]
    assert subprocess.run([*local, *on(readme, docs)], capture_output=True, text=True).returncode == 0
    run = subprocess.run([*local, "--check", *on(readme, docs)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    doc = edit_by_hand(docs / "bench" / "contract.json")
    subprocess.run([*local, *on(readme, docs)], capture_output=True, text=True)
    run = subprocess.run([*local, "--check", *on(readme, docs)], capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stderr == (
        f"docs/bench/contract.json: its figures are not what its writer wrote (digest {doc['digest'][:12]} recorded, "
        f"{digest(doc)[:12]} computed): edited by hand? regenerate it with `centerline bench contract`\n"
    )


def test_a_file_without_a_digest_or_a_pin_is_named(tmp_path):
    readme, docs = site(tmp_path)
    (docs / "runs" / "typed.json").write_text('{"steps": 3, "command": "centerline up --steps 3"}\n')
    run = gen("--check", *on(readme, docs))
    assert run.returncode == 1
    assert run.stderr == (
        "docs/runs/typed.json: no digest, so not written by centerline/runs/run_figures.py; "
        "regenerate it with `centerline up --steps 3`\n"
    )


def test_a_regenerated_file_still_pinned_asks_for_its_pin_to_go(tmp_path):
    readme, docs = site(tmp_path)
    name = "pipeline-before-in-flight"  # transcribed by hand from a bench of before: pinned for good
    legacy = json.loads((docs / "bench" / f"{name}.json").read_text())
    figures = {k: v for k, v in legacy.items() if k not in ("command", "commit", "machine", "digest")}
    (docs / "bench" / f"{name}.json").write_text(json.dumps(stamped(figures, "centerline bench pipeline"), indent=2))
    gen(*on(readme, docs))
    run = gen("--check", *on(readme, docs))
    assert run.returncode == 1
    assert run.stderr == (
        f"docs/bench/{name}.json: carries its digest now; drop its line from LEGACY in scripts/gen_bench_docs.py\n"
    )
