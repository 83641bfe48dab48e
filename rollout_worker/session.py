"""A multi-turn chat session, token in, token out (docs/design.md section 12).

An environment talks to the model in OpenAI chat messages; SGLang samples tokens. A session
keeps the two in step: it holds every token id so far (the first prompt as the chat template
renders it, each sampled token, each later message as the template renders it) and, per token,
whether SGLang sampled it (loss mask 1), its candidate row, its sampled log-prob and the weight
version that sampled it. The tokens trained are exactly the tokens SGLang returned.

Each turn gets the whole conversation, as chat clients send it:

    messages -> its prefix must be the session's history (the messages rendered so far and the
    replies the session returned): else SessionHistoryError
    -> the template renders the whole conversation; its text must extend the text of the tokens
    held: else SessionTemplateError; only the new suffix is tokenized, nothing is re-tokenized, and
    the tokens held plus the suffix's must decode to the whole rendering (checked in context: a
    tokenizer that puts a dummy prefix space before each piece it encodes fails here)
    -> native /generate with input_ids = tokens held + the suffix's (the caller's ``generate``)
    -> the sampled ids appended; the reply is their text, decoded in context, less the end-of-turn token,
    split into reasoning, content and tool calls by SGLang's parsers (``rollout_worker/tool_calls.py``)

The history holds each reply as the endpoint answered it (``tool_calls``, ``reasoning_content``
included, a null content left out), so an assistant message sent back as the ``openai`` client's
``model_dump()`` gives it compares equal; the template renders it, and a template that renders a past
call or think block differently from what was sampled fails the template check like any other
rewriting of the past (docs/design.md section 12).

The text held is always what the ids held decode to. A refusal (``rollout_worker/session_errors.py``)
is ``fatal`` (the task cannot be trained: SessionTemplateError, SessionRequestError,
UnsupportedSettingError) or recoverable (the environment may go on or finish: SessionHistoryError,
SessionBudgetError). The template, its text <-> ids and its reply parsers are
``rollout_worker/chat_template.py``.

Budgets, each with its own finish: a turn samples at most ``max_new_tokens`` (finish "length");
a turn that could take the session past ``budget`` tokens is not run (SessionBudgetError,
``finish`` "session_budget"): the session ends after its last complete turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from rollout_worker.chat_template import ChatTemplate
from rollout_worker.failures import Transient
from rollout_worker.packing import Sample, Trajectory, samples_from_arrays
from rollout_worker.session_errors import (
    SessionBudgetError,
    SessionError,
    SessionHistoryError,
    SessionRequestError,
    SessionTemplateError,
    UnsupportedSettingError,
)
from rollout_worker.tool_calls import ParsedReply
from shared.response_arrays import ResponseArrays

Generate = Callable[[list[int], int, list[str] | None], Awaitable[ResponseArrays]]
# Tokens of context a decode check takes before what is new (docs/design.md section 12): the text near a
# point depends on a few tokens before it (a UTF-8 character split over byte tokens, a prefix space), not on
# the whole history, so a turn decodes O(new) tokens; where the window disagrees, the whole history decides.
DECODE_CONTEXT = 8
# A turn's stages, each in seconds, in ``Session.turn_stages`` (``SessionChat`` adds "endpoint").
STAGES = ("history", "render", "tokenize", "generate", "reply")


@dataclass(frozen=True)
class Reply:
    """One turn's answer, as the chat endpoint returns it."""

    parsed: ParsedReply  # content, reasoning, tool calls, a call's parse failure
    finish_reason: str  # "stop" | "length" | "tool_calls" (a call parsed)
    prompt_tokens: int  # the input of this turn's /generate
    completion_tokens: int

    @property
    def content(self) -> str | None:
        return self.parsed.content

    def message(self) -> dict:
        """The answer's ``message``; what the session holds of it, nulls left out, is ``history_message``."""
        out = {"role": "assistant", "content": self.parsed.content}
        if self.parsed.reasoning is not None:
            out["reasoning_content"] = self.parsed.reasoning
        if self.parsed.tool_calls:
            out["tool_calls"] = self.parsed.tool_calls
        return out

    def history_message(self) -> dict:
        return {name: value for name, value in self.message().items() if value is not None}


def message_key(message) -> dict:
    """A message as the history compares it: its fields without nulls, text parts joined (what
    an OpenAI client sends back of a reply: ``refusal: null`` and the like are no difference)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise SessionRequestError(f"messages: a message must be an object with a role, found {str(message)[:200]}")
    out = {name: value for name, value in message.items() if value is not None}
    content = out.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise UnsupportedSettingError(
                f"messages: content parts other than text are not supported, found {str(content)[:200]}; send text"
            )
        out["content"] = "".join(texts)
    return out


class Session:
    """One trajectory of chat turns; ``generate(input_ids, max_new_tokens, stop)`` samples one turn
    (the audited response as arrays) through the proxy (the worker's: ``ProxyTurn.generate``,
    ``rollout_worker/environment.py``). ``between_turns(n)``, if given, runs as
    turn ``n`` (2 and later) arrives, before anything of it is done (a worker's failpoint)."""

    def __init__(
        self,
        session_id: str,
        template: ChatTemplate,
        generate: Generate,
        *,
        k: int,
        budget: int,
        between_turns: Callable[[int], None] | None = None,
    ):
        self.id, self.template, self.generate, self.k, self.budget = session_id, template, generate, k, budget
        self.between_turns = between_turns
        self.messages: list[dict] = []  # the history: messages rendered so far and the replies returned
        self.text = ""  # what the tokens held decode to: the template text they stand for
        self.prompt_len = 0  # the first turn's prompt tokens
        self.turn_prompt_tokens: list[int] = []  # per turn: its /generate's input tokens
        self.turn_cached_tokens: list[int | None] = []  # per turn: of those, served from SGLang's prefix cache
        self.turn_stages: list[dict[str, float]] = []  # per complete turn: seconds in each of STAGES
        self.ids: list[int] = []
        self._mask: list[np.ndarray] = []
        self._versions: list[np.ndarray] = []
        self._sampled: list[np.ndarray] = []
        self._cand_ids: list[np.ndarray] = []
        self._cand_logprobs: list[np.ndarray] = []
        self.turns = 0
        self.finish: str | None = None  # "session_budget" once a turn was refused for the budget
        self.last_finish = "stop"  # the last complete turn's finish_reason
        self.tool_calls = 0  # calls parsed from its replies
        self.tool_call_parse_errors = 0  # replies whose call markup did not parse (answered as text)
        self._lock = asyncio.Lock()  # one turn at a time: a concurrent one fails the history check

    async def turn(
        self,
        messages: list,
        *,
        max_new_tokens: int,
        stop: list[str] | None = None,
        tools: list | None = None,
        variables: dict | None = None,
        call_tools: list | None = None,
    ) -> Reply:
        """One turn; ``tools`` and ``variables`` (``chat_template_kwargs``) go to the chat template, and
        the reply is parsed for calls to ``call_tools`` (SGLang's ``Tool``; None: no calls parsed)."""
        async with self._lock:
            return await self._turn(messages, max_new_tokens, stop, tools, variables, call_tools)

    async def _turn(self, messages, max_new_tokens, stop, tools, variables, call_tools) -> Reply:
        if self.turns and self.between_turns is not None:
            self.between_turns(self.turns + 1)
        if self.finish is not None:
            raise SessionBudgetError(f"session {self.id} has ended ({self.finish}); it takes no more turns")
        clock = time.perf_counter
        t0 = clock()
        given = [message_key(m) for m in messages]
        self.check_history(given)
        refused = self.template.parser.refusal(bool(call_tools))
        if refused is not None:
            raise UnsupportedSettingError(refused)
        t1 = clock()
        text = self.template.render(given, tools, variables)
        t2 = clock()
        new_ids = self.extend(text)
        t3 = clock()
        held = len(self.ids)
        if held + len(new_ids) + max_new_tokens > self.budget:
            self.finish = "session_budget"
            raise SessionBudgetError(
                f"session {self.id}: {held} tokens held, {len(new_ids)} for the new messages and up to "
                f"{max_new_tokens} for the reply would pass the session token budget of {self.budget} "
                "(--rollout-session-max-tokens); the session ends after its last complete turn"
            )
        answer = await self.generate(self.ids + new_ids, max_new_tokens, stop)  # its own list: the caller may keep it
        t4 = clock()
        sample = _one_sample(answer)
        sampled = self.decode_after(text, new_ids, sample.response_ids.tolist())
        finish = sample.finish_reason or "stop"
        parsed = self.template.parser.parse(self.reply_text(sample, sampled), call_tools, finish)
        prompt_tokens = held + len(new_ids)
        self.turn_prompt_tokens.append(prompt_tokens)
        self.turn_cached_tokens.append(answer.cached_tokens[0] if answer.cached_tokens else None)
        if not held:
            self.prompt_len = len(new_ids)
        self._append_rendered(new_ids)
        self._append_sampled(sample)
        self.text = text + sampled
        self.turns += 1
        self.last_finish = finish
        self.tool_calls += len(parsed.tool_calls)
        self.tool_call_parse_errors += parsed.error is not None
        reply = Reply(parsed, "tool_calls" if parsed.tool_calls else finish, prompt_tokens, len(sample.response_ids))
        self.messages = [*given, reply.history_message()]
        stamps = (t0, t1, t2, t3, t4, clock())
        self.turn_stages.append({name: stamps[i + 1] - stamps[i] for i, name in enumerate(STAGES)})
        return reply

    def decode_after(self, text: str, new_ids: list[int], sampled: list[int]) -> str:
        """What ``sampled`` decodes to after the tokens held and the turn's ``new_ids`` (which decode to
        ``text``), decoded in context: a piece's leading space (sentencepiece's) shows only after the
        tokens before it. ``DECODE_CONTEXT`` tokens of context where they decode alike with and
        without the reply; the whole conversation where they do not, which refuses a tokenizer whose
        decoding of the past changes."""
        context = (self.ids[-DECODE_CONTEXT:] + new_ids)[-DECODE_CONTEXT:]
        if len(context) < len(self.ids) + len(new_ids):
            start, both = self.template.decode(context), self.template.decode(context + sampled)
            if both.startswith(start):
                return both[len(start) :]
        held = self.template.decode(self.ids + new_ids + sampled)
        if not held.startswith(text):
            raise SessionTemplateError(
                f"session {self.id}: the sampled ids change how the conversation before them decodes "
                f"({held[max(0, len(text) - 40) : len(text) + 20]!r}); the tokenizer's decoding is not prefix-stable"
            )
        return held[len(text) :]

    def later_turns_cache(self) -> tuple[int, int] | None:
        """``(prompt tokens, of them served from the prefix cache)`` over turns 2 and later, whose
        history an engine can hold (with session affinity, the engine that sampled it); None before
        turn 2 or where SGLang did not say."""
        cached = self.turn_cached_tokens[1:]
        if not cached or None in cached:
            return None
        return sum(self.turn_prompt_tokens[1:]), sum(cached)

    def check_history(self, given: list[dict]) -> None:
        """The request's messages begin with the session's history and add at least one."""
        for i, (mine, theirs) in enumerate(zip(self.messages, given)):
            if mine != theirs:
                raise SessionHistoryError(
                    f"message {i} differs from the session's history: the session has {str(mine)[:200]}, the request "
                    f"{str(theirs)[:200]}; a session only grows (start a new one for an edited past)"
                )
        if len(given) < len(self.messages):
            raise SessionHistoryError(
                f"the request has {len(given)} messages, the session's history {len(self.messages)}: a past message "
                "was dropped"
            )
        if len(given) == len(self.messages):
            raise SessionHistoryError(f"the request adds no message to the session's {len(given)}")

    def extend(self, text: str) -> list[int]:
        """The ids of what ``text`` (the whole conversation rendered) adds to the text held."""
        if not text.startswith(self.text):
            at = next((i for i, (a, b) in enumerate(zip(self.text, text)) if a != b), min(len(self.text), len(text)))
            raise SessionTemplateError(
                f"session {self.id}: the chat template renders the history differently from the tokens the session "
                f"holds, from character {at}: the session has {self.text[at : at + 60]!r}, the template "
                f"{text[at : at + 60]!r}; the session never re-tokenizes what it sent or received (a template that "
                "rewrites past turns cannot be trained token in, token out)"
            )
        suffix = text[len(self.text) :]
        ids = self.template.encode(suffix)
        # in context, where a dummy prefix space shows: DECODE_CONTEXT tokens of it where they decode
        # alike with the new ids, else the whole history
        context = self.ids[-DECODE_CONTEXT:]
        if (
            len(context) < len(self.ids)
            and self.template.decode(context + ids) == self.template.decode(context) + suffix
        ):
            return ids
        held = self.template.decode(self.ids + ids)
        if held != text:
            at = next((i for i, (a, b) in enumerate(zip(held, text)) if a != b), min(len(held), len(text)))
            raise SessionTemplateError(
                f"session {self.id}: the new messages' rendering {suffix[:80]!r} does not survive tokenization: the "
                f"session's tokens and its ids decode from character {at} to {held[at : at + 60]!r}, the template "
                f"wrote {text[at : at + 60]!r} (a tokenizer that adds a prefix space to each text it encodes, "
                "sentencepiece's dummy prefix as in Llama's, cannot extend a session token by token)"
            )
        return ids

    def reply_text(self, sample: Sample, sampled: str) -> str:
        """The reply's content: the sampled text less a final end-of-turn token, the special token the
        template itself writes after an assistant message's content; any other stays in the reply."""
        ids = sample.response_ids
        if len(ids) and int(ids[-1]) in self.template.specials:
            end = self.template.decode(ids[-1:])
            if self.template.closing.startswith(end) and sampled.endswith(end):
                return sampled[: len(sampled) - len(end)]
        return sampled

    def _append_rendered(self, ids: list[int]) -> None:
        n = len(ids)
        self.ids += ids
        self._mask.append(np.zeros(n, np.uint8))
        self._versions.append(np.zeros(n, np.int32))  # untrained: the staleness rule ignores it
        self._sampled.append(np.zeros(n, np.float32))
        self._cand_ids.append(np.full((n, self.k), -1, np.int32))
        self._cand_logprobs.append(np.full((n, self.k), -np.inf, np.float32))

    def _append_sampled(self, s: Sample) -> None:
        n = len(s.response_ids)
        self.ids += s.response_ids.tolist()
        self._mask.append(np.ones(n, np.uint8))
        self._versions.append(s.versions())  # a turn that spans an update: each token its own version
        self._sampled.append(np.asarray(s.sampled_logprobs, np.float32))
        self._cand_ids.append(np.asarray(s.cand_ids, np.int32))
        self._cand_logprobs.append(np.asarray(s.cand_logprobs, np.float32))

    def trajectory(self) -> Trajectory:
        """The session as one sample: prompt = the first turn's prompt, response = every token
        after it; loss mask 1 exactly on the sampled tokens, empty candidate rows elsewhere."""
        if not self.turns:
            raise SessionError(f"session {self.id} has no turn: there is nothing to train")
        p = self.prompt_len

        def cat(parts: list[np.ndarray], dtype) -> np.ndarray:
            return np.concatenate(parts).astype(dtype, copy=False)[p:]

        return Trajectory(
            prompt_ids=np.asarray(self.ids[:p], np.int32),
            response_ids=np.asarray(self.ids[p:], np.int32),
            sampled_logprobs=cat(self._sampled, np.float32),
            loss_mask=cat(self._mask, np.uint8),
            token_versions=cat(self._versions, np.int32),
            cand_ids=cat(self._cand_ids, np.int32),
            cand_logprobs=cat(self._cand_logprobs, np.float32),
            finish_reason=self.finish or self.last_finish,
            tool_calls=self.tool_calls,
            tool_call_parse_errors=self.tool_call_parse_errors,
        )


def _one_sample(answer: ResponseArrays) -> Sample:
    samples = samples_from_arrays(answer)
    if len(samples) != 1:
        raise Transient(f"the proxy returned {len(samples)} samples for one session turn")
    if samples[0].finish_reason == "abort":  # cut off (a server stopping): the task is sampled again, whole
        raise Transient("the session's turn was aborted by SGLang (finish_reason abort)")
    return samples[0]
