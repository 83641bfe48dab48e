"""The run report: HTML with inlined plots and one PNG per plot, from metrics.jsonl and the held-out
record (heldout_metrics.jsonl, or an earlier release's eval.jsonl)."""

import base64
import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir: Path, steps: int) -> None:
    with open(run_dir / "metrics.jsonl", "wb") as fh:
        for step in range(1, steps + 1):
            record = {
                "step": step,
                "version": step,
                "reward_mean": 0.2 + 0.1 * step,
                "sc_correction": 0.01,
                "sc_train_head_mass": 0.9,
                "sc_rollout_head_mass": 0.91,
                "sc_tail_ratio": 1.1,
                "train_rollout_kl": 0.001 * step,
                "staleness_mean": 0.5,
                "staleness_max": 1,
                "gate_accepted": 4,
                "gate_rejected": {"short_row": 1} if step == 2 else {},
                "gate_duplicate": 0,
            }
            fh.write(orjson.dumps(record) + b"\n")


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in records))


def test_report_has_every_plot_inline_and_as_png(tmp_path):
    write_metrics(tmp_path, 3)
    write_jsonl(tmp_path / "heldout_metrics.jsonl", [{"step": s, "heldout_accuracy": 0.1 * s} for s in (0, 3)])
    (tmp_path / "config.toml").write_text('loss = "score_centering"\n')
    run = subprocess.run(
        [sys.executable, "-m", "centerline", "report", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    names = {"reward", "accuracy", "sc_correction", "head_mass", "tail_ratio", "kl", "staleness", "gate"}
    assert {p.stem for p in (tmp_path / "plots").glob("*.png")} == names
    assert all((tmp_path / "plots" / f"{n}.png").read_bytes().startswith(PNG_MAGIC) for n in names)
    page = (tmp_path / "report.html").read_text()
    inlined = page.count("src='data:image/png;base64,")
    assert inlined == len(names)
    first = page.split("src='data:image/png;base64,", 1)[1].split("'", 1)[0]
    assert base64.b64decode(first).startswith(PNG_MAGIC)
    assert "http://" not in page and "https://" not in page  # self-contained
    assert "reward_mean</td><td>0.3 → 0.5" in page
    assert "heldout_accuracy</td><td>0 → 0.3" in page
    assert "batches accepted / rejected</td><td>12 / 1" in page
    assert "loss = &quot;score_centering&quot;" in page


def test_report_on_a_directory_without_metrics_names_the_file(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "centerline", "report", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 2
    assert f"{tmp_path / 'metrics.jsonl'} does not exist" in run.stderr


def test_a_run_on_sessions_gets_the_sessions_plot_and_its_turns_tokens_and_finish_reasons(tmp_path):
    from centerline.runs.report import render_plots, summary

    steps = [
        {
            "step": 1,
            "version": 1,
            "samples": 4,
            "gate_accepted": 2,
            "turns_mean": 3.0,
            "sampled_tokens": 24,
            "injected_tokens": 120,
            "finish": {"stop": 3, "length": 1},
        },
        {
            "step": 2,
            "version": 2,
            "samples": 4,
            "gate_accepted": 2,
            "turns_mean": 2.0,
            "sampled_tokens": 16,
            "injected_tokens": 60,
            "finish": {"stop": 3, "session_budget": 1},
        },
    ]
    assert "sessions" in render_plots(steps)
    rows = dict(summary(steps))
    assert rows["turns per sample (sessions)"] == "2.5"
    assert rows["tokens sampled / injected"] == "40 / 180"
    assert rows["samples by finish reason"] == "length 1, session_budget 1, stop 6"
    plain = [{**s, "turns_mean": 1.0, "injected_tokens": 0} for s in steps]  # single-turn: no sessions plot
    assert "sessions" not in render_plots(plain) and "turns per sample (sessions)" not in dict(summary(plain))


def test_an_earlier_releases_eval_jsonl_is_read_with_its_keys_spelled_heldout(tmp_path):
    from centerline.runs.report import load_heldout

    old = {"step": 0, "eval_accuracy": 0.25, "eval_rows": 8, "version": 0, "eval_version_min": 0}
    write_jsonl(tmp_path / "eval.jsonl", [{**old, "eval_version_max": 1, "eval_s": 1.5}])
    assert load_heldout(tmp_path) == [
        {
            "step": 0,
            "heldout_accuracy": 0.25,
            "heldout_rows": 8,
            "version": 0,
            "heldout_version_min": 0,
            "heldout_version_max": 1,
            "heldout_s": 1.5,
        }
    ]


def test_a_run_resumed_by_this_release_has_its_eval_jsonl_rounds_before_those_of_heldout_metrics(tmp_path):
    from centerline.runs.report import load_heldout, load_steps, summary

    write_metrics(tmp_path, 4)
    write_jsonl(tmp_path / "eval.jsonl", [{"step": 0, "eval_reward": 0.25}, {"step": 2, "eval_reward": 0.5}])
    write_jsonl(tmp_path / "heldout_metrics.jsonl", [{"step": 4, "heldout_reward": 0.75}])
    assert [(r["step"], r["heldout_reward"]) for r in load_heldout(tmp_path)] == [(0, 0.25), (2, 0.5), (4, 0.75)]
    steps = load_steps(tmp_path)
    assert [(s["step"], s.get("heldout_reward")) for s in steps] == [
        (0, 0.25),
        (1, None),
        (2, 0.5),
        (3, None),
        (4, 0.75),
    ]
    assert dict(summary(steps))["heldout_reward"] == "0.25 → 0.75"


def test_an_earlier_releases_run_directory_gets_its_held_out_plot_and_row(tmp_path):
    write_metrics(tmp_path, 3)
    write_jsonl(tmp_path / "eval.jsonl", [{"step": 0, "eval_accuracy": 0.125}, {"step": 3, "eval_accuracy": 0.5}])
    run = subprocess.run(
        [sys.executable, "-m", "centerline", "report", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "plots" / "accuracy.png").read_bytes().startswith(PNG_MAGIC)
    assert "heldout_accuracy</td><td>0.125 → 0.5" in (tmp_path / "report.html").read_text()
