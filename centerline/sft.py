"""A short supervised warm start of the default model on a toy task (`centerline init-model --sft`).

Teacher forcing on generated train-split examples (``centerline/dataset.py``): the loss covers
the answer bytes and the closing ``<|endoftext|>``, not the prompt. A multi-turn task (``chain``)
is taught in the chat form its sessions take: each example is the whole conversation as the chat
template renders it (``centerline/tokenizer.py``, ChatML), the loss on every assistant reply and
its ``<|im_end|>``, none on the template's or the user's tokens; after each step the user's next
message is the plain "+d" or, one time in three, the true sum restated ("7+5"), the message the
environment sends after a wrong answer. A few hundred AdamW steps
on one CPU thread, deterministic for a seed, so RL starts from a policy whose reward is
non-zero but clearly imperfect. ``evaluate`` measures exact match by sampling at
temperature 1 on held-out prompts, the way rollouts sample. Left out on purpose: learning-rate
schedules, validation-based stopping, anything beyond the toy tasks.

    centerline init-model --sft --task reverse --out runs/model
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from centerline.dataset import CHAT_TASKS, examples
from centerline.tokenizer import EOS, IM_END, IM_START, PAD, SPECIALS
from shared.toy_tasks import chain_turns

EOS_ID = 256 + SPECIALS.index(EOS)
PAD_ID = 256 + SPECIALS.index(PAD)
IM_START_ID = 256 + SPECIALS.index(IM_START)
IM_END_ID = 256 + SPECIALS.index(IM_END)
RESTATED = 1 / 3  # share of later user messages that restate the sum, as after a wrong answer


@dataclass(frozen=True)
class SftSettings:
    """Everything that determines the warm-started weights (recorded beside them for the cache)."""

    task: str
    # "completion": prompt then answer; "chat": the whole conversation in the chat template (CHAT_TASKS).
    # Recorded with the weights, so a model cached before the chat form existed is made again.
    form: str = "completion"
    steps: int = 0  # 0 = the task's default (DEFAULT_STEPS)
    batch_size: int = 32
    learning_rate: float = 3e-3
    weight_decay: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


# Steps that land each task's held-out exact match (temperature 1) between "never" and "always"
# on this model; measured numbers are in the docstring of centerline/model_init.py.
DEFAULT_STEPS = {"copy": 150, "upper": 200, "reverse": 800, "add": 600, "chain": 300}


def resolved(settings: SftSettings) -> SftSettings:
    """``settings`` with ``steps = 0`` replaced by the task's default and the task's form."""
    form = "chat" if settings.task in CHAT_TASKS else "completion"
    return SftSettings(
        **{**settings.to_dict(), "form": form, "steps": settings.steps or DEFAULT_STEPS.get(settings.task, 300)}
    )


def encode(text: str) -> list[int]:
    return list(text.encode())


def conversation(prompt: str, answer: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """A multi-turn example as the chat template renders it and its labels: the ids of every
    assistant reply and its ``<|im_end|>``, -100 elsewhere (what a session trains on)."""
    ids: list[int] = []
    labels: list[int] = []

    def add(tokens: list[int], trained: bool) -> None:
        ids.extend(tokens)
        labels.extend(tokens if trained else [-100] * len(tokens))

    for i, (message, restated, want) in enumerate(chain_turns(prompt, answer)):
        user = message if i == 0 or rng.random() >= RESTATED else restated
        add(([] if i == 0 else encode("\n")) + [IM_START_ID] + encode(f"user\n{user}") + [IM_END_ID], False)
        add(encode("\n") + [IM_START_ID] + encode("assistant\n"), False)
        add(encode(want) + [IM_END_ID], True)
    return ids, labels


def make_batch(
    pairs: list[tuple[str, str]], form: str = "completion", rng: random.Random | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``; labels are -100 except on answer + EOS
    (``form`` "chat": on every assistant reply + ``<|im_end|>``, ``conversation``)."""
    seqs, targets = [], []
    for prompt, answer in pairs:
        if form == "chat":
            ids, labels = conversation(prompt, answer, rng or random.Random(0))
            seqs.append(ids)
            targets.append(labels)
            continue
        p, a = encode(prompt), encode(answer) + [EOS_ID]
        seqs.append(p + a)
        targets.append([-100] * len(p) + a)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, t) in enumerate(zip(seqs, targets)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, : len(t)] = torch.tensor(t)
    return ids, mask, labels


def train(model, settings: SftSettings, seed: int) -> list[float]:
    """Train ``model`` in place; returns the loss of every step. Deterministic for ``seed``
    (one torch thread: float reductions then always run in the same order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(model, settings, seed)
    finally:
        torch.set_num_threads(threads)


def _train(model, settings: SftSettings, seed: int) -> list[float]:
    torch.manual_seed(seed)
    data = examples(settings.task, settings.steps * settings.batch_size, seed, "train")
    rng = random.Random(seed)
    rng.shuffle(data)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    # linear decay to zero: the last steps settle instead of bouncing at the peak rate
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / settings.steps)
    model.train()
    losses = []
    for step in range(settings.steps):
        ids, mask, labels = make_batch(
            data[step * settings.batch_size : (step + 1) * settings.batch_size], settings.form, rng
        )
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


@torch.inference_mode()
def evaluate(model, task: str, n: int = 200, seed: int = 0, temperature: float = 1.0, max_new_tokens: int = 8) -> float:
    """Exact-match rate of ``n`` held-out prompts, one sample each at ``temperature`` (no top-p/top-k)."""
    pairs = examples(task, n, seed, "heldout")
    prompts = [encode(p) for p, _ in pairs]
    width = max(map(len, prompts))
    ids = torch.full((n, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at the last column
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    gen = torch.Generator().manual_seed(seed)
    position = (mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1]
    done = torch.zeros(n, dtype=torch.bool)
    answers: list[list[int]] = [[] for _ in range(n)]
    for _ in range(max_new_tokens):
        probs = torch.softmax(logits.double() / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=gen)[:, 0]
        for i in torch.nonzero(~done).flatten().tolist():
            if token[i] == EOS_ID or token[i] >= 256:
                done[i] = True
            else:
                answers[i].append(int(token[i]))
        if done.all():
            break
        mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
        position = position[:, -1:] + 1
        out = model(
            input_ids=token[:, None], attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True
        )
        cache, logits = out.past_key_values, out.logits[:, -1]
    # an answer counts only if it ended with a special token (the engine stops there too)
    hits = [done[i] and bytes(a).decode(errors="replace") == ans for i, (a, (_, ans)) in enumerate(zip(answers, pairs))]
    return sum(map(bool, hits)) / n


@torch.inference_mode()
def evaluate_chat(model, task: str, n: int = 200, seed: int = 0, temperature: float = 1.0) -> float:
    """A multi-turn task's held-out reward: each of ``n`` held-out conversations played as the
    environment plays it (``shared/toy_tasks.py`` ``chain``), one sample per turn at ``temperature``;
    the mean share of steps answered exactly."""
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for prompt, answer in examples(task, n, seed, "heldout"):
        steps = chain_turns(prompt, answer)
        ids: list[int] = []
        right, ok = 0, True  # ok: the previous step's verdict, which picks the next message
        for i, (message, restated, want) in enumerate(steps):
            user = message if ok else restated
            ids += ([] if i == 0 else encode("\n")) + [IM_START_ID] + encode(f"user\n{user}") + [IM_END_ID]
            ids += encode("\n") + [IM_START_ID] + encode("assistant\n")
            reply: list[int] = []
            for _ in range(8):
                logits = model(input_ids=torch.tensor([ids + reply])).logits[0, -1]
                token = int(torch.multinomial(torch.softmax(logits.double() / temperature, -1), 1, generator=gen))
                reply.append(token)
                if token >= 256:
                    break
            ok = reply[-1] == IM_END_ID and bytes(reply[:-1]).decode(errors="replace") == want
            right += ok
            ids += reply
        total += right / len(steps)
    return total / n
