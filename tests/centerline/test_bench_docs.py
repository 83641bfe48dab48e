"""README's benchmark figures are generated from the figure files in docs/bench/ (scripts/gen_bench_docs.py)."""

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, "scripts/gen_bench_docs.py"]
FIG = re.compile(r"<!-- fig [\w-]+ [\w.-]+(?: \S+)? -->")


def gen(*argv):
    return subprocess.run([*SCRIPT, *argv], capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_readme_benchmark_figures_are_generated_from_the_figure_files():
    run = gen("--check")
    assert run.returncode == 0, run.stderr
    quoted = sum(len(FIG.findall(p.read_text())) for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    assert run.stdout == (
        f"README.md: the benchmark parts are current; the {quoted} figures quoted in README.md, design.md, sglang.md "
        "too\n"
    )
    readme = (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "docs" / "bench").glob("*.json")):
        assert f"<!-- bench:{path.stem} begin" in readme and f"<!-- bench:{path.stem} end -->" in readme


def test_figures_from_another_machine_are_marked_as_such():
    readme = (ROOT / "README.md").read_text()
    for path in sorted((ROOT / "docs" / "bench").glob("*.json")):
        machine = json.loads(path.read_text())["machine"]
        part = readme.split(f"<!-- bench:{path.stem} begin")[1].split(f"<!-- bench:{path.stem} end -->")[0]
        if "note" in machine:
            assert machine["note"].startswith("measured on another machine")
            assert machine["note"][1:] in part and "not regenerated here" in part
        else:
            assert f"on {machine['cpu_model']} ({machine['nproc']} CPUs, host `{machine['hostname']}`)" in part


def test_check_names_the_stale_part_and_writing_brings_it_back(tmp_path):
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    before, rest = text.split("<!-- bench:proxy begin", 1)
    head, tail = rest.split("-->\n", 1)
    readme.write_text(before + "<!-- bench:proxy begin" + head + "-->\n| an edited figure |\n" + tail)
    (tmp_path / "docs").mkdir()
    here = ("--readme", str(readme), "--docs", str(tmp_path / "docs"))
    run = gen("--check", *here)
    assert run.returncode == 1
    assert run.stderr == (
        "README.md: the benchmark part 'proxy' differs from docs/bench/proxy.json; "
        "run python scripts/gen_bench_docs.py\n"
    )
    written = gen(*here)
    assert written.returncode == 0, written.stderr
    assert written.stdout == "wrote README.md (1 benchmark parts changed: proxy; 0 figures)\n"
    assert readme.read_text() == text


def test_a_missing_part_is_named(tmp_path):
    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text()
    start = text.index("<!-- bench:loss begin")
    end = text.index("<!-- bench:loss end -->") + len("<!-- bench:loss end -->")
    readme.write_text(text[:start] + text[end:])
    run = gen("--check", "--readme", str(readme))
    assert run.returncode == 1
    assert "bench parts missing ['loss'], unknown []" in run.stderr


def test_a_figure_quoted_in_prose_is_checked_and_rewritten_from_its_file(tmp_path):
    readme, docs = tmp_path / "README.md", tmp_path / "docs"
    readme.write_text((ROOT / "README.md").read_text())
    docs.mkdir()
    figures = json.loads((ROOT / "docs" / "bench" / "sessions.json").read_text())
    requests = figures["single"]["requests"]
    quoted = (
        "<!-- fig sessions single.requests -->{}<!-- /fig --> single requests, a share of "
        "<!-- fig sessions policies.manual.cache_share_later_turns .1% -->{}<!-- /fig -->\n"
    )
    (docs / "notes.md").write_text(quoted.format(requests + 1, "1%"))
    (docs / "plain.md").write_text("no figures here\n")
    run = gen("--check", "--readme", str(readme), "--docs", str(docs))
    assert run.returncode == 1
    fix = "run python scripts/gen_bench_docs.py"
    assert run.stderr == (
        f"notes.md: the figure 'sessions single.requests' differs from docs/bench/sessions.json; {fix}\n"
        "notes.md: the figure 'sessions policies.manual.cache_share_later_turns' differs from "
        f"docs/bench/sessions.json; {fix}\n"
    )
    written = gen("--readme", str(readme), "--docs", str(docs))
    assert written.returncode == 0, written.stderr
    share = figures["policies"]["manual"]["cache_share_later_turns"]
    assert (docs / "notes.md").read_text() == quoted.format(requests, f"{share:.1%}")
    assert (docs / "plain.md").read_text() == "no figures here\n"
    assert gen("--check", "--readme", str(readme), "--docs", str(docs)).returncode == 0


def test_a_figure_naming_a_key_its_file_lacks_is_named(tmp_path):
    readme, docs = tmp_path / "README.md", tmp_path / "docs"
    readme.write_text((ROOT / "README.md").read_text())
    docs.mkdir()
    (docs / "notes.md").write_text("<!-- fig sessions policies.nope.tokens_per_s -->1<!-- /fig -->\n")
    run = gen("--check", "--readme", str(readme), "--docs", str(docs))
    assert run.returncode == 1
    assert (
        run.stderr == "<!-- fig sessions policies.nope.tokens_per_s -->: docs/bench/sessions.json has no 'nope' there\n"
    )
