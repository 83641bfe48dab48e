"""The rollout worker loop: prompt task in, candidate batches out, ack last.

    fetch task (PROMPTS, durable `rollout_workers`) -> n samples through the proxy -> rewards
    -> GRPO advantages -> one batch for the group -> check_batch -> publish (dedup by
    batch_id) -> ack

A task is acked only after JetStream acked every batch of it, so a worker killed at any
point loses nothing: the task is redelivered after ``ack_wait`` and sampled again as a new
attempt, whose batches carry their own ``batch_id``; the trainer trains one whole attempt of
each task and drops the others (docs/design.md section 10). While a task runs longer than
``ack_wait / 2`` the worker sends in-progress acks so the task is not handed to a second
worker meanwhile.

Failures, and what happens to the task:
- transient (the proxy or upstream unreachable, HTTP 5xx including the proxy's 502 audit
  verdict, a publish without PubAck): NAK with a delay, so another attempt, maybe on
  another worker, can succeed once the cause is gone;
- a publish JetStream refuses for a full store (``StoreFull``: ROLLOUTS at its byte cap, or the
  server's store used up): the same NAK with a delay, logged as "store full" and counted as
  ``store_full``; the task comes back until ``max_deliver``, then JetStream's advisory names it
  (docs/design.md section 3);
- the task's own ack lost (NATS restarting): logged; the task comes back, is sampled again as
  the next attempt, and the trainer drops that attempt's batch as ``duplicate_attempt``;
- deterministic (a task that does not parse, a request the proxy refuses with 400, a reward
  function that fails, a packed batch that breaks the contract, an environment past
  ``environment_timeout``, a sample above ``max_sample_bytes``, an upstream answer above the
  proxy's cap): TERM, after logging the reason and publishing to ``rollouts.dlq``,
  with the reason in headers, the batch that breaks the contract (the task instead where the
  batch exceeds ``max_payload``), else the task. Redelivering these would fail the same way
  forever and block the queue;
- anything else raised while the task runs (a defect: a template that cannot render, a K
  mismatch): the same, the exception's type and message the reason, counted as ``error``.
  If the dead letter cannot be stored (NATS unreachable), the task is NAKed instead, so it comes
  back and is dead-lettered then.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import nats.errors
import numpy as np

from rollout_worker.environment import play_sessions
from rollout_worker.failures import Rejected, Transient
from rollout_worker.packing import Trajectory, pack_trajectories, samples_from_arrays
from rollout_worker.proxy_call import post
from rollout_worker.publish import HEADER_ROOM, PayloadTooLargeError, publish_batch
from rollout_worker.request import chat_training_body, training_body
from rollout_worker.rewards import RewardError, Scorer, group_advantages
from shared import faults, names
from shared.config import Config
from shared.contract import ContractViolation, check_batch
from shared.nats_auth import redact
from shared.nats_client import PublishError, PullConsumer, StoreFull, connect, pull_consumer
from shared.response_arrays import ResponseArrays
from shared.settings import WorkerSettings
from shared.streams import ensure_streams
from shared.task import PromptTask, TaskError
from shared.wire import REWARD_COMPONENTS, encode_batch

log = logging.getLogger("centerline.worker")


@dataclass
class Tokenizer:
    """The two encodings the worker needs; built from an HF tokenizer by ``main``."""

    encode: object  # (prompt: str) -> list[int]
    encode_chat: object  # (prompt: str | messages) -> list[int], chat template with a generation prompt
    chat: object = None  # the HF tokenizer itself: its chat template renders a session's messages


@dataclass
class Outcome:
    batches: list = field(default_factory=list)
    rewards: np.ndarray | None = None
    tokens: int = 0
    # sessions: the prompt tokens of turns 2 and later, and of them those SGLang's prefix cache served
    later_turns_cache: tuple[int, int] = (0, 0)


def served_prompt_ids(arrays: ResponseArrays) -> list[int]:
    """The prompt ids SGLang sampled a chat response on (``choices[0].prompt_token_ids``, asked
    for by the proxy with ``return_prompt_token_ids``); the worker's own rendering of the chat
    template may differ from the server's."""
    if arrays.prompt_ids is None:
        raise Rejected(
            "the chat response carries no prompt_token_ids (the router dropped return_prompt_token_ids?), so the "
            "prompt SGLang sampled on is unknown; use --rollout-endpoint generate or a router that keeps it"
        )
    return arrays.prompt_ids


class Worker:
    def __init__(self, cfg: Config, settings: WorkerSettings, tokenizer: Tokenizer, metrics=None):
        """``settings`` whole, as ``main`` resolved them: ``worker_id`` (written into every batch) and
        ``vocab_size`` (the contract check's) set."""
        if settings.worker_id is None or settings.vocab_size is None:
            raise ValueError("Worker needs settings with worker_id and vocab_size resolved (rollout_worker/main.py)")
        self.cfg, self.settings, self.tok, self.metrics = cfg, settings, tokenizer, metrics
        self.sampling = cfg.rollout.sampling  # what every batch records
        self.stopping = asyncio.Event()
        self.scorer = Scorer(settings.reward_threads, settings.reward_timeout)  # rewards off the event loop
        self.session: aiohttp.ClientSession | None = None
        self.nc = self.js = self.consumer = None

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Consume until ``stopping`` is set, then finish (or NAK) what is in flight and close."""
        self.nc = await connect(self.cfg.services.nats_url, name=f"centerline-worker-{self.settings.worker_id}")
        self.js = self.nc.jetstream()
        await ensure_streams(self.js)
        self.consumer: PullConsumer = await pull_consumer(
            self.js,
            names.PROMPTS_STREAM,
            names.WORKERS_CONSUMER,
            filter_subject=names.PROMPTS_SUBJECT,
            ack_wait=self.settings.ack_wait,
            max_deliver=self.settings.max_deliver,
            shared=True,
        )
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout, sock_connect=10)
        )
        log.info(
            "worker ready",
            extra={
                "fields": {
                    "producer": self.settings.worker_id,
                    "proxy": self.cfg.services.proxy_url,
                    "nats": redact(self.cfg.services.nats_url),
                }
            },
        )
        inflight: set[asyncio.Task] = set()
        try:
            while not self.stopping.is_set():
                if len(inflight) >= self.settings.concurrency:
                    await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                msgs = await self.consumer.fetch(1, timeout=1.0)
                for msg in msgs:
                    if self.stopping.is_set():  # fetched while stopping: give it straight back
                        await msg.nak()
                        continue
                    task = asyncio.create_task(self.handle(msg))
                    inflight.add(task)
                    task.add_done_callback(inflight.discard)
            if inflight:
                _, late = await asyncio.wait(inflight, timeout=self.settings.shutdown_grace)
                for task in late:  # each NAKs its message when cancelled
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
        finally:
            await self.session.close()
            await self._close_nats()
            self.scorer.close()  # queued reward calls dropped; a running one finishes (no thread can be killed)
        log.info("worker stopped", extra={"fields": {"producer": self.settings.worker_id}})

    async def _close_nats(self) -> None:
        """Unsubscribe, flush the NAKs and TERMs (plain publishes), close. With NATS unreachable
        this fails, and giving up loses nothing: a task not acked comes back after ``ack_wait``."""
        try:
            # not drain(): nats-py's drain waits forever on a pull subscription's queue
            await self.consumer.close()
            await self.nc.flush(timeout=5)
        # whatever the cause, the server has what it has
        except Exception as exc:  # noqa: BLE001
            log.warning(
                "NATS unreachable while stopping; tasks not acked come back after ack_wait",
                extra={"fields": {"reason": repr(exc)}},
            )
        try:
            await self.nc.close()
        # nats-py re-raises the reset of a connection it was still retrying
        except Exception:  # noqa: BLE001
            pass

    # ------------------------------------------------------------------ one task

    async def handle(self, msg) -> None:
        started = time.perf_counter()
        try:
            task = PromptTask.from_bytes(msg.data)
            attempt = task.attempt(msg.metadata.num_delivered)  # numbers its publication reserved
        except TaskError as exc:
            await self._term(msg, None, f"invalid task: {exc}")
            return
        beat = asyncio.create_task(self._heartbeat(msg))
        try:
            outcome = await self.process(task, attempt=attempt)
            for batch in outcome.batches:
                # a fault test kills the worker here: some parts of the attempt stored, the others not
                between = functools.partial(faults.hit, "worker.between_parts", batch.attempt)
                await publish_batch(
                    self.js,
                    batch,
                    max_payload=self.nc.max_payload,
                    between=between,
                    max_sample_bytes=self.cfg.rollout.max_sample_bytes,
                )
            acked = await self._ack(msg, task, outcome)
        except asyncio.CancelledError:
            await msg.nak()  # shutting down: hand the task to another worker now
            self._count("nak")
            raise
        except Transient as exc:
            log.warning("task will be retried", extra={"fields": {"task_id": task.task_id, "reason": str(exc)}})
            await msg.nak(delay=self.retry_delay(msg))
            self._count("nak")
            return
        except PayloadTooLargeError as exc:  # the same task samples the same sizes again: once, by name
            await self._term(msg, task, str(exc))
            return
        # a full store (StoreFull) frees as the trainer trains: later, by name, up to max_deliver
        except (PublishError, nats.errors.Error) as exc:
            full = isinstance(exc, StoreFull)
            fields = {"task_id": task.task_id, "reason": str(exc), "retry_in_s": self.retry_delay(msg)}
            why = "store full" if full else "publish failed"
            log.warning("%s, task will be retried", why, extra={"fields": fields})
            await msg.nak(delay=self.retry_delay(msg))
            self._count(StoreFull.rule if full else "nak")
            return
        except Rejected as exc:
            await self._term(msg, task, str(exc), exc.batch)
            return
        # a defect meets every delivery alike: looping to max_deliver would only hide it (docs/design.md section 12)
        except Exception as exc:  # noqa: BLE001
            reason = f"unexpected {type(exc).__name__} in the worker: {exc}"
            await self._term(msg, task, reason, outcome="error", exc_info=exc)
            return
        finally:
            beat.cancel()
        if not acked:
            return
        latency = time.perf_counter() - started
        versions = [b.weight_version for b in outcome.batches]
        fields = {
            "task_id": task.task_id,
            "purpose": task.purpose,  # "heldout": sampled alike, scored by the trainer, never trained
            "samples": int(outcome.rewards.size),
            "tokens": outcome.tokens,
            "reward_mean": float(outcome.rewards.mean()),
            "weight_version": versions[0] if len(versions) == 1 else versions,
            "batches": [b.batch_id for b in outcome.batches],
            "latency_s": round(latency, 4),
        }
        log.info("task done", extra={"fields": fields})
        if self.metrics is not None:
            self.metrics.done(outcome, latency)

    def retry_delay(self, msg) -> float:
        """Seconds before a task that failed for a passing reason comes back: ``nak_delay``,
        doubled per delivery up to 60 s, so ``max_deliver`` deliveries span minutes of an
        outage rather than seconds."""
        return min(self.settings.nak_delay * 2 ** (msg.metadata.num_delivered - 1), 60.0)

    async def _ack(self, msg, task: PromptTask, outcome: Outcome) -> bool:
        """Ack the task, its batches stored. A lost ack (NATS restarting or unreachable) is no
        error: the task comes back after ``ack_wait`` as the next attempt, whose batch the
        trainer drops as another attempt of a task it trains once (docs/design.md section 10)."""
        try:
            await PullConsumer.ack(msg)
            return True
        # every way an ack fails ends in the same redelivery
        except Exception as exc:  # noqa: BLE001
            fields = {"task_id": task.task_id, "batches": [b.batch_id for b in outcome.batches], "reason": repr(exc)}
            log.warning("task ack lost; its batches are stored, the task will come back", extra={"fields": fields})
            self._count("ack_lost")
            return False

    async def _heartbeat(self, msg) -> None:
        """In-progress acks every half ack_wait: the consumer's as the server has it now (a
        worker started later with another ``--ack-wait`` sets it for all), or this worker's own
        where that is shorter or the server does not answer. The first as the work begins: the
        task may have waited for this worker since its delivery started the server's clock."""
        while True:
            await msg.in_progress()
            on_server = await self.consumer.ack_wait()
            await asyncio.sleep(min(self.settings.ack_wait, on_server or self.settings.ack_wait) / 2)

    async def _term(
        self, msg, task: PromptTask | None, reason: str, batch=None, outcome: str = "rejected", exc_info=None
    ) -> None:
        """Dead-letter and TERM: the batch that breaks the contract, else the task as delivered (one
        that does not parse, a request SGLang refuses, a hung environment, a defect), the reason in headers."""
        kind, data = "task", bytes(msg.data)
        if batch is not None:
            encoded = encode_batch(batch)
            if len(encoded) <= self.nc.max_payload - HEADER_ROOM:
                kind, data = "batch", encoded
            else:  # one message cannot hold it; the task, sampled again, makes it again
                reason += f" (the batch, {len(encoded)} bytes, exceeds max_payload: its task is dead-lettered instead)"
        task_id = task.task_id if task else None
        log.error("task rejected", extra={"fields": {"task_id": task_id, "reason": reason}}, exc_info=exc_info)
        headers = {
            "Centerline-Reason": reason[:1000],
            "Centerline-Producer": self.settings.worker_id,
            "Centerline-Stage": "worker",
            "Centerline-Kind": kind,
        }
        try:
            await self.js.publish(names.DLQ_SUBJECT, data, headers=headers)
        # however the publish fails, a TERM now would drop the task unrecorded
        except Exception as exc:  # noqa: BLE001
            log.warning(
                "dead letter not stored; the task comes back to be rejected again",
                extra={"fields": {"task_id": task_id, "reason": repr(exc)}},
            )
            await msg.nak(delay=self.retry_delay(msg))
            self._count("nak")
            return
        await msg.term()
        self._count(outcome)

    def _count(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.tasks.labels(outcome).inc()

    async def process(self, task: PromptTask, attempt: int = 1) -> Outcome:
        """Sample the group (``attempt``: the task's delivery), score it, pack it as one batch and check
        it: a prompt's ``task.n`` responses, or ``task.n`` sessions of the task's environment, each one
        trajectory of the batch. Raises ``Transient`` or ``Rejected``."""
        cache, components = (0, 0), {}
        if task.environment:  # multi-turn sessions driven by the task's environment
            trajectories, rewards, cache = await self.sample_sessions(task)
        else:
            trajectories, rewards, components = await self.sample_responses(task)
        advantages = group_advantages(rewards, std_norm=self.cfg.loss.advantage_std_norm)
        producer = self.settings.worker_id
        batch = pack_trajectories(
            task, trajectories, rewards, advantages, attempt=attempt, producer=producer, sampling=self.sampling
        )
        if len(components) > 1:  # each component's group mean, for the step's metrics (trainer_service/commit.py)
            means = {name: float(np.mean(values)) for name, values in components.items()}
            batch = dataclasses.replace(batch, extra={**batch.extra, REWARD_COMPONENTS: means})
        try:
            check_batch(batch, vocab_size=self.settings.vocab_size)
        except ContractViolation as exc:
            raise Rejected(f"batch {batch.batch_id!r} breaks the contract ({exc.rule}): {exc}", batch) from None
        return Outcome([batch], rewards, int(batch.loss_mask.sum()), later_turns_cache=cache)

    async def sample_responses(self, task: PromptTask) -> tuple[list[Trajectory], np.ndarray, dict[str, list[float]]]:
        """``task.n`` responses to the prompt, one request through the proxy, each scored by the task's reward
        (off the event loop: ``rollout_worker/rewards.py``); and each reward component's values."""
        chat = self.cfg.rollout.endpoint == "chat"
        messages = task.meta.get("messages")  # a chat row's (centerline/up/user_task.py): its template renders them
        if messages:
            prompt_ids = self.tok.encode_chat(messages)
        else:
            prompt_ids = self.tok.encode_chat(task.prompt) if chat else self.tok.encode(task.prompt)
        path = "/v1/chat/completions" if chat else "/generate"
        url = self.cfg.services.proxy_url.rstrip("/") + path
        arrays = await post(self.session, url, self.request_body(task, prompt_ids))
        if chat:  # SGLang renders the chat template itself: train on what it sampled on
            prompt_ids = served_prompt_ids(arrays)
        samples = samples_from_arrays(arrays)
        if len(samples) != task.n:
            raise Transient(f"the proxy returned {len(samples)} samples for n={task.n}")
        aborted = [i for i, s in enumerate(samples) if s.finish_reason == "abort"]
        if aborted:  # cut off (a server stopping, requests aborted): sample the group again
            raise Transient(f"samples {aborted} were aborted by SGLang (finish_reason abort)")
        try:
            scores = await self.scorer.score(task, [s.text for s in samples])
        except RewardError as exc:
            raise Rejected(str(exc)) from None
        return [Trajectory.of_sample(prompt_ids, s) for s in samples], scores.total, scores.components

    async def sample_sessions(self, task: PromptTask) -> tuple[list[Trajectory], np.ndarray, tuple[int, int]]:
        """``task.n`` sessions of the task's environment (``rollout_worker/environment.py``), each with
        the reward it returned; and the prompt tokens of their turns 2 and later, with those SGLang's
        prefix cache served."""
        # a fault test kills the worker here, between two turns of a session (@step: the turn arriving)
        between = functools.partial(faults.hit, "worker.between_turns")
        deadline = self.settings.environment_deadline(self.cfg)
        timeout = self.settings.request_timeout
        transport = self.settings.session_transport
        played = await play_sessions(
            self.cfg, self.session, self.tok.chat, task, task.n, timeout, between, deadline, transport
        )
        caches = [c for c in (s.later_turns_cache() for s, _ in played) if c is not None]
        cache = (sum(p for p, _ in caches), sum(c for _, c in caches))
        return [s.trajectory() for s, _ in played], np.asarray([r for _, r in played], np.float64), cache

    def request_body(self, task: PromptTask, prompt_ids: list[int]) -> dict:
        """The training request; the proxy adds the log-prob fields of the contract."""
        if self.cfg.rollout.endpoint == "chat":
            return chat_training_body(self.cfg, task.meta.get("messages") or task.prompt, task.n)
        return training_body(self.cfg, prompt_ids, task.n)
