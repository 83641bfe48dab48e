"""`centerline bench weights [--json]`: seconds a weight version takes to reach every engine by
each transport (docs/design.md section 8), in one run, beside the limit of this machine.

The stack, every part real: ``--engines`` SGLang servers of ``--model`` (``centerline sglang``,
the CPU recipe; default: the random seed-0 toy model, written by init-model into ``--model-dir``
once) and the trainer's own publisher (``trainer_service/weights.py`` ``WeightPublisher``, the
default ``retract`` update: pause, load, flush, continue, on every engine at once). Two versions
are written first, the model's tensors and the same tensors times 1.001, as the trainer writes a
version (an HF directory); the bench then publishes ``--versions`` versions alternating between
them, by ``disk`` (every engine reads the directory: here from the page cache, the files having
just been written) and by ``distributed`` (rank 0 reads the directory once and broadcasts it in
buckets of ``--bucket-mb`` over gloo to each engine), the proof off; ``seconds`` is the median of
one publish, every engine updated. ``prove_s`` is the median time of the proof of every engine
(``trainer_service/proof.py``: each engine's /weights_checker beside the trainer's checksum).

The limit, measured in the same run: ``version_bytes`` (the version's safetensors) copied once in
memory (``memcpy_gbps``, a warm preallocated copy) and sent once per engine over a loopback TCP
socket (``loopback_gbps``, 4 MiB writes, one receiving thread): ``limit_s`` is the slower of the
two, what a transport that sends the version to every engine over a socket must spend at least
on this machine. ``disk`` sends nothing: with the engines on the trainer's host each copies the
version from the page cache, bound by memcpy alone, so it may come in under ``limit_s``.

    centerline bench weights --json
    centerline make-model smollm2 --out runs/SmolLM2-135M-Instruct
    centerline bench weights --model runs/SmolLM2-135M-Instruct --versions 3 --out docs/bench/weights-smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from centerline.bench import add_out_flag
from centerline.bench.baselines import loopback_gbps, memcpy_gbps
from centerline.bench.sessions import toy_model
from centerline.ports import free_port
from centerline.runs.run_figures import write_bench_figures
from centerline.up.processes import Supervisor, sglang_argv, wait_http
from trainer_service import proof
from trainer_service.weights import TRANSPORTS, WeightPublisher


def write_versions(model: Path, out: Path) -> list[Path]:
    """Two versions of ``model`` under ``out``: its tensors, and the same times 1.001."""
    from safetensors.torch import save_file

    tensors = proof.load_tensors(model)
    versions = []
    for i, scale in enumerate((1.0, 1.001)):
        target = out / f"v{i}"
        shutil.copytree(model, target, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file({n: (t * scale).contiguous() for n, t in tensors.items()}, str(target / "model.safetensors"))
        versions.append(target)
    return versions


async def publish_times(urls: list[str], transport: str, versions: list[Path], n: int, bucket_mb: int) -> dict:
    engines = WeightPublisher(
        None, urls, attempts=1, transport=transport, bucket_bytes=bucket_mb << 20, prove=False, mode="retract"
    )
    seconds, prove_s = [], []
    try:
        for v in range(1, n + 1):
            path = versions[v % 2]
            t0 = time.perf_counter()
            results = await asyncio.gather(*(engines.update(u, v, path) for u in urls))
            seconds.append(time.perf_counter() - t0)
            assert all(results), f"{transport}: version {v} did not reach every engine"
            t0 = time.perf_counter()
            proved = await asyncio.gather(*(engines.prover.prove(u, v, path) for u in urls))
            prove_s.append(time.perf_counter() - t0)
            assert all(proved), f"{transport}: version {v} not proved on every engine"
    finally:
        await engines.close()
    return {
        "seconds": statistics.median(seconds),
        "seconds_all": seconds,
        "prove_s": statistics.median(prove_s),
        "fallbacks": engines.fallbacks,
    }


def bench_weights(argv: list[str]) -> int:
    """Seconds a weight version takes to reach every engine, by disk and by broadcast."""
    parser = argparse.ArgumentParser(prog="centerline bench weights", description=bench_weights.__doc__)
    parser.add_argument("--model", type=Path, help="HF model directory (default: the toy model in --model-dir)")
    parser.add_argument("--model-dir", type=Path, default=Path("runs/models"), help="where the toy model is kept")
    parser.add_argument("--engines", type=int, default=2, help="SGLang servers started")
    parser.add_argument("--versions", type=int, default=5, help="versions published by each transport")
    parser.add_argument("--bucket-mb", type=int, default=256, help="most MiB in one broadcast")
    parser.add_argument("--json", action="store_true", help="print one JSON object on one line")
    add_out_flag(parser, "weights")
    args = parser.parse_args(argv)
    model = args.model or toy_model(args.model_dir)
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp:
        tmp = Path(tmp)
        versions = write_versions(model, tmp)
        nbytes = sum(f.stat().st_size for f in versions[0].glob("*.safetensors"))
        supervisor = Supervisor(tmp, {})
        try:
            engines = []
            for i in range(args.engines):
                url = f"http://127.0.0.1:{free_port()}"
                engines.append((url, supervisor.start(f"sglang-{i}", sglang_argv(str(versions[0]), url, []))))
            for i, (url, proc) in enumerate(engines):
                wait_http(f"{url}/health", f"SGLang {i}", proc, tmp / f"sglang-{i}.log", 600)
            urls = [u for u, _ in engines]
            by = {t: asyncio.run(publish_times(urls, t, versions, args.versions, args.bucket_mb)) for t in TRANSPORTS}
        finally:
            supervisor.stop()
    memcpy, loopback = memcpy_gbps(nbytes), loopback_gbps(nbytes * args.engines)
    result = {
        "bench": "weights",
        "model": model.name,
        "engines": args.engines,
        "versions": args.versions,
        "bucket_mb": args.bucket_mb,
        "version_bytes": nbytes,
        "memcpy_gbps": memcpy,
        "loopback_gbps": loopback,
        "limit_s": max(nbytes / memcpy, nbytes * args.engines / loopback) / 1e9,
        "transports": by,
        "speedup_distributed": by["disk"]["seconds"] / by["distributed"]["seconds"],
    }
    write_bench_figures(result, args.out, indent=None if args.json else 2)
    return 0
