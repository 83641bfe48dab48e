"""`centerline bench long-sample` at tiny sizes (K = 8, a 64 KiB ``max_payload``) on the nats-server it
starts: the long sample travels in ``ceil(bytes / piece bytes)`` pieces, the other in one message, and
the gate holds each exactly as published; sizes under which the figure would not be the one named are
refused, naming the flag, before anything starts."""

import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from centerline.bench.long_sample import bench_long_sample, group, trajectory
from rollout_worker.publish import split_batch
from shared.config import Config
from shared.pieces import HEADER_ROOM
from tests.test_cli import assert_written_with_machine

ROOT = Path(__file__).resolve().parents[2]
K, VOCAB, PROMPT, PAYLOAD, REPEATS = 8, 64, 16, 64 << 10, 2
LONG, FITS = 2000, 200  # 77 bytes a token: about 154 KB, three pieces; about 15 KB, one message
TINY = ["--k", K, "--vocab", VOCAB, "--prompt-tokens", PROMPT, "--max-payload", PAYLOAD]
SAMPLE_FIGURES = {
    "tokens",
    "prompt_tokens",
    "wire_bytes",
    "messages",
    "stream_bytes",
    "publish_s",
    "pack_s",
    "admit_s",
    "check_s",
    "ack_s",
    "memcpy_s",
    "loopback_s",
    "publish_to_loopback",
    "admit_to_loopback",
    "publish_mb_per_s",
    "admit_mb_per_s",
    "sha256",
    "admitted_sha256",
    "gate_counts",
}


def published(tokens: int, repeat: int, index: int):
    """The sample of task ``bench/<repeat>/<index>``, as the worker's publisher encodes it: one part."""
    cfg = Config(rollout_n=1, rollout_top_logprobs_num=K)
    (part,) = split_batch(group(trajectory(tokens, PROMPT, K, VOCAB), repeat, index, cfg), PAYLOAD - HEADER_ROOM)
    return part


def wire_bytes(tokens: int, repeat: int, index: int) -> int:
    return len(published(tokens, repeat, index).data)


@pytest.mark.integration  # the bench in a new interpreter, and the nats-server it starts
def test_bench_long_sample_sends_the_long_sample_in_pieces_and_the_gate_holds_each_as_published(tmp_path):
    out = tmp_path / "long-sample.json"
    argv = ["bench", "long-sample", "--json", "--tokens", LONG, "--fits-tokens", FITS, *TINY, "--repeats", REPEATS]
    run = subprocess.run(
        [sys.executable, "-m", "centerline", *map(str, [*argv, "--out", out])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    assert_written_with_machine(out, result)
    piece = PAYLOAD - HEADER_ROOM
    assert {k: v for k, v in result.items() if k not in ("samples", "long_to_fits_per_byte")} == {
        "bench": "long-sample",
        "k": K,
        "vocab": VOCAB,
        "max_payload": PAYLOAD,
        "piece_bytes": piece,
        "repeats": REPEATS,
        "unacked": 0,
        "dead_letters": 0,
    }
    samples = result["samples"]
    assert list(samples) == ["long", "fits"]
    for index, (name, tokens) in enumerate([("long", LONG), ("fits", FITS)]):
        s = samples[name]
        assert set(s) == SAMPLE_FIGURES
        part = published(tokens, REPEATS - 1, index)  # the last repeat's
        assert (s["tokens"], s["prompt_tokens"], s["wire_bytes"]) == (tokens, PROMPT, len(part.data))
        assert s["sha256"] == s["admitted_sha256"] == hashlib.sha256(part.data).hexdigest()
        assert s["gate_counts"] == {"accepted": REPEATS}
        assert s["wire_bytes"] < s["stream_bytes"] <= s["wire_bytes"] + s["messages"] * HEADER_ROOM
        assert min(s[key] for key in ("publish_s", "pack_s", "admit_s", "check_s", "ack_s", "loopback_s")) > 0
        assert s["publish_to_loopback"] == s["publish_s"] / s["loopback_s"]
        assert s["admit_mb_per_s"] == s["wire_bytes"] / s["admit_s"] / 1e6
    long, fits = samples["long"], samples["fits"]
    assert long["messages"] == math.ceil(long["wire_bytes"] / piece) == 3 and fits["messages"] == 1
    assert result["long_to_fits_per_byte"] == {
        key: (long[key] / long["wire_bytes"]) / (fits[key] / fits["wire_bytes"])
        for key in ("publish_s", "admit_s", "ack_s")
    }


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ["--tokens", LONG, "--fits-tokens", LONG],
            "--fits-tokens 2000 makes a sample of {bytes} bytes, which is over one message of --max-payload 65536 "
            "(61440 bytes besides headers); the fits sample must fit: lower it or raise --max-payload",
        ),
        (
            ["--tokens", FITS, "--fits-tokens", FITS],
            "--tokens 200 makes a sample of {bytes} bytes, which fits one message of --max-payload 65536 "
            "(61440 bytes besides headers); the long sample must not fit: raise it or lower --max-payload",
        ),
        (
            ["--max-payload", 4096],
            "--max-payload 4096: nats-server takes at most 67108864 (64 MiB), and a message keeps 4096 bytes for "
            "headers; pick one in [8192, 67108864]",
        ),
        (["--repeats", 0], "--repeats 0: must be at least 1"),
    ],
)
def test_sizes_that_would_not_make_the_named_figure_are_refused_before_anything_starts(argv, error, tmp_path, capsys):
    with pytest.raises(SystemExit) as refused:
        bench_long_sample([*map(str, [*TINY, *argv]), "--out", str(tmp_path / "long-sample.json")])
    assert refused.value.code == 2
    tokens = int(argv[1]) if argv[0] == "--tokens" else 0
    error = error.format(bytes=wire_bytes(tokens, 0, 0)) if tokens else error
    assert capsys.readouterr().err.endswith(f"centerline bench long-sample: error: {error}\n")
    assert not (tmp_path / "long-sample.json").exists()
