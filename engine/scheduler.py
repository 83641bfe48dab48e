"""The continuous-batching loop: one worker thread owns the model and the running batch.

Each iteration: admit waiting sequences (up to `max_batch_size`, each prefilled alone),
run one decode forward over the running batch, sample every row together
(`sampling.sample_rows`), finish the sequences that stopped and resolve their futures.
A weight update is applied only between requests: while one is pending no new sequence
is admitted, and it runs once the batch has drained, so every token of a response comes
from one weight version. HTTP handlers never touch the model; they `submit` and await.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.batch import DecodeBatch, prefill
from engine.sampling import RowResult, SamplingSpec, sample_rows

log = logging.getLogger("centerline.engine")


@dataclass
class Sequence:
    """One generation: its inputs, stopping rules and everything it produced."""

    rid: str
    prompt_ids: list[int]
    spec: SamplingSpec
    max_new_tokens: int
    stop_token_ids: set[int]  # finish with {"type": "stop"} on these (EOS included unless ignore_eos)
    stop_strings: list[str] = field(default_factory=list)
    input_logprob_start: int = -1  # >= 0: also report prompt log-probs from this position
    options: object = None  # how the HTTP layer renders the response; opaque here
    output_ids: list[int] = field(default_factory=list)
    rows: list[RowResult] = field(default_factory=list)
    input_rows: list[RowResult | None] = field(default_factory=list)
    finish_reason: dict | None = None
    weight_version: str = ""
    started: float = field(default_factory=time.perf_counter)
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class WeightUpdate:
    load: Callable[[], object]  # builds the new model (runs in the worker thread)
    version: str
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Scheduler:
    def __init__(self, model, weight_version: str, max_batch_size: int, decode: Callable[[list[int]], str]):
        self.model = model
        self.weight_version = weight_version
        self.max_batch_size = max_batch_size
        self.decode = decode
        self.waiting: deque[Sequence] = deque()
        self.updates: deque[WeightUpdate] = deque()
        self.running: list[Sequence] = []
        self.batch: DecodeBatch | None = None
        self.wake = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.wake:
            self.stopped = True
            self.wake.notify()
        self.thread.join(timeout=10)

    def submit(self, seqs: list[Sequence]) -> list[concurrent.futures.Future]:
        with self.wake:
            self.waiting.extend(seqs)
            self.wake.notify()
        return [s.future for s in seqs]

    def update_weights(self, load: Callable[[], object], version: str) -> concurrent.futures.Future:
        update = WeightUpdate(load, version)
        with self.wake:
            self.updates.append(update)
            self.wake.notify()
        return update.future

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self.wake:
                    while not (self.stopped or self.waiting or self.updates or self.running):
                        self.wake.wait()
                    if self.stopped:
                        return
                    update = self.updates.popleft() if self.updates and not self.running else None
                    admit = []
                    if update is None and not self.updates:
                        while self.waiting and len(self.running) + len(admit) < self.max_batch_size:
                            admit.append(self.waiting.popleft())
                try:
                    if update is not None:
                        self._apply(update)
                    else:
                        self._step(admit)
                except Exception as exc:  # a failed step fails its requests, never the loop
                    log.exception("engine step failed")
                    for seq in self.running + admit:
                        if not seq.future.done():
                            seq.future.set_exception(exc)
                    self.running, self.batch = [], None

    def _apply(self, update: WeightUpdate) -> None:
        try:
            self.model = update.load()
            self.weight_version = update.version
            update.future.set_result(None)
        except Exception as exc:
            update.future.set_exception(exc)

    def _step(self, admit: list[Sequence]) -> None:
        logits = [self.batch.step(self.model)] if self.running else []
        joined: list[tuple[Sequence, DecodeBatch | None]] = []
        for seq in admit:
            seq.weight_version = self.weight_version
            part, seq_logits = prefill(self.model, seq.prompt_ids, seq.input_logprob_start >= 0)
            if seq.input_logprob_start >= 0:
                seq.input_rows = self._prompt_rows(seq, seq_logits)
            if seq.max_new_tokens == 0:
                seq.finish_reason = {"type": "length", "length": 0}
                self._finish(seq)
                continue
            logits.append(seq_logits[-1:])
            joined.append((seq, part))
        rows = self.running + [seq for seq, _ in joined]
        if not rows:
            return
        results = sample_rows(torch.cat(logits), [s.spec for s in rows])
        alive = [self._advance(seq, row) for seq, row in zip(rows, results)]
        tokens = [row.token for row in results]

        n_old = len(self.running)
        parts = []
        if self.batch is not None and n_old:
            self.batch.set_last(tokens[:n_old])
            if not all(alive[:n_old]):
                self.batch.keep([i for i in range(n_old) if alive[i]])
            if self.batch.size:
                parts.append(self.batch)
        for j, (seq, part) in enumerate(joined):
            if alive[n_old + j]:
                part.set_last([tokens[n_old + j]])
                parts.append(part)
        self.running = [seq for seq, ok in zip(rows, alive) if ok]
        self.batch = DecodeBatch.merge(parts) if parts else None

    def _advance(self, seq: Sequence, row: RowResult) -> bool:
        """Record one sampled token; finish the sequence if it stopped. True = keep going."""
        seq.output_ids.append(row.token)
        seq.rows.append(row)
        if row.token in seq.stop_token_ids:
            seq.finish_reason = {"type": "stop", "matched": row.token}
        elif seq.stop_strings and (hit := self._stop_string(seq)) is not None:
            seq.finish_reason = {"type": "stop", "matched": hit}
        elif len(seq.output_ids) >= seq.max_new_tokens:
            seq.finish_reason = {"type": "length", "length": seq.max_new_tokens}
        else:
            return True
        self._finish(seq)
        return False

    def _stop_string(self, seq: Sequence) -> str | None:
        text = self.decode(seq.output_ids)
        return next((s for s in seq.stop_strings if s in text), None)

    def _prompt_rows(self, seq: Sequence, logits: torch.Tensor) -> list[RowResult | None]:
        """Log-probs of prompt tokens from `input_logprob_start` (the first has none)."""
        start = seq.input_logprob_start
        temps = torch.tensor(seq.spec.temperature, dtype=logits.dtype)
        logprobs = torch.log_softmax(logits[:-1] / temps, dim=-1)  # position i predicts token i+1
        rows: list[RowResult | None] = [None] if start == 0 else []
        k = min(seq.spec.top_logprobs_num, logits.shape[-1])
        for pos in range(max(start, 1), len(seq.prompt_ids)):
            token = seq.prompt_ids[pos]
            row = RowResult(token=token, logprob=float(logprobs[pos - 1, token]))
            if k > 0:
                vals, ids = torch.topk(logprobs[pos - 1], k)
                row.top_ids, row.top_logprobs = ids.tolist(), vals.tolist()
            rows.append(row)
        return rows

    def _finish(self, seq: Sequence) -> None:
        if not seq.future.done():
            seq.future.set_result(seq)
