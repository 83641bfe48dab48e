"""The two ways a task fails, by what happens to it (docs/design.md section 10): ``Transient``, NAKed
to be sampled again later, and ``Rejected``, dead-lettered and TERMed (``rollout_worker/worker.py``)."""

from __future__ import annotations


class Transient(RuntimeError):
    """A failure worth another attempt later (NAK)."""


class Rejected(RuntimeError):
    """A failure that would repeat on every attempt (TERM); ``batch`` is the offending batch if any."""

    def __init__(self, message: str, batch=None):
        super().__init__(message)
        self.batch = batch
