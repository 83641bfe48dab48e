"""The console script: every listed command resolves, and the foundation benchmarks print one JSON object."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from centerline.bench import BENCHES
from centerline.cli import COMMANDS, resolve
from centerline.runs.run_figures import digest

ROOT = Path(__file__).resolve().parents[1]


def centerline(*argv, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "centerline", *map(str, argv)], capture_output=True, text=True, cwd=ROOT, timeout=timeout
    )


@pytest.mark.parametrize("table", [COMMANDS, BENCHES])
def test_every_listed_command_resolves_to_a_main(table):
    for name, (target, _) in table.items():
        assert callable(resolve(target)), name


def test_help_lists_the_commands_and_unknown_ones_fail():
    run = centerline("--help")
    assert run.returncode == 0
    assert all(f"  {name} " in run.stdout for name in COMMANDS)
    bad = centerline("frobnicate")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr


def assert_written_with_machine(out: Path, printed: dict) -> None:
    """The figure file holds what the bench printed, the command, the commit, where and when it was measured,
    and the digest of it all."""
    written = json.loads(out.read_text())
    assert written.pop("digest") == digest(written)  # centerline/runs/run_figures.py: what the docs check recomputes
    machine, command, commit = written.pop("machine"), written.pop("command"), written.pop("commit")
    assert written == printed and command.startswith("centerline bench ") and "--out" in command
    assert len(commit) == 40
    assert set(machine) == {"hostname", "cpu_model", "nproc", "measured_at"}
    assert machine["nproc"] >= 1 and machine["measured_at"].endswith("Z")


@pytest.mark.integration  # the bench in a new interpreter
def test_bench_wire_prints_one_json_object_with_its_baselines(tmp_path):
    out = tmp_path / "wire.json"
    run = centerline("bench", "wire", "--json", "--tokens", "512", "--repeats", "3", "--sizes", "128", "--out", out)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert_written_with_machine(out, result)
    assert result["tokens"] == 512 and result["k"] == 128 and [s["tokens"] for s in result["sizes"]] == [128]
    assert {"encode_decode_gbps", "memcpy_gbps", "ratio_to_memcpy", "nested_list_msgpack_gbps"} <= set(result)
    assert result["encode_decode_gbps"] > result["nested_list_msgpack_gbps"] > 0


@pytest.mark.integration  # the bench in a new interpreter
def test_bench_contract_prints_one_json_object(tmp_path):
    out = tmp_path / "contract.json"
    run = centerline("bench", "contract", "--json", "--tokens", "512", "--repeats", "3", "--out", out)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert_written_with_machine(out, result)
    assert result["tokens"] == 512 and {"rows_per_s", "ms_per_batch", "mb_per_s"} <= set(result)


@pytest.mark.integration  # the bench in a new interpreter
def test_bench_proxy_audit_table_has_before_and_after_per_size(tmp_path):
    out = tmp_path / "proxy.json"
    argv = ("bench", "proxy", "--json", "--audit-only", "--audit-tokens", "8,32", "--repeats", "2", "--out", out)
    run = centerline(*argv)
    assert run.returncode == 0, run.stderr
    rows = json.loads(run.stdout)["audit"]
    assert_written_with_machine(out, {"audit": rows})
    assert [(r["tokens"], r["k"]) for r in rows] == [(8, 128), (32, 128)]
    for row in rows:
        for when in ("before", "after"):
            assert row[f"{when}_cpu_ms_per_response"] == pytest.approx(
                row[f"{when}_proxy_ms"] + row[f"{when}_worker_ms"], abs=2e-3
            )
            assert row[f"{when}_audit_mb_per_s"] > 0
        assert row["parse_ms"] > 0 and row["cpu_after_to_before"] > 0
        assert row["scanner"] == "c" and row["numpy_scanner_audit_ms"] > 0
        assert row["before_proxy_ms"] == row["before_audit_ms"] and row["reply_bytes"] > 0  # after: + the encode


@pytest.mark.integration  # the bench in a new interpreter
def test_bench_loss_prints_time_and_peak_memory_of_both_losses(tmp_path):
    out = tmp_path / "loss.json"
    argv = ("bench", "loss", "--json", "--tokens", "64", "--vocab", "512", "--k", "16", "--repeats", "2", "--out", out)
    run = centerline(*argv)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert_written_with_machine(out, result)
    assert {k: result[k] for k in ("tokens", "vocab", "k", "mode", "is_mode")} == {
        "tokens": 64,
        "vocab": 512,
        "k": 16,
        "mode": "selected",
        "is_mode": "none",
    }
    assert result["logits_mb"] == 64 * 512 * 4 / 2**20
    assert result["reinforce_ms"] > 0 and result["sc_ms"] > 0 and result["autograd_reinforce_ms"] > 0
    assert result["extra_peak_mb"] == result["sc_peak_mb"] - result["reinforce_peak_mb"]
    assert result["autograd_reinforce_peak_mb"] > result["logits_mb"]  # it materialises log_softmax [N, V]


def test_bench_refuses_an_out_path_it_cannot_write_before_measuring(tmp_path):
    run = centerline("bench", "contract", "--out", tmp_path)
    assert run.returncode == 2 and run.stdout == ""
    assert f"argument --out: {tmp_path}: not a writable file path; pick a writable path" in run.stderr
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    run = centerline("bench", "wire", "--out", blocked / "wire.json")
    assert run.returncode == 2 and run.stdout == ""
    assert f"argument --out: {blocked / 'wire.json'}: cannot make its folder (File exists); pick a writable path" in (
        run.stderr
    )


@pytest.mark.integration  # the bench and a child interpreter per case
def test_bench_step_measures_each_case_in_its_own_process_and_skips_what_would_not_fit(tmp_path):
    out = tmp_path / "step.json"
    tiny = ("--layers", "1", "--hidden", "32", "--intermediate", "64", "--heads", "4", "--kv-heads", "2")
    argv = ("bench", "step", "--tokens", "96", "--vocab", "512", "--chunk", "16", *tiny, "--out", out)
    run = centerline(*argv, "--max-gib", "100", timeout=600)  # three child interpreters, each importing torch
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert_written_with_machine(out, result)
    cases = {(c["path"], c["dtype"]): c for c in result["cases"]}
    assert set(cases) == {("dense", "float32"), ("chunked", "float32"), ("chunked", "bfloat16")}
    for case in cases.values():
        assert case["run"] is True and case["tokens"] == 96
        assert case["peak_mb"] >= case["backward_peak_mb"] >= case["floor_mb"] > 0 and case["step_s"] > 0
        assert case["checkpointed_mb"] == 2 * 96 * 32 * 4 / 2**20
        assert case["above_floor_mb"] == case["backward_peak_mb"] - case["floor_mb"] - case["checkpointed_mb"]
    assert result["chunk_mb"] == 16 * 512 * 4 / 2**20
    # A case estimated above --max-gib is reported, not run.
    run = centerline(*argv, "--paths", "dense", "--max-gib", "0.001")
    assert run.returncode == 0, run.stderr
    (case,) = json.loads(run.stdout)["cases"]
    assert case["run"] is False and case["why"] == f"estimated {case['estimate_mb']:,.0f} MiB > 1 MiB"
