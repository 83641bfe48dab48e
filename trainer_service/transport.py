"""The distributed weight transport: each version broadcast from the trainer to an engine through
SGLang's distributed update, no file read by the engine (docs/design.md section 8).

Per engine, under the pause the publisher already holds (``weights.WeightPublisher``):

    POST /destroy_weights_update_group {group_name}      once: a group a killed trainer left,
    POST /end_weight_update {}                           and the update session it opened
    POST /init_weights_update_group {master_address, master_port, rank_offset: 1, world_size: 2,
                                     group_name, backend}  once, the trainer joining beside it
    POST /begin_weight_update {}
    POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
         load_format: "flattened_bucket", flush_cache, weight_version}   per bucket, the trainer
                                     broadcasting the bucket beside it; the last bucket flushes
                                     and names the version
    POST /end_weight_update {}

SGLang 0.5.23 refuses the update outside the begin/end pair (sglang#28001). Any failure drops
the group at both ends (``/destroy_weights_update_group``), so the next version joins afresh,
and raises ``TransportError``: the publisher then loads the version from disk (the recovery
path). The trainer's side of every collective runs on a thread bounded by ``timeout``; an engine
whose trainer dies mid-broadcast sees its sockets close, fails the call, and is continued by
``centerline sglang``'s watchdog.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import torch

from shared import faults
from trainer_service.broadcast import Bucket, Group, backend_for, buckets, group_name, interface_towards

log = logging.getLogger("centerline.trainer.transport")


class TransportError(RuntimeError):
    """A version did not reach an engine by the distributed transport."""


class Distributed:
    """Sends versions to engines by broadcast. ``post(url, endpoint, body)`` is the publisher's
    admin call (status, JSON reply); ``host`` the address engines reach the trainer at."""

    def __init__(self, post, urls: list[str], *, host: str, bucket_bytes: int, timeout: float, device: str = "cpu"):
        self.post, self.host, self.bucket_bytes, self.timeout, self.device = post, host, bucket_bytes, timeout, device
        self.index = {url: i for i, url in enumerate(urls)}
        self.groups: dict[str, Group] = {}
        self.prepared: tuple[int, list[Bucket]] | None = None

    def prepare(self, version: int, tensors: dict[str, torch.Tensor]) -> list[Bucket]:
        """The version's buckets, made once for every engine."""
        if self.prepared is None or self.prepared[0] != version:
            self.prepared = (version, buckets(tensors, self.bucket_bytes, self.device))
        return self.prepared[1]

    async def send(self, url: str, version: int, parts: list[Bucket]) -> None:
        """Broadcast ``parts`` to ``url`` as weight version ``version``; raises ``TransportError``."""
        try:
            group = await self._join(url)
            await self._call(url, "/begin_weight_update", {})
            for i, bucket in enumerate(parts):
                last = i == len(parts) - 1
                body = {
                    "names": bucket.names,
                    "dtypes": bucket.dtypes,
                    "shapes": bucket.shapes,
                    "group_name": group.group_name,
                    "load_format": "flattened_bucket",
                    "flush_cache": last,
                    "weight_version": str(version) if last else None,
                }
                await self._beside(group.send, bucket, self._call(url, "/update_weights_from_distributed", body))
                if i == 0:
                    faults.hit("trainer.broadcast", version)
            await self._call(url, "/end_weight_update", {})
        except TransportError:
            await self.drop(url)
            raise
        except Exception as exc:  # HTTP, gloo/NCCL, timeouts: the group is not trusted any more
            await self.drop(url)
            raise TransportError(f"engine {url}: {type(exc).__name__}: {exc}") from exc

    async def _join(self, url: str) -> Group:
        if url in self.groups:
            return self.groups[url]
        name = group_name(self.index[url])
        # What a killed trainer left: its group, and the update session it opened (SGLang refuses a
        # begin while one is open). An engine without either answers 400, which is fine.
        await self.post(url, "/destroy_weights_update_group", {"group_name": name})
        await self.post(url, "/end_weight_update", {})
        interface = interface_towards(urlsplit(url).hostname or "")
        group = Group(self.host, backend_for(self.device), self.timeout, name, interface)
        body = {
            "master_address": self.host,
            "master_port": group.port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": name,
            "backend": group.backend,
        }
        try:
            await self._beside(group.join, None, self._call(url, "/init_weights_update_group", body))
        except BaseException:
            group.close()
            raise
        self.groups[url] = group
        log.info(
            "engine %s joined weight group %s (%s, port %d, interface %s)",
            url,
            name,
            group.backend,
            group.port,
            interface or "gloo's own",
        )
        return group

    async def _beside(self, collective, arg, call) -> None:
        """The HTTP ``call`` and the trainer's side of its ``collective`` together. A failed call
        still waits for the thread, which ends by the group's own ``timeout`` at the latest, so
        no collective runs on in a group being destroyed."""
        args = () if arg is None else (arg,)
        thread = asyncio.ensure_future(asyncio.to_thread(collective, *args))
        try:
            await asyncio.wait_for(call, self.timeout)
        finally:
            await asyncio.wait([thread])
            thread.exception()  # retrieved here; raised below when the call itself succeeded
        thread.result()  # the collective's own error, if the call succeeded without it

    async def _call(self, url: str, endpoint: str, body: dict) -> dict:
        status, reply = await self.post(url, endpoint, body)
        if status != 200 or not (isinstance(reply, dict) and reply.get("success")):
            raise TransportError(f"engine {url}: {endpoint} answered HTTP {status}: {reply}")
        return reply

    async def drop(self, url: str) -> None:
        """Forget ``url``'s group at both ends (the engine's side best effort: it may be gone)."""
        group = self.groups.pop(url, None)
        if group is None:
            return
        try:
            await self.post(url, "/destroy_weights_update_group", {"group_name": group.group_name})
        except Exception as exc:  # noqa: BLE001 (a dead engine: its group went with it)
            log.warning("engine %s: weight group %s not destroyed: %s", url, group.group_name, exc)
        group.close()

    async def close(self) -> None:
        for url in list(self.groups):
            await self.drop(url)
