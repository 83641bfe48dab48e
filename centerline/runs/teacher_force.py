"""`centerline teacher-force RUN_DIR`: check that every token of a finished run was sampled by
the weights its label names (docs/design.md section 8, "A label tells the whole truth").

The run's ROLLOUTS stream is read back from its JetStream store (``RUN_DIR/nats``, served again by
an embedded ``nats-server`` without the run's passwords). For every weight version still on disk
(version 0 is the run's ``--model``, version ``v`` ``RUN_DIR/weights/v{v:06d}``), one SGLang server
loads it (``/update_weights_from_disk``, then ``/flush_cache``: nothing computed under
other weights is reused) and teacher-forces every sample that has a sampled token labelled ``v``:
``input_ids`` = the sample's prompt and response, no new token, the log-prob of each input
position. A sampled token's recorded log-prob and the forced one differ by float rounding only
(prefill against decode, in float32: ``tests/router_proxy/test_real_deployment.py`` holds them
to 5e-5) when the label is true; ``--tolerance`` (1e-3) is twenty times that bound.

The same tokens forced through the neighbouring version on disk (``wrong_label``) show what a
wrong label looks like in the same run: the share of them beyond the tolerance is what the check
can tell apart (a run whose steps changed the weights too little to tell versions apart proves
nothing, and this figure says so).

    centerline teacher-force runs/chain --out runs/chain/teacher_force.json
    centerline teacher-force RUN_DIR --engine http://127.0.0.1:30000   # an idle server of the same model

Left out: candidate rows (the sampled token's log-prob is what the label's truth decides) and
runs sampled at a temperature other than 1 (SGLang's input log-probs are at temperature 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TOLERANCE = 1e-3  # nats; see the module docstring
BATCH = 16  # samples per forcing request
FLUSH_WAIT_S = 60.0  # how long a flush after a load may wait for the scheduler to be idle


class TeacherForceError(RuntimeError):
    """A run that cannot be checked; the message names what is missing and the fix."""


@dataclass(frozen=True, slots=True)
class Tokens:
    """One sample's sequence and its sampled tokens labelled one version."""

    ids: list[int]  # prompt then response
    prompt_len: int
    positions: np.ndarray  # response positions of the sampled tokens with this label
    recorded: np.ndarray  # their recorded log-probs (float32 as trained)


def run_settings(run_dir: Path) -> tuple[Path, float]:
    """The run's initial model directory (version 0) and its rollout temperature, from ``config.toml``."""
    config = run_dir / "config.toml"
    if not config.is_file():
        raise TeacherForceError(f"{config} does not exist: give the run directory of a finished `centerline up`")
    doc = tomllib.loads(config.read_text())
    model = Path(doc["trainer"]["model"])
    for base in (Path.cwd(), run_dir, run_dir.parent):
        if (base / model).is_dir():
            return (base / model).resolve(), float(doc.get("rollout_temperature", 1.0))
    raise TeacherForceError(f"the run's model {str(model)!r} ([trainer] model) is not found: run from where up ran")


def versions_on_disk(run_dir: Path, initial: Path) -> dict[int, Path]:
    """Every weight version the run still has: 0 (the initial model) and ``weights/v*``."""
    versions = {0: initial}
    for d in sorted((run_dir / "weights").glob("v[0-9]*")):
        versions[int(d.name[1:])] = d
    return versions


def labelled(batches, version: int) -> list[Tokens]:
    """Per sample, the sampled tokens (loss mask 1) labelled ``version``."""
    out = []
    for b in batches:
        for i in range(b.num_samples):
            part = b.sample_slice(i)
            hit = (b.loss_mask[part] == 1) & (b.token_versions[part] == version)
            if not hit.any():
                continue
            prompt = b.prompt_ids[b.prompt_offsets[i] : b.prompt_offsets[i + 1]].tolist()
            response = b.response_ids[part].tolist()
            out.append(Tokens(prompt + response, len(prompt), np.flatnonzero(hit), b.sampled_logprobs[part][hit]))
    return out


def _post(url: str, body: dict, timeout: float = 600.0) -> object:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def force(engine: str, samples: list[Tokens]) -> list[np.ndarray]:
    """Each sample's response log-probs under the engine's weights, by teacher forcing."""
    out = []
    for start in range(0, len(samples), BATCH):
        chunk = samples[start : start + BATCH]
        body = {
            "input_ids": [s.ids for s in chunk],
            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
            "return_logprob": True,
            # the first response token's log-prob is computed at the prompt's last position
            "logprob_start_len": [s.prompt_len - 1 for s in chunk],
        }
        answers = _post(engine.rstrip("/") + "/generate", body)
        for s, answer in zip(chunk, answers, strict=True):
            window = answer["meta_info"]["input_token_logprobs"][1:]  # the window's first position has none
            if len(window) != len(s.ids) - s.prompt_len:
                raise TeacherForceError(
                    f"engine {engine} forced {len(window)} positions of a {len(s.ids) - s.prompt_len}-token response"
                )
            out.append(np.array([row[0] for row in window], dtype=np.float64))
    return out


def load(engine: str, version: int, path: Path) -> None:
    """Serve ``path`` as ``version``, then flush the prefix cache. Not in one call: SGLang answers a
    generation before its scheduler has let the requests go, and refuses a flush asked with the load
    while it still holds them (400, weights loaded, cache kept); ``/flush_cache?timeout=`` waits
    for the scheduler to be idle, then flushes."""
    reply = _post(
        engine.rstrip("/") + "/update_weights_from_disk",
        {"model_path": str(path), "weight_version": str(version), "flush_cache": False},
    )
    if not (isinstance(reply, dict) and reply.get("success")):
        raise TeacherForceError(f"engine {engine} did not load version {version} from {path}: {reply}")
    req = urllib.request.Request(engine.rstrip("/") + f"/flush_cache?timeout={FLUSH_WAIT_S:g}", b"", method="POST")
    try:
        urllib.request.urlopen(req, timeout=FLUSH_WAIT_S + 30).close()
    except urllib.error.HTTPError as e:
        raise TeacherForceError(
            f"engine {engine} did not flush its cache after loading version {version}: {e.code} {e.read()[:300]!r}"
        ) from None


def differences(engine: str, samples: list[Tokens]) -> np.ndarray:
    """|recorded - forced| of every labelled token of ``samples``, in nats."""
    parts = [
        np.abs(s.recorded.astype(np.float64) - f[s.positions])
        for s, f in zip(samples, force(engine, samples), strict=True)
    ]
    return np.concatenate(parts) if parts else np.zeros(0)


def summary(diff: np.ndarray, tolerance: float) -> dict:
    if not diff.size:
        return {"tokens": 0, "beyond": 0, "share": 0.0}
    return {
        "tokens": int(diff.size),
        "beyond": int((diff > tolerance).sum()),
        "share": round(float((diff > tolerance).mean()), 6),
        "median": float(np.median(diff)),
        "p99": float(np.quantile(diff, 0.99)),
        "max": float(diff.max()),
    }


def check(batches, versions: dict[int, Path], engine: str, tolerance: float = TOLERANCE) -> dict:
    """Teacher-force every sampled token whose labelled version is on disk; per version and in total,
    the tokens, how many differ by more than ``tolerance``, and the same tokens under a wrong label."""
    per_version, wrong, all_diff, all_wrong, skipped = {}, {}, [], [], 0
    labels = sorted({int(v) for b in batches for v in np.unique(b.token_versions[b.loss_mask == 1])})
    on_disk = sorted(versions)
    for version in labels:
        samples = labelled(batches, version)
        if version not in versions:
            skipped += sum(s.positions.size for s in samples)
            continue
        load(engine, version, versions[version])
        diff = differences(engine, samples)
        per_version[str(version)] = summary(diff, tolerance)
        all_diff.append(diff)
        # the neighbouring version on disk: what the same tokens look like under a wrong label
        others = [v for v in on_disk if v != version]
        if others:
            other = min(others, key=lambda v: (abs(v - version), v))
            load(engine, other, versions[other])
            off = differences(engine, samples)
            wrong[f"{version}->{other}"] = summary(off, tolerance)
            all_wrong.append(off)
    total = summary(np.concatenate(all_diff) if all_diff else np.zeros(0), tolerance)
    return {
        "tolerance": tolerance,
        "total": total,
        "versions": per_version,
        "skipped_tokens": skipped,  # labelled with a version no longer on disk
        "wrong_label": {
            "total": summary(np.concatenate(all_wrong) if all_wrong else np.zeros(0), tolerance),
            "pairs": wrong,
        },
    }


async def read_batches(run_dir: Path) -> list:
    """Every batch of the run's ROLLOUTS stream, its NATS store served again for the read."""
    from centerline.nats_server import EmbeddedNats
    from centerline.runs.record import joined, record_stream
    from shared.names import ROLLOUTS_STREAM
    from shared.wire import decode_batch

    store = run_dir / "nats"
    if not (store / "jetstream").is_dir():
        raise TeacherForceError(f"{store / 'jetstream'} does not exist: the run's NATS store is needed")
    nats = EmbeddedNats(store).start()
    try:
        messages = []
        await record_stream(nats.url, ROLLOUTS_STREAM, None, None, messages.append)
    finally:
        nats.stop()
    return [decode_batch(m.data) for m in joined(messages)]


def check_run(run_dir: Path, engine: str | None = None, tolerance: float = TOLERANCE) -> dict:
    """``check`` over a finished run's recorded batches, on ``engine`` (default: a fresh one of the run's model)."""
    initial, temperature = run_settings(run_dir)
    if temperature != 1.0:
        raise TeacherForceError(
            f"the run sampled at rollout_temperature {temperature}; SGLang's input log-probs are at "
            "temperature 1, so only a run at temperature 1 can be checked this way"
        )
    batches = asyncio.run(read_batches(run_dir))
    server = None
    if engine is None:
        engine, server = start_engine(initial, run_dir / "teacher-force-sglang.log")
    try:
        report = check(batches, versions_on_disk(run_dir, initial), engine, tolerance)
    finally:
        if server is not None:
            stop_engine(server)
    return {"run_dir": str(run_dir), "batches": len(batches), **report}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="centerline teacher-force", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a finished `centerline up` run directory")
    parser.add_argument("--engine", help="an idle SGLang server of the run's model (default: start one)")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="nats (default %(default)s)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    try:
        report = check_run(args.run_dir, args.engine, args.tolerance)
    except TeacherForceError as exc:
        print(f"centerline teacher-force: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


def start_engine(model: Path, log: Path) -> tuple[str, subprocess.Popen]:
    """A fresh ``centerline sglang`` of ``model`` on a free port, without a prefix cache."""
    from centerline.ports import free_port

    port = free_port()
    argv = [sys.executable, "-m", "centerline", "sglang", "--model", str(model), "--port", str(port)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*argv, "--", "--disable-radix-cache"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return url, proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_engine(proc)
            raise TeacherForceError(f"SGLang did not start; see {log}")
        time.sleep(0.5)  # polling interval of the server's /health


def stop_engine(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
