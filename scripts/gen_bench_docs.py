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
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"  # its pages, and the figure files they quote: bench/NAME.json, runs/NAME.json
sys.path.insert(0, str(ROOT))
from centerline.runs.run_figures import digest  # noqa: E402  (the writer's own digest, recomputed here)

FIG = re.compile(r"<!-- fig (?P<name>[\w-]+) (?P<path>[\w.-]+)(?: (?P<fmt>\S+))? -->(?P<text>[^<]*)<!-- /fig -->")
PART = re.compile(r"<!-- bench:(?P<name>[\w-]+) begin[^>]*-->\n(?P<body>.*?)<!-- bench:(?P=name) end -->", re.S)


def sig(x: float) -> str:
    """Three significant figures, thousands separated: 0.0661, 5.70, 36.5, 597, 1,212."""
    if x == 0:
        return "0"
    for bound, digits in ((100, 0), (10, 1), (1, 2), (0.1, 3)):
        if abs(x) >= bound:
            return f"{x:,.{digits}f}"
    return f"{x:.3g}"


def mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


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


def wire(fig: dict) -> list[str]:
    rows = [
        [
            f"{s['tokens']:,}",
            str(s["k"]),
            mb(s["message_bytes"]),
            f"{sig(s['encode_decode_gbps'])} GB/s ({sig(s['encode_decode_ms'])} ms)",
            f"{sig(s['memcpy_gbps'])} GB/s",
            f"{sig(s['ratio_to_memcpy'])}x",
            f"{sig(s['nested_list_msgpack_gbps'])} GB/s",
        ]
        for s in sorted([fig, *fig["sizes"]], key=lambda s: s["tokens"])
    ]
    header = ["tokens", "K", "message", "encode+decode", "memcpy, fresh buffer", "ratio", "nested-list msgpack"]
    return table(header, rows)


def contract(fig: dict) -> list[str]:
    header = ["tokens", "K", "batch", "selected mode", "rows/s", "MB/s", "support mode"]
    row = [
        f"{fig['tokens']:,}",
        str(fig["k"]),
        f"{sig(fig['batch_mb'])} MiB",
        f"{sig(fig['ms_per_batch'])} ms",
        f"{fig['rows_per_s']:,.0f}",
        f"{fig['mb_per_s']:,.0f}",
        f"{sig(fig['support_ms_per_batch'])} ms",
    ]
    return table(header, [row])


def loss(fig: dict) -> list[str]:
    header = ["N x V, K", "mode", "REINFORCE", "score centering", "peak: REINFORCE / score centering (extra)"]
    row = [
        f"{fig['tokens']:,} x {fig['vocab']:,}, {fig['k']}",
        f"{fig['mode']}, IS {fig['is_mode']}",
        f"{sig(fig['reinforce_ms'])} ms",
        f"{sig(fig['sc_ms'])} ms ({sig(fig['time_ratio'])}x)",
        f"{sig(fig['reinforce_peak_mb'])} / {sig(fig['sc_peak_mb'])} MiB ({sig(fig['extra_peak_mb'])} MiB)",
    ]
    lines = table(header, [row])
    if "autograd_reinforce_ms" in fig:
        lines += [
            "",
            f"The logits are {sig(fig['logits_mb'])} MiB; REINFORCE the obvious autograd way takes "
            f"{sig(fig['autograd_reinforce_ms'])} ms and peaks at {sig(fig['autograd_reinforce_peak_mb'])} MiB "
            f"({fig['threads']} torch threads).",
        ]
    return lines


SCANNERS = {"c": "C"}  # candidate_scan.SCANNER's names as the README writes them


def proxy(fig: dict) -> list[str]:
    header = [
        "tokens",
        "body",
        "parse",
        f"audit, {SCANNERS.get(fig['audit'][0]['scanner'], fig['audit'][0]['scanner'])} scanner",
        "audit, numpy scanner",
        "proxy + worker before",
        "after",
    ]
    rows = [
        [
            f"{r['tokens']:,}",
            mb(r["body_bytes"]),
            f"{sig(r['parse_ms'])} ms ({sig(r['parse_mb_per_s'])} MB/s)",
            f"{sig(r['after_audit_ms'])} ms, {sig(r['after_audit_to_parse_ratio'])}x parse "
            f"({sig(r['after_audit_mb_per_s'])} MB/s)",
            f"{sig(r['numpy_scanner_audit_ms'])} ms, {sig(r['numpy_scanner_audit_to_parse_ratio'])}x",
            f"{sig(r['before_cpu_ms_per_response'])} ms",
            f"{sig(r['after_cpu_ms_per_response'])} ms ({sig(r['cpu_after_to_before'])}x; worker "
            f"{sig(r['after_worker_ms'])} ms)",
        ]
        for r in fig["audit"]
    ]
    return table(header, rows)


def weights(fig: dict) -> list[str]:
    limit = fig["limit_s"]
    header = ["transport", "seconds a version, every engine (median)", "x limit", "proof s (every engine)"]
    rows = [
        [f"`{name}`", sig(t["seconds"]), f"{t['seconds'] / limit:,.1f}x", sig(t["prove_s"])]
        for name, t in fig["transports"].items()
    ]
    return [
        f"{fig['model']}, {mb(fig['version_bytes'])} a version, {fig['engines']} engines, {fig['versions']} versions "
        f"per transport, buckets of {fig['bucket_mb']} MiB; the limit, {sig(limit)} s: the version at this machine's "
        f"memcpy ({sig(fig['memcpy_gbps'])} GB/s) and once per engine over loopback TCP "
        f"({sig(fig['loopback_gbps'])} GB/s), measured in the same run.",
        "",
        *table(header, rows),
    ]


def pipeline(fig: dict) -> list[str]:
    header = [
        "mode",
        "samples/s (vs alone)",
        "weights_s mean (max)",
        "engine duty cycle",
        "trainer duty cycle",
        "gather s/step",
        "staleness per trained token: mean, max, share > 1",
        "labels untrue: teacher-forced (tokens)",
    ]
    rows = [
        [
            f"{mode} (`{m['weight_update']}`)",
            f"{m['pipeline_samples_per_s']:.2f} ({m['samples_per_s_ratio']:.3f}x)",
            f"{m['weights_s_mean']:.3f} ({m['weights_s_max']:.3f})",
            f"{m['duty_cycle']:.3f}",
            f"{m['trainer_duty_cycle']:.3f}",
            f"{m['pipeline_gather_s_mean']:.3f}",
            f"{m['token_staleness_mean']:.3g}, {m['token_staleness_max']}, {m['token_stale_share'] * 100:.2g} %",
            labels(m),
        ]
        for mode, m in fig["modes"].items()
    ]
    return [
        f"{fig['train_seconds']:g} s of training per mode, {fig['workers']} workers, {fig['trainer_ranks']} trainer "
        f"ranks, {fig['prompts_per_step']} prompts x {fig['rollout_n']} samples a step, K = "
        f"{fig['rollout_top_logprobs_num']}; SGLang alone at the same concurrency, in the same run: "
        f"{fig['sglang_alone_samples_per_s']:.2f} samples/s.",
        "",
        *table(header, rows),
    ]


def labels(m: dict) -> str:
    """The share of a mode's teacher-forced tokens whose recorded log-prob is not their label's
    (``bench pipeline --teacher-force``), or that it was not checked."""
    if "label_mismatch_share" not in m:
        return "not checked"
    return f"{m['label_mismatch_share'] * 100:.3g} % ({m['label_checked_tokens']:,})"


def pipeline_sessions(fig: dict) -> list[str]:
    """``pipeline`` of a run of sessions (``--task chain``): SGLang alone then got the sessions'
    first turns as single requests, which is no ceiling for sessions; it is named, not compared."""
    table_lines = pipeline(fig)[2:]
    return [
        f"Task `{fig['task']}` (sessions of 2-4 turns), {fig['train_seconds']:g} s of training per mode, "
        f"{fig['workers']} workers, {fig['prompts_per_step']} prompts x {fig['rollout_n']} sessions a step, K = "
        f"{fig['rollout_top_logprobs_num']}. The ratio to SGLang alone is to single first-turn requests "
        f"({fig['sglang_alone_samples_per_s']:.1f} samples/s), not a ceiling for sessions: read the modes "
        "against each other.",
        "",
        *table_lines,
    ]


def pipeline_before_in_flight(fig: dict) -> list[str]:
    modes = fig["modes"]
    on, dr = modes["on-policy"], modes["drain"]
    alone = f"{fig['sglang_alone_samples_per_s']:.1f} samples/s at {fig['concurrent_requests']} requests"

    def row(name, cell):
        return [name, cell(on), cell(dr)]

    rows = [
        row(f"steps in {fig['train_seconds']:g} s", lambda m: str(m["steps_done"])),
        row(
            "trained samples/s (tokens/s)",
            lambda m: (
                f"{m['pipeline_samples_per_s']:.1f} ({m['pipeline_tokens_per_s']:,.0f})"
                + ("" if m is on else f", {m['pipeline_samples_per_s'] / on['pipeline_samples_per_s']:.2f}x")
            ),
        ),
        row(f"vs SGLang alone ({alone})", lambda m: f"{m['samples_per_s_ratio']:.2f}x"),
        row(
            "step: waiting for batches / the rest",
            lambda m: (
                f"{m['pipeline_gather_s_mean']:.3f} s / {m['pipeline_step_s_mean'] - m['pipeline_gather_s_mean']:.3f} s"
            ),
        ),
        row(
            "step: training / checkpoint / weights into SGLang",
            lambda m: f"{m['pipeline_train_s_mean']:.3f} / {m['checkpoint_s_mean']:.3f} / {m['weights_s_mean']:.3f} s",
        ),
        row(
            "SGLang duty cycle (share of time it had work)",
            lambda m: (
                f"{m['duty_cycle']:.3f}" + ("" if m is on else f" (SGLang alone: {fig['sglang_alone_duty_cycle']:.3f})")
            ),
        ),
        row("trainer duty cycle (share of step time not waiting)", lambda m: f"{m['trainer_duty_cycle']:.3f}"),
        row("held-out accuracy before -> after", lambda m: f"{m['accuracy_before']:.3f} -> {m['accuracy_after']:.3f}"),
        row("staleness max", lambda m: str(m["staleness_max"])),
    ]
    lines = table(["", "on-policy", "async, draining updates"], rows)
    one = fig.get("one_forward_per_sample")
    if one:
        lines += [
            "",
            "With one forward per sample (before `--micro-batch-tokens`), the same bench measured a step's part "
            f"after the wait at {one['on-policy']['step_after_wait_s']:.2f} s on-policy and "
            f"{one['drain']['step_after_wait_s']:.2f} s async: {one['on-policy']['pipeline_samples_per_s']:.1f} and "
            f"{one['drain']['pipeline_samples_per_s']:.1f} samples/s, SGLang duty cycles "
            f"{one['on-policy']['duty_cycle']:.3f} and {one['drain']['duty_cycle']:.3f}.",
        ]
    return lines


WORKER_STAGES = ("endpoint", "history", "render", "tokenize", "reply")  # bench sessions' stages_ms in the worker


def sessions(fig: dict) -> list[str]:
    policies, single = fig["policies"], fig["single"]
    names = {"manual": "manual (affinity, default)"}

    def row(name, cell, single_cell=""):
        return [name, *(cell(p) for p in policies.values()), single_cell]

    rows = [
        row("turn / request, mean", lambda p: f"{p['turn_ms_mean']:.1f} ms", f"{single['request_ms_mean']:.1f} ms"),
        row(
            "later turns (2+), mean",
            lambda p: f"{p['later_turn_ms_mean']:.1f} ms" if "later_turn_ms_mean" in p else "",
        ),
        row("overhead per turn vs single", lambda p: f"{p['overhead_ms_per_turn']:.1f} ms"),
        *(
            [
                row(
                    "of a turn, the worker's: OpenAI client / endpoint to reply",
                    lambda p: (
                        f"{p['stages_ms']['client']:.1f} / {sum(p['stages_ms'][k] for k in WORKER_STAGES):.1f} ms"
                    ),
                )
            ]
            if all("stages_ms" in p for p in policies.values())
            else []
        ),
        row(
            "sampled tokens/s (ratio to single)",
            lambda p: f"{p['tokens_per_s']:.1f} ({p['tokens_per_s_ratio']:.2f}x)",
            f"{single['tokens_per_s']:.1f}",
        ),
        row(
            "prefix cache, turns 2+: of the prompt / of the history",
            lambda p: f"{p['cache_share_later_turns']:.2f} / {p['history_cache_share_later_turns']:.3g}",
            str(single["cached_tokens"]),
        ),
        row(
            "requests per engine",
            lambda p: " / ".join(map(str, p["requests_per_engine"])),
            " / ".join(map(str, single["requests_per_engine"])),
        ),
    ]
    header = ["", *(names.get(name, name) for name in policies), "single requests"]
    return [
        f"{fig['engines']} engines, {fig['sessions']} sessions x {fig['turns']} turns "
        f"({fig['user_tokens']}-letter user messages, `max_tokens` {fig['max_tokens']}, "
        f"{fig['concurrency']} sessions at a time, K = {fig['k']}):",
        "",
        *table(header, rows),
    ]


def step(fig: dict) -> list[str]:
    """``bench step``: peak memory of one training step per case, dense (f6a6570) and chunked."""
    header = [
        "tokens",
        "path",
        "dtype",
        "step peak",
        "forward+backward peak",
        "floor",
        "checkpointed activations",
        "forward+backward above floor",
        "step",
    ]
    rows = []
    for c in fig["cases"]:
        what = [f"{c['tokens']:,}", "dense logits (f6a6570)" if c["path"] == "dense" else "chunked head", c["dtype"]]
        if not c["run"]:
            rows.append([*what, f"not run: estimated {c['estimate_mb'] / 1024:.1f} GiB", "", "", "", "", ""])
            continue
        rows.append(
            [
                *what,
                f"{c['peak_mb'] / 1024:.2f} GiB",
                f"{c['backward_peak_mb'] / 1024:.2f} GiB",
                f"{c['floor_mb'] / 1024:.2f} GiB",
                f"{sig(c['checkpointed_mb'])} MiB",
                f"{sig(c['above_floor_mb'])} MiB",
                f"{sig(c['step_s'])} s",
            ]
        )
    return [
        f"{fig['layers']} decoder layers of hidden {fig['hidden']:,} (MLP {fig['intermediate']:,}), vocabulary "
        f"{fig['vocab']:,}, tied embeddings; one session of a {fig['prompt']}-token prompt and trained response "
        f"tokens, K = {fig['k']}; one LM-head chunk ({fig['chunk']:,} tokens) is {sig(fig['chunk_mb'])} MiB; "
        f"a case is run when its estimate is below {fig['max_gib']:g} GiB and the memory available.",
        "",
        *table(header, rows),
    ]


RENDER = {
    "wire": wire,
    "weights": weights,
    "weights-smollm2": weights,  # the same bench at SmolLM2-135M-Instruct
    "contract": contract,
    "loss": loss,
    "step": step,
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


def rel(path: Path, docs: Path) -> str:
    """``path`` as the docs name it: relative to the folder holding ``docs``."""
    return path.relative_to(docs.parent).as_posix()


def verify(path: Path, docs: Path) -> str | None:
    """What is wrong with a figure file, None if nothing: its digest is what its writer computed
    (``run_figures.digest``), or, for a file written before digests, its bytes are those pinned in ``LEGACY``."""
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
        if name in LEGACY:
            return f"{name}: carries its digest now; drop its line from LEGACY in scripts/gen_bench_docs.py"
        return None
    if name not in LEGACY:
        return f"{name}: no digest, so not written by centerline/runs/run_figures.py; {again}"
    if hashlib.sha256(raw).hexdigest() != LEGACY[name]:
        return f"{name}: edited since it was pinned in LEGACY (written before digests); {again}"
    return None


def figure_files(docs: Path) -> list[Path]:
    return sorted([*(docs / "bench").glob("*.json"), *(docs / "runs").glob("*.json")])


def render_part(name: str, docs: Path) -> str:
    fig = json.loads((docs / "bench" / f"{name}.json").read_text())
    return "\n".join([*RENDER[name](fig), *provenance(fig)]) + "\n"


def render_parts(text: str, docs: Path) -> tuple[str, list[str]]:
    """``text`` with every benchmark part regenerated, and the names of the parts that changed."""
    stale = []

    def replace(m: re.Match) -> str:
        body = render_part(m["name"], docs)
        if body != m["body"]:
            stale.append(m["name"])
        return m[0][: m.start("body") - m.start()] + body + m[0][m.end("body") - m.start() :]

    return PART.sub(replace, text), stale


def check_parts(texts: dict[Path, str]) -> None:
    """Every part of ``RENDER`` once, in one of the pages, and no other."""
    found = [m["name"] for text in texts.values() for m in PART.finditer(text)]
    missing = sorted(set(RENDER) - set(found))
    unknown = sorted(set(found) - set(RENDER))
    twice = sorted({n for n in found if found.count(n) > 1})
    if missing or unknown or twice:
        raise SystemExit(
            f"{', '.join(p.name for p in texts)}: bench parts missing {missing}, unknown {unknown}, twice {twice}; "
            f"expected one '<!-- bench:NAME begin -->' ... '<!-- bench:NAME end -->' for each of {sorted(RENDER)}"
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
    check_parts(texts)
    files = {}  # page: (its text rewritten, stale parts, stale figures), for the pages with generated text
    for page, original in texts.items():
        if page == args.readme or PART.search(original) or FIG.search(original):
            text, parts = render_parts(original, docs)
            text, figures = render_figures(text, docs)
            files[page] = (text, parts, figures)
    if args.check:
        stale = [line for path, (_, p, f) in files.items() for line in stale_lines(path, p, f, docs)]
        checked = figure_files(docs)
        stale += [problem for path in checked if (problem := verify(path, docs))]
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
