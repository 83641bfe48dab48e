"""The fuzz harnesses of fuzz/ (docs/testing.md, "Fuzzing"): each runs under atheris for a few hundred
inputs from its seeded corpus (the proxy's a few thousand: its inputs are small), and its
``TestOneInput`` takes hypothesis-mutated seeds too, the proxy's structurally mutated ones as
well. The long runs are that page's commands; these keep the harnesses working."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from centerline.synth import native_response
from fuzz import fuzz_proxy_audit, fuzz_wire
from router_proxy import answer, sglang_response
from shared import response_arrays
from tests.processes import ENV, REPO, fresh_peak_rss

HARNESSES = {"fuzz.fuzz_wire": fuzz_wire, "fuzz.fuzz_proxy_audit": fuzz_proxy_audit}
RUNS = {"fuzz.fuzz_wire": 400, "fuzz.fuzz_proxy_audit": 2000}


@pytest.mark.integration  # libFuzzer in a new interpreter
@pytest.mark.parametrize("module", sorted(HARNESSES))
def test_harness_runs_under_atheris(module, tmp_path):
    corpus = tmp_path / "corpus"
    cmd = fresh_peak_rss(
        [
            sys.executable,
            "-m",
            module,
            f"-runs={RUNS[module]}",
            "-rss_limit_mb=1024",
            "-timeout=10",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
        ]
    )
    out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"Done {RUNS[module]} runs" in out.stderr
    assert len(list(corpus.iterdir())) >= len(HARNESSES[module].seeds())  # seeded, then grown by libFuzzer


def test_a_harness_counts_its_peak_memory_from_nothing_under_a_big_worker():
    """The harness's ``-rss_limit_mb`` is its own memory, not the peak of the worker that started it."""
    peak = "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)"
    held = np.ones(256 * 2**20, np.uint8)  # 256 MiB touched in this process
    straight = int(subprocess.run([sys.executable, "-c", peak], capture_output=True, text=True).stdout)
    fresh = int(subprocess.run(fresh_peak_rss([sys.executable, "-c", peak]), capture_output=True, text=True).stdout)
    assert held.sum() == 256 * 2**20
    assert straight >= 256 > 64 > fresh  # an interpreter alone is a few dozen MiB


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


def test_proxy_harness_takes_structurally_mutated_seeds():
    seeds = fuzz_proxy_audit.seeds()

    @settings(max_examples=300, deadline=None)
    @given(index=st.integers(0, len(seeds) - 1), seed=st.integers(0, 2**32), count=st.integers(1, 3))
    def one(index, seed, count):
        data, rng = seeds[index], random.Random(seed)
        for _ in range(count):
            data = fuzz_proxy_audit.mutate_structure(data, rng) or data
        fuzz_proxy_audit.TestOneInput(data)  # raises only on a finding

    one()


FLT_MAX = float(np.finfo(np.float32).max)


def leaves(value):
    if type(value) in (list, dict):
        for item in value.values() if type(value) is dict else value:
            yield from leaves(item)
    else:
        yield value


def cut_short(seed, mutated) -> bool:
    """Whether a list of ``mutated`` is shorter than the same list of ``seed``."""
    if type(seed) is list and type(mutated) is list:
        return len(mutated) < len(seed) or any(cut_short(a, b) for a, b in zip(seed, mutated))
    if type(seed) is dict and type(mutated) is dict:
        return any(cut_short(seed[key], mutated[key]) for key in seed.keys() & mutated.keys())
    return False


def kinds(seed: bytes, mutated: bytes) -> set[str]:
    doc = json.loads(mutated[1:])  # json: orjson refuses integers beyond 64 bits
    meta = doc.get("meta_info") if type(doc) is dict else None
    reason = meta.get("finish_reason", None) if type(meta) is dict else None
    found = set()
    if reason is not None and not (type(reason) is dict and type(reason.get("type")) is str):
        found.add("finish_reason of another type")
    if any(type(v) is float and abs(v) > FLT_MAX for v in leaves(doc)):
        found.add("number past float32")
    if any(type(v) is int and not -(2**31) <= v < 2**31 for v in leaves(doc)):
        found.add("number past int32")
    if cut_short(json.loads(seed[1:]), doc):
        found.add("list cut short")
    return found


def test_structural_mutations_reach_mistyped_fields_numbers_past_the_wire_dtypes_and_short_lists():
    seeds = [s for s in fuzz_proxy_audit.seeds() if not s[0] & 4 and not s[0] & 1]  # native bodies
    reached = set()
    for i in range(2000):
        mutated = fuzz_proxy_audit.mutate_structure(seeds[i % len(seeds)], random.Random(i))
        reached |= kinds(seeds[i % len(seeds)], mutated)
    assert reached == {"finish_reason of another type", "number past float32", "number past int32", "list cut short"}


def test_binary_answer_check_finds_a_finish_reason_that_does_not_decode():
    # issue 25's first answer, as the proxy encoded it before: the audit passed it, its type went as it was
    valid = native_response(1, 8, fuzz_proxy_audit.VOCAB)
    doc = orjson.loads(valid)
    doc["meta_info"]["finish_reason"] = {"type": 1}
    found = answer.from_body(valid, "generate", mode="selected", k=8)
    found.finish_reasons = [{"type": 1}]
    with pytest.raises(AssertionError, match="the binary answer of an accepted response does not decode"):
        fuzz_proxy_audit.check_travelled(orjson.dumps(doc), "generate", "selected", response_arrays.encode(found))


def test_binary_answer_check_finds_a_log_prob_that_did_not_survive_float32():
    # issue 25's second answer, as the proxy encoded it before (astype(float32): -1e300 became -inf)
    doc = orjson.loads(native_response(2, 8, fuzz_proxy_audit.VOCAB, seed=1))
    doc["meta_info"]["output_top_logprobs"][0][-1][0] = -1e300
    body = orjson.dumps(doc)
    _, metas = sglang_response.parse_body(body, "generate", mode="selected", k=8)
    ids, logprobs, _, cand_ids, cand_logprobs, offsets = sglang_response.to_arrays(metas, mode="selected", k=8)
    with np.errstate(over="ignore"):
        found = response_arrays.ResponseArrays(
            texts=["xx"],
            finish_reasons=["length"],
            weight_versions=[0],
            prompt_ids=None,
            offsets=offsets,
            response_ids=ids.astype(np.int32),
            sampled_logprobs=logprobs.astype(np.float32),
            cand_ids=cand_ids.astype(np.int32),
            cand_logprobs=cand_logprobs.astype(np.float32),
        )
    assert found.cand_logprobs[0, -1] == -math.inf
    with pytest.raises(AssertionError, match=r"cand_logprobs \[-1e\+300\] do not survive float32"):
        fuzz_proxy_audit.check_travelled(body, "generate", "selected", response_arrays.encode(found))
