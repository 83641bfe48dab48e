"""The fuzz harnesses of fuzz/ (README, "Fuzzing"): each runs under atheris for a few hundred
inputs from its seeded corpus, and its ``TestOneInput`` takes hypothesis-mutated seeds too.
The long runs are the README's commands; these keep the harnesses working."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuzz import fuzz_proxy_audit, fuzz_wire
from tests.processes import ENV, REPO

HARNESSES = {"fuzz.fuzz_wire": fuzz_wire, "fuzz.fuzz_proxy_audit": fuzz_proxy_audit}


@pytest.mark.parametrize("module", sorted(HARNESSES))
def test_harness_runs_under_atheris(module, tmp_path):
    corpus = tmp_path / "corpus"
    cmd = [
        sys.executable,
        "-m",
        module,
        "-runs=400",
        "-rss_limit_mb=1024",
        "-timeout=10",
        f"-artifact_prefix={tmp_path}/",
        str(corpus),
    ]
    out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Done 400 runs" in out.stderr
    assert len(list(corpus.iterdir())) >= len(HARNESSES[module].seeds())  # seeded, then grown by libFuzzer


@st.composite
def mutated_seed(draw, seeds: list[bytes]) -> bytes:
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, max(0, len(data) - 1)))
        op = draw(st.sampled_from(["set", "cut", "insert"]))
        if op == "set" and data:
            data[at] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[at : at + draw(st.integers(1, 64))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data)


@pytest.mark.parametrize("module", sorted(HARNESSES))
def test_harness_takes_mutated_seeds(module):
    harness = HARNESSES[module]

    @settings(max_examples=300, deadline=None)
    @given(data=mutated_seed(harness.seeds()))
    def one(data):
        harness.TestOneInput(data)  # raises only on a finding

    one()
