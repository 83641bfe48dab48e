"""NATS names used by every service (docs/design.md section 3): the one place they are spelled.

A stream name is upper case, its subject is ``<area>.<what>``; a durable consumer name says
who consumes. Change a name here and every producer and consumer follows.
"""

from __future__ import annotations

PROMPTS_STREAM = "PROMPTS"  # work queue: one task = one prompt group, to exactly one worker
PROMPTS_SUBJECT = "prompts.tasks"

ROLLOUTS_STREAM = "ROLLOUTS"  # candidate batches (wire format v2, docs/design.md section 4), kept for replay
ROLLOUTS_SUBJECT = "rollouts.batches"

DLQ_STREAM = "ROLLOUTS_DLQ"  # rejected batches, unchanged bytes, reason in headers
DLQ_SUBJECT = "rollouts.dlq"

WEIGHTS_STREAM = "WEIGHTS"  # last value only: {version, path, sha256}
WEIGHTS_SUBJECT = "weights.updated"

AUDIT_STREAM = "AUDIT"  # one event per audited proxy request
AUDIT_SUBJECT = "audit.proxy"

ADVISORIES_STREAM = "ADVISORIES"  # JetStream's own reports of messages given up on: nothing vanishes unseen
# A message delivered max_deliver times without an ack, and one a consumer terminated (AckTerm).
ADVISORIES_SUBJECTS = ("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>", "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.>")

# Durable pull consumers. All rollout workers share one, which is what makes PROMPTS a work queue.
WORKERS_CONSUMER = "rollout_workers"
TRAINER_CONSUMER = "trainer"

# JetStream deduplicates on this header within the stream's duplicate window; its value is the batch_id.
MSG_ID_HEADER = "Nats-Msg-Id"
