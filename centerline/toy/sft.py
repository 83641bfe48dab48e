"""A short supervised warm start of the default model on a toy task (`centerline init-model --sft`).

Teacher forcing on generated train-split examples (``centerline/toy/dataset.py``): the loss covers
the answer bytes and the closing ``<|endoftext|>``, not the prompt. A multi-turn task (``chain``)
is taught in the chat form its sessions take: each example is the whole conversation as the chat
template renders it (``centerline/toy/tokenizer.py``, ChatML), the loss on every assistant reply and
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

import functools
import json
import random
from dataclasses import asdict, dataclass

import torch

from centerline.toy.dataset import CHAT_TASKS, examples
from centerline.toy.tokenizer import EOS, IM_END, IM_START, PAD, SPECIALS
from shared.toy_tasks import ADD_TOOL, CALC_ILL_FORMED, CALC_MAX_TOKENS, CALC_TURNS, chain_turns, run_add

EOS_ID = 256 + SPECIALS.index(EOS)
PAD_ID = 256 + SPECIALS.index(PAD)
IM_START_ID = 256 + SPECIALS.index(IM_START)
IM_END_ID = 256 + SPECIALS.index(IM_END)
RESTATED = 1 / 3  # share of later user messages that restate the sum, as after a wrong answer
CALC_DIRECT = 1 / 3  # share of calc examples answered in the head, without the tool


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
# on this model (`centerline init-model --sft --task T --heldout` prints the figure).
DEFAULT_STEPS = {"copy": 150, "upper": 200, "reverse": 800, "add": 600, "chain": 300, "calc": 800}


def resolved(settings: SftSettings) -> SftSettings:
    """``settings`` with ``steps = 0`` replaced by the task's default and the task's form."""
    form = "chat" if settings.task in CHAT_TASKS else "completion"
    return SftSettings(
        **{**settings.to_dict(), "form": form, "steps": settings.steps or DEFAULT_STEPS.get(settings.task, 300)}
    )


def encode(text: str) -> list[int]:
    return list(text.encode())


def chain_conversation(prompt: str, answer: str, rng: random.Random) -> tuple[list[int], list[int]]:
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


@functools.cache
def chat_tokenizer():
    """The default model's tokenizer with its chat template, as the workers render sessions."""
    from transformers import PreTrainedTokenizerFast

    from centerline.toy.tokenizer import CHAT_TEMPLATE, build_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), chat_template=CHAT_TEMPLATE)


def calc_call(prompt: str) -> tuple[str, dict]:
    """The call to ``add`` that a ``calc`` prompt ("347+589=") asks for: its text as the model samples
    it in the hermes format and its arguments."""
    a, b = (int(n) for n in prompt.rstrip("=").split("+"))
    arguments = {"a": a, "b": b}
    return "<tool_call>\n" + json.dumps({"name": "add", "arguments": arguments}) + "\n</tool_call>", arguments


def calc_conversation(prompt: str, answer: str, rng: random.Random) -> tuple[list[int], list[int]]:
    """A ``calc`` session as the chat template renders it with the ``add`` tool offered: the call
    and the answer after the tool's result trained (each with its ``<|im_end|>``), the template's,
    the user's and the tool's tokens not; or, one time in three (``CALC_DIRECT``), the sum answered
    at once, which this model cannot compute: the warm start then calls the tool on some prompts
    only, and RL has a decision to learn (call, then copy the result) besides the copying."""
    tok = chat_tokenizer()
    messages: list[dict] = [{"role": "user", "content": prompt}]

    def render() -> str:
        return tok.apply_chat_template(messages, tools=[ADD_TOOL], tokenize=False, add_generation_prompt=True)

    call, arguments = calc_call(prompt)
    first = render()
    if rng.random() < CALC_DIRECT:  # an answer without the tool: what RL teaches the model to drop
        ids = tok.encode(first, add_special_tokens=False)
        answered = tok.encode(answer + IM_END, add_special_tokens=False)
        return ids + answered, [-100] * len(ids) + answered
    messages.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": "add", "arguments": arguments}}],
        }
    )
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": run_add(json.dumps(arguments))})
    second = render()
    sampled = first + call + IM_END
    if not second.startswith(sampled) or len(tok.encode(call)) + 1 > CALC_MAX_TOKENS:
        raise AssertionError(f"the chat template renders the call of {prompt!r} other than it is sampled")
    ids: list[int] = []
    labels: list[int] = []
    for text, trained in (
        (first, False),
        (call + IM_END, True),
        (second[len(sampled) :], False),
        (answer + IM_END, True),
    ):
        tokens = tok.encode(text, add_special_tokens=False)
        ids.extend(tokens)
        labels.extend(tokens if trained else [-100] * len(tokens))
    return ids, labels


CONVERSATIONS = {"chain": chain_conversation, "calc": calc_conversation}


def make_batch(
    pairs: list[tuple[str, str]], form: str = "completion", rng: random.Random | None = None, task: str = "chain"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask, labels)``; labels are -100 except on answer + EOS
    (``form`` "chat": on every assistant reply + ``<|im_end|>`` of ``task``'s conversation, ``CONVERSATIONS``)."""
    seqs, targets = [], []
    for prompt, answer in pairs:
        if form == "chat":
            ids, labels = CONVERSATIONS[task](prompt, answer, rng or random.Random(0))
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
            data[step * settings.batch_size : (step + 1) * settings.batch_size], settings.form, rng, settings.task
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


@torch.inference_mode()
def evaluate_calc(model, n: int = 200, seed: int = 0, temperature: float = 1.0) -> dict:
    """``calc``'s held-out figures, each of ``n`` held-out sessions played as its environment plays
    them (``shared/toy_tasks.py`` ``calc``): the mean reward and the share of replies with call
    markup that SGLang's hermes parser parses into a call of ``add``."""
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    tok = chat_tokenizer()
    tools = [Tool.model_validate(ADD_TOOL)]
    torch.manual_seed(seed)
    sessions = [([{"role": "user", "content": p}], a) for p, a in examples("calc", n, seed, "heldout")]
    rewards, calls, marked = [0.0] * n, 0, 0
    active = list(range(n))
    for _ in range(CALC_TURNS):
        if not active:
            break
        prompts = [
            tok.apply_chat_template(sessions[i][0], tools=[ADD_TOOL], tokenize=False, add_generation_prompt=True)
            for i in active
        ]
        replies = _sample(model, [tok.encode(p, add_special_tokens=False) for p in prompts], temperature)
        still = []
        for i, (reply, ended) in zip(active, replies):
            text = tok.decode(reply)
            parser = FunctionCallParser(tools, "hermes")
            if not parser.has_tool_call(text):
                rewards[i] = float(ended and text == sessions[i][1])
                continue
            marked += 1
            parsed = parser.parse_non_stream(text)[1] if ended else []
            if not parsed or parsed[0].name != "add":
                rewards[i] = CALC_ILL_FORMED  # answered as text, as the environment scores it
                continue
            calls += 1
            call = {
                "id": "call_0",
                "type": "function",
                "function": {"name": "add", "arguments": json.loads(parsed[0].parameters)},
            }
            sessions[i][0].append({"role": "assistant", "content": None, "tool_calls": [call]})
            sessions[i][0].append({"role": "tool", "tool_call_id": "call_0", "content": run_add(parsed[0].parameters)})
            still.append(i)
        active = still
    return {"heldout_reward_t1": sum(rewards) / n, "well_formed_calls": calls / max(marked, 1)}


def _sample(
    model, prompts: list[list[int]], temperature: float, limit: int = CALC_MAX_TOKENS
) -> list[tuple[list[int], bool]]:
    """One reply per prompt at ``temperature`` (no top-p/top-k), up to ``limit`` tokens, each as its
    ids before the special token that ended it, and whether one did (else it was cut)."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at the last column
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        max_new_tokens=limit,
        eos_token_id=[EOS_ID, IM_END_ID],
        pad_token_id=PAD_ID,
    )[:, width:].tolist()
    replies = []
    for row in out:
        end = next((j for j, t in enumerate(row) if t >= 256), None)
        replies.append((row if end is None else row[:end], end is not None and row[end] in (EOS_ID, IM_END_ID)))
    return replies
