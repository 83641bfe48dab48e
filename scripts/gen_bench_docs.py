"""Write the docs' benchmark figures from the figure files in docs/bench/ and docs/runs/, or check them.

python scripts/gen_bench_docs.py          # rewrite the generated parts of README.md and docs/*.md
python scripts/gen_bench_docs.py --check  # exit 1 naming each stale part or figure file (run by make test)

Each part between ``<!-- bench:NAME begin ... -->`` and ``<!-- bench:NAME end -->``, in README.md or
any docs/*.md page (each NAME once), is rendered from ``docs/bench/NAME.json``: what ``centerline
bench <target> --out FILE`` wrote (its figures, ``command``, ``commit``, ``machine``). A file whose
``machine`` holds a ``note`` was measured on another machine and transcribed by hand; its part says
so. To refresh a part, run the bench with ``--out docs/bench/NAME.json``, then this script.

A figure quoted in prose, in README.md or docs/*.md, is one value of such a file, or of a run's
``RUN_DIR/figures.json`` kept as ``docs/runs/NAME.json`` (``centerline/runs/run_figures.py``):
``<!-- fig NAME PATH [FORMAT] -->0.70<!-- /fig -->``, PATH its keys (and list indices) joined by
dots, FORMAT a Python format spec (``.2f``, ``.2%``; default: three significant figures).

``--check`` also recomputes each figure file's ``digest`` (``centerline/runs/run_figures.py``): a file
edited by hand fails, named with the command that regenerates it. Files written before digests
are pinned by their bytes in ``LEGACY`` until they are regenerated.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"  # its pages, and the figure files they quote: bench/NAME.json, runs/NAME.json
sys.path.insert(0, str(ROOT))  # for scripts/bench_docs/: the page machinery and the renderers (its __init__.py)
from scripts.bench_docs.data_path import contract, long_sample, proxy, wire  # noqa: E402
from scripts.bench_docs.page import (  # noqa: E402
    FIG,
    PART,
    check_parts,
    figure_files,
    rel,
    render_figures,
    render_parts,
    stale_lines,
    verify,
)
from scripts.bench_docs.stack import pipeline, pipeline_before_in_flight, pipeline_sessions, sessions  # noqa: E402
from scripts.bench_docs.trainer import loss, step, weights  # noqa: E402

# part NAME -> its renderer, of docs/bench/NAME.json's figures (a new part: its renderer in
# scripts/bench_docs/, its line here)
RENDER = {
    "wire": wire,
    "weights": weights,
    "weights-smollm2": weights,  # the same bench at SmolLM2-135M-Instruct
    "contract": contract,
    "long-sample": long_sample,
    "loss": loss,
    "step": step,
    "step-32k": step,
    "proxy": proxy,
    "pipeline": pipeline,
    "pipeline-sessions": pipeline_sessions,
    "pipeline-weights": pipeline,  # in flight on each weight transport (--weight-transports)
    "pipeline-before-in-flight": pipeline_before_in_flight,
    "sessions": sessions,
}


LEGACY = {
    # Files written before figure files carried a digest (centerline/runs/run_figures.py), pinned by the
    # sha256 of their bytes: any edit fails the check. Regenerate one with its own "command" and drop
    # its line here.
    "docs/bench/pipeline-before-in-flight.json": "b65f1ffe2fd12b9fcbe4e7b30d8fdcd1dc7f921256fab16a8a3310f1b14406c1",
    "docs/bench/pipeline.json": "af890e07d8f8e0b9474cc1ae57d6a44bf8aa73e00ec5b8494be600173f649108",
    "docs/runs/make-run.json": "74c7a5e2eaa71ad6bafa11e2d59055485d2e395ab8e47b00db6eee3a0b2bea6d",
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a part or figure is stale; write nothing")
    parser.add_argument("--readme", type=Path, default=README, help="the front page (default: %(default)s)")
    parser.add_argument(
        "--docs",
        type=Path,
        default=DOCS,
        help="the pages (*.md) and their figure files, bench/ and runs/ (default: %(default)s)",
    )
    args = parser.parse_args()
    docs = args.docs.resolve()
    pages = [args.readme, *sorted(docs.glob("*.md"))]
    texts = {page: page.read_text() for page in pages}
    check_parts(texts, RENDER)
    files = {}  # page: (its text rewritten, stale parts, stale figures), for the pages with generated text
    for page, original in texts.items():
        if page == args.readme or PART.search(original) or FIG.search(original):
            text, parts = render_parts(original, docs, RENDER)
            text, figures = render_figures(text, docs)
            files[page] = (text, parts, figures)
    if args.check:
        stale = [line for path, (_, p, f) in files.items() for line in stale_lines(path, p, f, docs)]
        checked = figure_files(docs)
        stale += [problem for path in checked if (problem := verify(path, docs, LEGACY))]
        if stale:
            print("\n".join(stale), file=sys.stderr)
            return 1
        quoted = sum(len(FIG.findall(text)) for text, _, _ in files.values())
        where = ", ".join(path.name for path in files)
        pinned = sum(rel(path, docs) in LEGACY for path in checked)
        print(
            f"{args.readme.name}: the benchmark parts are current; the {quoted} figures quoted in {where} too; "
            f"{len(checked)} figure files unedited: {len(checked) - pinned} by their digest, {pinned} pinned in LEGACY"
        )
        return 0
    for path, (text, p, f) in files.items():
        path.write_text(text)
        if path == args.readme or p or f:
            print(f"wrote {path.name} ({len(p)} benchmark parts changed: {', '.join(p) or 'none'}; {len(f)} figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
