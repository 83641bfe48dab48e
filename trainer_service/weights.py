"""Weight versions: the trained model as an HF directory per version, loaded by every engine.

Version ``v`` lives in ``<run_dir>/weights/v{v:06d}/`` (config, safetensors, and the
tokenizer files copied from the initial model directory), written to a temporary
directory and renamed, so an engine never loads half a version. Version 0 is the initial
``--model`` directory itself.

Publication (rank 0), on each engine URL directly (SGLang routers do not forward admin
endpoints), with the engines' admin key as ``Authorization: Bearer`` when one is set
(``shared/admin_key.py``), then ``weights.updated`` ``{version, path, sha256}`` on NATS (sha256
of the safetensors files in name order). How an engine takes the version is the trainer's
``weight_update`` setting (docs/design.md section 8, weight updates in flight):

- ``retract`` (the default): ``POST /pause_generation {mode: retract}`` (the requests in flight go
  back to the queue), ``POST /update_weights_from_disk {model_path, weight_version: str(v),
  flush_cache: true}`` (a paused engine loads at once and empties its prefix cache),
  ``POST /continue_generation``: the requests are recomputed under the new weights, so every token
  is sampled by the version its label names, and SGLang's ``meta_info.weight_versions`` says which
  tokens each version sampled.
- ``in_place``: the same with ``mode: in_place`` and no flush (SGLang refuses one while requests
  are in the batch, and the refusal fails the call): the requests go on on the KV cache built under
  the old weights, and the prefix cache keeps it, under the new label (docs/design.md section 8).
- ``drain``: the update alone; SGLang finishes the generations in flight, loads and flushes.

The continue is sent whatever happened after the pause; a trainer killed between the two leaves
the engine to ``centerline sglang``'s watchdog, which continues an engine paused longer than its
``--continue-after`` seconds. A call that times out or breaks off is not yet a failure:
the engine's own /model_info decides (``serves_within_settle``).
An engine that fails after a few tries is logged and counted, and training
goes on: batches it samples with old weights are then rejected by the gate as ``stale``.
``watch`` brings such an engine back: every few seconds it asks each engine which version it
serves, and one behind the latest (restarted, it serves its initial weights, ``"default"``) is
sent the latest version again, so a restart costs the batches sampled meanwhile (stale) and
never stalls the run, even when every engine restarted. An
engine that refuses the key (401/403) is a configuration error, not a passing failure: it
raises ``AdminKeyError`` naming the engine and the setting, and the trainer stops.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import shutil
from pathlib import Path

import aiohttp
import orjson

from shared import admin_key, faults, names
from shared.nats_client import PublishError, publish_acked
from shared.response_arrays import INITIAL_VERSION
from trainer_service import proof
from trainer_service.checkpoint import publish_dir
from trainer_service.distributed import is_main
from trainer_service.model import save_model
from trainer_service.transport import Distributed, TransportError

log = logging.getLogger("centerline.trainer.weights")
KEEP = 3  # versions kept on disk: an engine may still be loading the previous one
WEIGHT_UPDATES = ("retract", "in_place", "drain")  # TrainerSettings.weight_update
TRANSPORTS = ("disk", "distributed")  # TrainerSettings.weight_transport
MODEL_FILES = ("config.json", "generation_config.json")


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:06d}"


def save_version(root: Path, version: int, model, initial: Path) -> Path:
    """Write version ``version`` of ``model`` (all ranks call; rank 0 writes)."""
    final = version_dir(root, version)
    tmp = root / f".tmp-{final.name}"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    save_model(model, str(tmp))
    if is_main():
        for f in initial.iterdir():  # tokenizer and anything else the engine needs besides the weights
            if (
                f.is_file()
                and f.name not in MODEL_FILES
                and not f.name.startswith("model")
                and not (tmp / f.name).exists()
            ):
                shutil.copy2(f, tmp / f.name)
        publish_dir(tmp, final)
        for old in sorted(p for p in root.iterdir() if p.name.startswith("v"))[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def sha256(path: Path) -> str:
    """The digest of the ``*.safetensors`` files of the version directory ``path``, in name order."""
    if not path.is_dir():
        raise FileNotFoundError(f"no weights directory {path}")
    digest = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


class WeightPublisher:
    """Tells every engine, then NATS, which version to serve."""

    def __init__(
        self,
        js,
        engine_urls: list[str],
        *,
        attempts: int = 3,
        timeout: float = 300.0,
        settle: float = 600.0,
        admin_api_key: str | None = None,
        mode: str = "retract",
        transport: str = "disk",
        master_address: str = "127.0.0.1",
        bucket_bytes: int = 256 << 20,
        broadcast_timeout: float = 60.0,
        prove: bool = True,
    ):
        """``timeout``: seconds per update call; ``settle``: how long an engine whose call timed out
        or broke off may take to report the version anyway (draining, it waits for its generations
        in flight). ``admin_api_key`` defaults to the environment's (``shared.admin_key.key_from_env``).
        ``mode``: the trainer's ``weight_update`` (``WEIGHT_UPDATES``); ``transport``: its
        ``weight_transport`` (``TRANSPORTS``: ``distributed`` broadcasts from ``master_address`` in
        buckets of ``bucket_bytes``, each collective bounded by ``broadcast_timeout``); ``prove``:
        hold each engine's ``/weights_checker`` checksum against the version's (``trainer_service.proof``)."""
        if mode not in WEIGHT_UPDATES:
            raise ValueError(f"weight_update {mode!r} is not one of {WEIGHT_UPDATES}: set one of them")
        if transport not in TRANSPORTS:
            raise ValueError(f"weight_transport {transport!r} is not one of {TRANSPORTS}: set one of them")
        self.js, self.engine_urls, self.attempts, self.settle = js, list(engine_urls), attempts, settle
        self.mode = mode
        key = admin_api_key or admin_key.key_from_env()
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        # A connection per call: SGLang's server closes one idle 5 s, and a call sent on a connection
        # it closed while this loop was busy (reading or hashing a version) fails at once.
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout), connector=aiohttp.TCPConnector(force_close=True)
        )
        self.failures = 0
        self.catch_ups = 0  # engines found behind and sent the latest version again (``watch``)
        self.latest: tuple[int, Path] | None = None
        self.announcing: asyncio.Task | None = None  # the last version's event, on its way to NATS
        self.locks = {url: asyncio.Lock() for url in self.engine_urls}  # one update at a time per engine
        self.distributed = (
            Distributed(
                self._post, self.engine_urls, host=master_address, bucket_bytes=bucket_bytes, timeout=broadcast_timeout
            )
            if transport == "distributed"
            else None
        )
        self.prove_weights = prove
        self.prover = proof.Prover(self._post, self._get)
        self.fallbacks = 0  # versions the distributed transport did not deliver, loaded from disk instead

    async def publish(self, version: int, path: Path) -> None:
        """Load ``version`` into every engine; then, off the caller's path, announce it on NATS."""
        path = path.resolve()
        self.latest = (version, path)
        results = await asyncio.gather(*(self.update(url, version, path) for url in self.engine_urls))
        self.failures += results.count(False)
        # The engines serve the version now. The event only tells observers, so the next step need
        # not wait for its digest (a thread: seconds for a real model's files) nor its PubAck; each
        # event follows the one before, so the stream's last value is the latest version.
        self.announcing = asyncio.create_task(self._announce(self.announcing, version, path))

    async def _announce(self, before: asyncio.Task | None, version: int, path: Path) -> None:
        if before is not None:
            await before
        try:
            digest = await asyncio.to_thread(sha256, path)
        except OSError as exc:  # pruned already (KEEP versions are kept): a later event replaces it
            log.warning("weights version %d is loaded but not announced: %s", version, exc)
            return
        event = {"version": version, "path": str(path), "sha256": digest}
        try:
            await publish_acked(self.js, names.WEIGHTS_SUBJECT, orjson.dumps(event), what=f"weights version {version}")
        except PublishError as exc:
            log.error("weights version %d is loaded but %s not published: %s", version, names.WEIGHTS_SUBJECT, exc)

    async def update(self, url: str, version: int, path: Path) -> bool:
        async with self.locks[url]:
            return await self._update(url, version, path)

    async def watch(self, interval: float = 5.0, proof_interval: float = 60.0) -> None:
        """Every ``interval`` seconds, send the latest version to each engine that serves an older
        one (it restarted, or a timed-out update never landed); every ``proof_interval`` seconds
        (0: never), prove each engine's weights again (weights loaded behind the trainer's back).
        Runs until cancelled."""
        loop = asyncio.get_running_loop()
        proved = loop.time()
        while True:
            await asyncio.sleep(interval)  # polling interval of the engines' own reports
            for url in self.engine_urls:
                await self.catch_up(url)
            if self.prove_weights and proof_interval and loop.time() - proved >= proof_interval:
                proved = loop.time()
                for url in self.engine_urls:
                    await self.reprove(url)

    async def reprove(self, url: str) -> bool | None:
        """Prove ``url``'s weights between updates; None when an update holds it or none was sent."""
        if self.latest is None or self.locks[url].locked():
            return None
        async with self.locks[url]:
            version, path = self.latest
            if served_version(await self.serving(url)) != version:
                return None  # behind (catch_up's) or relabelled already
            return await self.prover.prove(url, version, path)

    async def catch_up(self, url: str) -> bool:
        """Send the latest version to ``url`` if it serves an older one; whether it was sent and loaded."""
        if self.latest is None or self.locks[url].locked():  # a publish is at it
            return False
        async with self.locks[url]:
            version, path = self.latest  # again, under the lock: a publish may have moved on
            reported = await self.serving(url)
            serving = -1 if reported == proof.UNTRUSTED else served_version(reported)  # caught: load it again
            if serving is None or serving >= version:
                return False
            log.warning(
                "engine %s serves weights version %d, the trainer's is %d (restarted?): sending it version %d",
                url,
                serving,
                version,
                version,
            )
            self.catch_ups += 1
            return await self._update(url, version, path)

    async def _update(self, url: str, version: int, path: Path) -> bool:
        # The flush empties the prefix cache, so no KV of the old weights stands under the new label
        # (docs/design.md section 8). In place, the requests keep their KV, and SGLang refuses a flush
        # with requests in the batch (the refusal fails the call); retracted or drained, none is.
        body = {"model_path": str(path), "weight_version": str(version), "flush_cache": self.mode != "in_place"}
        if self.mode == "drain":
            return await self._deliver(url, version, path, body)
        paused = await self._control(url, "/pause_generation", {"mode": self.mode}, version)
        try:
            faults.hit("trainer.weights_paused", version)
            return await self._deliver(url, version, path, body)
        finally:
            if paused:
                await self._control(url, "/continue_generation", {}, version)

    async def _deliver(self, url: str, version: int, path: Path, body: dict) -> bool:
        """Load ``version`` into ``url`` by the transport (disk when the distributed one fails),
        then prove it: an engine whose checksum disagrees is loaded from disk once more and
        proved again; one that still disagrees keeps the label ``proof.UNTRUSTED``."""
        loaded = False
        if self.distributed is not None:
            try:
                parts = self.distributed.prepare(version, await self._tensors(version, path))
                await self.distributed.send(url, version, parts)
                loaded = True
            except (TransportError, OSError) as exc:
                self.fallbacks += 1
                log.warning("engine %s: version %d not broadcast (%s): loading it from disk", url, version, exc)
        loaded = loaded or await self._load(url, version, body)
        if not loaded or not self.prove_weights:
            return loaded
        if await self.prover.prove(url, version, path):
            return True
        return await self._load(url, version, body) and await self.prover.prove(url, version, path)

    async def _tensors(self, version: int, path: Path) -> dict:
        if self.distributed.prepared is not None and self.distributed.prepared[0] == version:
            return {}  # made already: prepare keeps them
        return await asyncio.to_thread(proof.load_tensors, path)

    def figures(self) -> dict:
        """The step's weight figures: ``weights_verified``, engines whose checksum proved the
        latest version; ``weight_mismatches`` and ``weight_fallbacks`` so far."""
        latest = self.latest[0] if self.latest else None
        return {
            "weights_verified": sum(v == latest for v in self.prover.verified.values()),
            "weight_mismatches": self.prover.mismatches,
            "weight_fallbacks": self.fallbacks,
        }

    async def _post(self, url: str, endpoint: str, body: dict) -> tuple[int, object]:
        """POST ``body`` to an admin ``endpoint`` of ``url``: its status and JSON reply. A refused
        key (401/403) raises ``AdminKeyError``: no retry, a wrong key stays wrong."""
        async with self.session.post(url.rstrip("/") + endpoint, json=body, headers=self.headers) as resp:
            if resp.status in (401, 403):
                problem = "not the engine's --admin-api-key" if self.headers else "unset, and the engine requires one"
                raise admin_key.AdminKeyError(
                    f"engine {url} refused {endpoint} with HTTP {resp.status}: the trainer's "
                    f"admin key ({admin_key.KEY_ENV} or {admin_key.KEY_FILE_ENV}) is {problem}"
                )
            return resp.status, await resp.json(content_type=None)

    async def _control(self, url: str, endpoint: str, body: dict, version: int) -> bool:
        """/pause_generation or /continue_generation, tried ``attempts`` times; whether it was done.
        A pause that fails leaves the update to drain; a continue that fails leaves the engine to
        the watchdog of ``centerline sglang``."""
        for attempt in range(1, self.attempts + 1):
            try:
                status, reply = await self._post(url, endpoint, body)
                if status == 200:
                    return True
                problem = f"HTTP {status}: {reply}"
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            log.warning(
                "engine %s: %s for version %d failed (attempt %d/%d): %s",
                url,
                endpoint,
                version,
                attempt,
                self.attempts,
                problem,
            )
            if attempt < self.attempts:
                await asyncio.sleep(0.5 * attempt)  # back-off between retries
        return False

    async def _load(self, url: str, version: int, body: dict) -> bool:
        for attempt in range(1, self.attempts + 1):
            try:
                status, reply = await self._post(url, "/update_weights_from_disk", body)
                if status == 200 and isinstance(reply, dict) and reply.get("success"):
                    return True
                problem = f"HTTP {status}: {reply}"
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
                # Draining, SGLang finishes the generations in flight before it loads: a timed-out or
                # broken-off call may still have been carried out. The engine's own word decides.
                if await self.serves_within_settle(url, version):
                    return True
            log.warning(
                "engine %s did not load version %d (attempt %d/%d): %s", url, version, attempt, self.attempts, problem
            )
            if attempt < self.attempts:
                await asyncio.sleep(0.5 * attempt)  # back-off between retries
        log.error("engine %s keeps serving old weights; its batches will be rejected as stale", url)
        return False

    async def serves_within_settle(self, url: str, version: int) -> bool:
        """Whether ``url`` reports serving ``version`` within ``settle`` seconds, asked every
        second; False at once when it does not answer (a dead engine carries nothing out)."""
        deadline = asyncio.get_running_loop().time() + self.settle
        while True:
            serving = await self.serving(url)
            if serving == str(version):
                return True
            if serving is None or asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(1.0)  # polling interval of the engine's own report

    async def serving(self, url: str) -> str | None:
        """The weight version ``url`` reports on /model_info, None when it cannot be asked."""
        try:
            info = await self._get(url, "/model_info")
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return None
        return info.get("weight_version") if isinstance(info, dict) else None

    async def _get(self, url: str, endpoint: str):
        """GET an ``endpoint`` of ``url`` with the key (a server with only --api-key wants it on
        /model_info too): its JSON reply."""
        timeout = aiohttp.ClientTimeout(total=30)
        async with self.session.get(url.rstrip("/") + endpoint, headers=self.headers, timeout=timeout) as resp:
            return await resp.json(content_type=None)

    async def close(self, grace: float = 5.0) -> None:
        """Close the engines' HTTP session, once the last event is announced, failed to be, or
        ``grace`` seconds passed (NATS down while stopping: a stop must not wait out the publish's
        retries; the next start announces the version it loads)."""
        try:
            if self.announcing is not None:
                done, _ = await asyncio.wait({self.announcing}, timeout=grace)
                if not done:
                    self.announcing.cancel()
                    await asyncio.wait({self.announcing}, timeout=1.0)
                    log.warning("the last weights version was not announced within %gs of stopping (NATS down?)", grace)
        finally:
            if self.distributed is not None:
                await self.distributed.close()
            await self.session.close()


def served_version(reported: str | None) -> int | None:
    """An engine's /model_info ``weight_version`` as a number: SGLang's ``"default"`` (its
    initial weights) is version 0; None for no answer or a version this trainer did not write."""
    if reported is None:
        return None
    if reported == INITIAL_VERSION:
        return 0
    try:
        return int(reported)
    except ValueError:
        return None
