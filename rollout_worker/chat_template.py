"""The chat template a session renders with (docs/design.md section 12): the tokenizer's, or the
run's ``--rollout-chat-template`` in its place, its text <-> ids, what it writes after an assistant
message, and the parsers of its replies (``rollout_worker/tool_calls.py``).

A template that fails to render raises ``SessionTemplateError``: the template is the model's code,
and it renders the same on every attempt.
"""

from __future__ import annotations

import functools
import json

from rollout_worker.failures import Rejected
from rollout_worker.session_errors import SessionTemplateError
from rollout_worker.tool_calls import ReplyParser
from shared.config import Config


class ChatTemplate:
    """The chat template (the tokenizer's, or ``source`` in its place), its text <-> ids, and the
    parsers of its replies (``parser``; none: replies are text), as a session uses them."""

    def __init__(self, tokenizer, source: str | None = None, parser: ReplyParser | None = None):
        self.tok, self.source = tokenizer, source
        self.parser = parser or ReplyParser()
        self.specials = set(tokenizer.all_special_ids)
        # What the template writes right after an assistant message's content (ChatML: "<|im_end|>\n").
        mark = "\u2063centerline\u2063"
        shown = tokenizer.apply_chat_template(
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": mark}],
            tokenize=False,
            **self._source(),
        )
        self.closing = shown.split(mark)[-1] if mark in shown else ""

    @classmethod
    def for_run(cls, tokenizer, cfg: Config) -> ChatTemplate:
        """The run's: ``--rollout-chat-template`` (a file) or the tokenizer's own, with the parsers
        ``--rollout-tool-call-parser`` and ``--rollout-reasoning-parser`` name (``auto`` resolved from
        the template, once per worker); ``Rejected`` naming the setting where there is none to use."""
        return _for_run(
            tokenizer, cfg.rollout.chat_template, cfg.rollout.tool_call_parser, cfg.rollout.reasoning_parser
        )

    def _source(self) -> dict:
        return {"chat_template": self.source} if self.source is not None else {}

    def render(self, messages: list[dict], tools: list | None = None, variables: dict | None = None) -> str:
        """The conversation rendered with a generation prompt; ``variables`` go to the template as
        they are (a request's ``chat_template_kwargs``)."""
        kwargs = {**(variables or {}), **({"tools": tools} if tools else {}), **self._source()}
        shown = [_for_template(m) for m in messages]
        try:
            return self.tok.apply_chat_template(shown, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as exc:  # the template is the model's code: any failure of it is the template's
            raise SessionTemplateError(
                f"the chat template cannot render the conversation: {type(exc).__name__}: {exc}"
            ) from exc

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


@functools.lru_cache(maxsize=8)
def _for_run(tokenizer, path: str | None, tool_setting: str, reasoning_setting: str) -> ChatTemplate:
    if path is not None:
        try:
            source = open(path, encoding="utf-8").read()
        except OSError as exc:
            raise Rejected(
                f"--rollout-chat-template: cannot read {path!r}: {exc}; give a Jinja template file"
            ) from None
    else:
        source = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        if not isinstance(source, str) or not source:
            raise Rejected(
                "the worker's tokenizer has no chat template (one template string) for a session; give one with "
                "--rollout-chat-template FILE"
            )
    parser = ReplyParser(tool_setting, reasoning_setting, source, tokenizer)
    return ChatTemplate(tokenizer, source if path is not None else None, parser)


def _for_template(message: dict) -> dict:
    """``message`` as the template gets it: each call's ``arguments``, a JSON string in OpenAI's shape,
    as the object it encodes (what Hugging Face templates render: docs/design.md section 12)."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        return message
    shown = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        try:
            decoded = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            decoded = None
        shown.append({**call, "function": {**function, "arguments": decoded}} if isinstance(decoded, dict) else call)
    return {**message, "tool_calls": shown}
