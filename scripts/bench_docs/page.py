"""A page's generated text and the figure files it is generated from (``scripts/gen_bench_docs.py``).

A part, ``<!-- bench:NAME begin ... -->`` ... ``<!-- bench:NAME end -->``, is rendered from
``docs/bench/NAME.json`` by its renderer (``RENDER`` in the script), followed by its provenance; a
quoted figure, ``<!-- fig NAME PATH [FORMAT] -->...<!-- /fig -->``, is one value of a figure file.
``verify`` is what ``--check`` asks of each figure file: its digest, or its pin in ``LEGACY``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

from centerline.runs.run_figures import digest  # the writer's own digest, recomputed here
from scripts.bench_docs.markdown import sig

Render = Callable[[dict], list[str]]  # a figure file's dict -> the lines of its part

FIG = re.compile(r"<!-- fig (?P<name>[\w-]+) (?P<path>[\w.-]+)(?: (?P<fmt>\S+))? -->(?P<text>[^<]*)<!-- /fig -->")

PART = re.compile(r"<!-- bench:(?P<name>[\w-]+) begin[^>]*-->\n(?P<body>.*?)<!-- bench:(?P=name) end -->", re.S)


def provenance(fig: dict) -> list[str]:
    """Where the figures come from: this kind of machine, or another one (a note)."""
    machine, command = fig["machine"], f"`{fig['command']}`"
    if "note" in machine:
        note = machine["note"]
        return ["", f"{note[:1].upper()}{note[1:]} ({command}); not regenerated here."]
    at = f" at commit `{fig['commit'][:12]}`" if fig.get("commit") else ""
    return [
        "",
        f"Measured by {command}{at} on {machine['cpu_model']} ({machine['nproc']} CPUs, host `{machine['hostname']}`), "
        f"{machine['measured_at']}.",
    ]


def rel(path: Path, docs: Path) -> str:
    """``path`` as the docs name it: relative to the folder holding ``docs``."""
    return path.relative_to(docs.parent).as_posix()


def verify(path: Path, docs: Path, legacy: dict[str, str]) -> str | None:
    """What is wrong with a figure file, None if nothing: its digest is what its writer computed
    (``run_figures.digest``), or, for a file written before digests, its bytes are those pinned in ``legacy``
    (``LEGACY`` in the script: path -> sha256)."""
    name, raw = rel(path, docs), path.read_bytes()
    doc = json.loads(raw)
    again = f"regenerate it with `{doc.get('command', '(no command recorded)')}`"
    if "digest" in doc:
        if doc["digest"] != digest(doc):
            return (
                f"{name}: its figures are not what its writer wrote (digest {doc['digest'][:12]} recorded, "
                f"{digest(doc)[:12]} computed): edited by hand? {again}"
            )
        missing = [key for key in ("command", "commit", "machine") if not doc.get(key)]
        if missing:
            return f"{name}: no {', '.join(missing)} recorded; {again}"
        if name in legacy:
            return f"{name}: carries its digest now; drop its line from LEGACY in scripts/gen_bench_docs.py"
        return None
    if name not in legacy:
        return f"{name}: no digest, so not written by centerline/runs/run_figures.py; {again}"
    if hashlib.sha256(raw).hexdigest() != legacy[name]:
        return f"{name}: edited since it was pinned in LEGACY (written before digests); {again}"
    return None


def figure_files(docs: Path) -> list[Path]:
    return sorted([*(docs / "bench").glob("*.json"), *(docs / "runs").glob("*.json")])


def render_part(name: str, docs: Path, render: dict[str, Render]) -> str:
    fig = json.loads((docs / "bench" / f"{name}.json").read_text())
    return "\n".join([*render[name](fig), *provenance(fig)]) + "\n"


def render_parts(text: str, docs: Path, render: dict[str, Render]) -> tuple[str, list[str]]:
    """``text`` with every benchmark part regenerated, and the names of the parts that changed."""
    stale = []

    def replace(m: re.Match) -> str:
        body = render_part(m["name"], docs, render)
        if body != m["body"]:
            stale.append(m["name"])
        return m[0][: m.start("body") - m.start()] + body + m[0][m.end("body") - m.start() :]

    return PART.sub(replace, text), stale


def check_parts(texts: dict[Path, str], render: dict[str, Render]) -> None:
    """Every part of ``render`` once, in one of the pages, and no other."""
    found = [m["name"] for text in texts.values() for m in PART.finditer(text)]
    missing = sorted(set(render) - set(found))
    unknown = sorted(set(found) - set(render))
    twice = sorted({n for n in found if found.count(n) > 1})
    if missing or unknown or twice:
        raise SystemExit(
            f"{', '.join(p.name for p in texts)}: bench parts missing {missing}, unknown {unknown}, twice {twice}; "
            f"expected one '<!-- bench:NAME begin -->' ... '<!-- bench:NAME end -->' for each of {sorted(render)}"
        )


def figure_file(name: str, docs: Path) -> Path:
    """``docs/bench/NAME.json`` (a bench's figures), else ``docs/runs/NAME.json`` (a run's)."""
    bench, run = docs / "bench" / f"{name}.json", docs / "runs" / f"{name}.json"
    return bench if bench.exists() or not run.exists() else run


def figure(name: str, path: str, fmt: str | None, docs: Path) -> str:
    """One value of ``docs/bench/NAME.json`` or ``docs/runs/NAME.json``, written as the prose quotes it."""
    file = figure_file(name, docs)
    value = json.loads(file.read_text())
    for key in path.split("."):
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError):
            raise SystemExit(f"<!-- fig {name} {path} -->: {rel(file, docs)} has no {key!r} there") from None
    if fmt:
        return format(value, fmt)
    return str(value) if isinstance(value, int) else sig(value)


def render_figures(text: str, docs: Path) -> tuple[str, list[str]]:
    """``text`` with every quoted figure rewritten, and the figures that changed."""
    stale = []

    def replace(m: re.Match) -> str:
        value = figure(m["name"], m["path"], m["fmt"], docs)
        if value != m["text"]:
            stale.append(f"{m['name']} {m['path']}")
        return m[0].replace(f"-->{m['text']}<!--", f"-->{value}<!--", 1)

    return FIG.sub(replace, text), stale


def stale_lines(path: Path, parts: list[str], figures: list[str], docs: Path) -> list[str]:
    """What ``--check`` says of one page's stale parts and figures."""
    fix = "run python scripts/gen_bench_docs.py"
    return [
        *(f"{path.name}: the benchmark part {n!r} differs from docs/bench/{n}.json; {fix}" for n in parts),
        *(
            f"{path.name}: the figure '{f}' differs from {rel(figure_file(f.split()[0], docs), docs)}; {fix}"
            for f in figures
        ),
    ]
