"""A prompt task on `prompts.tasks`: one prompt group, handed to exactly one rollout worker.

JSON (orjson) rather than msgpack: tasks are small, and people read them in `nats` tools
and in recorded segments. ``task_id`` is also the task's ``Nats-Msg-Id``, so the trainer
re-publishing a task after a crash is deduplicated by JetStream.

One sampling, one attempt number (docs/design.md section 10): each publication of a task
reserves its own ``ATTEMPT_BLOCK`` attempt numbers, from ``attempts_before + 1``; a worker's
attempt is ``attempts_before`` plus the message's delivery. The trainer chooses
``attempts_before`` so that no two publications share one (``trainer_service/tasks.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import orjson

ATTEMPT_BLOCK = 1000  # attempt numbers one publication reserves: its deliveries 1 to 999
# What a task is for: "train", a group the trainer may train; "heldout", one sample of a held-out row that the
# trainer scores for the held-out figure and never trains (docs/design.md section 9).
PURPOSES = ("train", "heldout")


class TaskError(ValueError):
    """A task message that is not a valid prompt task; the message names the field."""


@dataclass(frozen=True, slots=True)
class PromptTask:
    task_id: str  # unique; f"{run_id}/{step}/{index}" from the trainer's task publisher (trainer_service/tasks.py)
    group_id: str  # the GRPO group every sample of this task belongs to
    prompt: str  # the text the policy continues (chat template already applied if any)
    answer: str  # what the reward function compares against
    reward: str  # reward function: a built-in name or "module:function"
    n: int  # samples to draw for the group
    step: int  # trainer step the task was published for (staleness accounting)
    meta: dict = field(default_factory=dict)  # task-specific extras passed to the reward function
    # "module:function": an environment that drives n multi-turn sessions and returns each one's reward
    # (rollout_worker/environment.py); "" samples the prompt n times and scores each with ``reward``
    environment: str = ""
    # the attempt numbers this publication reserved start after this one (trainer_service/tasks.py); a worker's
    # attempt is this plus the message's delivery (``attempt``)
    attempts_before: int = 0
    purpose: str = "train"  # one of PURPOSES; a worker samples both alike

    def attempt(self, delivery: int) -> int:
        """The attempt number of this message's ``delivery`` (1 the first); ``TaskError`` past the
        deliveries its publication reserved, which would take the next publication's numbers."""
        if not 1 <= delivery < ATTEMPT_BLOCK:
            raise TaskError(
                f"delivery {delivery} of task {self.task_id!r} is past the {ATTEMPT_BLOCK - 1} its publication "
                "reserved attempt numbers for (docs/design.md section 10); the task is given up, as by --max-deliver"
            )
        return self.attempts_before + delivery

    def to_bytes(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> PromptTask:
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise TaskError(f"task is not JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise TaskError(f"task is {type(doc).__name__}, expected an object")
        kinds = {"task_id": str, "group_id": str, "prompt": str, "answer": str, "reward": str, "n": int, "step": int}
        for name, kind in kinds.items():
            if not isinstance(doc.get(name), kind) or isinstance(doc.get(name), bool):
                raise TaskError(f"task field {name!r} is {doc.get(name)!r}, expected {kind.__name__}")
        if doc["n"] < 1:
            raise TaskError(f"task field 'n' is {doc['n']}, expected >= 1")
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise TaskError(f"task field 'meta' is {type(meta).__name__}, expected an object")
        environment = doc.get("environment", "")
        if not isinstance(environment, str):
            raise TaskError(f"task field 'environment' is {environment!r}, expected a string ('module:function')")
        before = doc.get("attempts_before", 0)
        if not isinstance(before, int) or isinstance(before, bool) or before < 0:
            raise TaskError(f"task field 'attempts_before' is {before!r}, expected a whole number >= 0")
        purpose = doc.get("purpose", "train")
        if purpose not in PURPOSES:
            raise TaskError(f"task field 'purpose' is {purpose!r}, expected one of {', '.join(map(repr, PURPOSES))}")
        return cls(
            **{name: doc[name] for name in kinds},
            meta=meta,
            environment=environment,
            attempts_before=before,
            purpose=purpose,
        )
