"""A session reply's tool calls and reasoning, parsed from the sampled text by SGLang's own parsers
(docs/design.md section 12).

    sampled text -> ReasoningParser (--rollout-reasoning-parser): reasoning_content, the rest
    -> FunctionCallParser (--rollout-tool-call-parser), when the request offers tools: the calls,
       content without their markup (None when empty, as OpenAI answers)

Nothing here parses by hand: the parsers are ``sglang.srt.function_call`` and
``sglang.srt.parser.reasoning_parser``, and ``auto`` is SGLang's own detection from the chat
template (``sglang.srt.parser.template_detection``), with one addition: a template that writes
``<tool_call>`` and that SGLang names no parser for (Qwen2.5's, Hermes', the toy model's) is hermes.

A call that does not parse is data, not a failure of the turn: the reply is answered as text (the
sampled text, markup included) with the failure named (``ParsedReply.error``), and counted. The
failures, by code: ``tool_call_cut`` (markup in a reply cut by max_tokens), ``tool_call_unparsed``
(the parser finds markup and no call: bad JSON, a broken tag), ``tool_call_unknown_function`` (a
call to a function the request did not offer).
"""

from __future__ import annotations

import functools
import logging
import uuid
from dataclasses import dataclass, field

from pydantic import ValidationError

log = logging.getLogger("centerline.worker")

AUTO, NONE = "auto", "none"


class ParserSettingError(ValueError):
    """A parser setting that names no parser SGLang has; the message names the flag and the choices."""


@dataclass(frozen=True)
class ToolCallError:
    """Why a reply's call markup was answered as text: ``code`` (module docstring) and a message."""

    code: str
    message: str

    def answer(self) -> dict:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True)
class ParsedReply:
    """A reply as the chat endpoint answers it."""

    content: str | None  # None for a reply that calls tools and says nothing else
    reasoning: str | None = None  # the think block, with a reasoning parser
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's shape: id, type, function.name/arguments
    error: ToolCallError | None = None


def tool_call_parser_names() -> list[str]:
    from sglang.srt.function_call.parser_names import TOOL_CALL_PARSER_NAMES

    return TOOL_CALL_PARSER_NAMES


def reasoning_parser_names() -> list[str]:
    from sglang.srt.parser.reasoning_parser_names import REASONING_PARSER_NAMES

    return REASONING_PARSER_NAMES


def check_setting(flag: str, value: str, names) -> None:
    """``names`` is called only for a value other than auto and none (it imports SGLang)."""
    if value not in (AUTO, NONE) and value not in names():
        raise ParserSettingError(
            f"{flag}: is {value!r}; use auto, none or one of SGLang's parsers: {', '.join(names())}"
        )


def resolve_tool_call_parser(template: str, tokenizer, setting: str) -> str | None:
    """The tool-call parser for a model whose chat template is ``template``: the setting's own name,
    None for ``none``, and for ``auto`` SGLang's detection, else hermes for a template that writes
    ``<tool_call>``, else None; logs what ``auto`` chose."""
    check_setting("--rollout-tool-call-parser", setting, tool_call_parser_names)
    if setting != AUTO:
        return None if setting == NONE else setting
    from sglang.srt.parser import template_detection as detection

    forced, toggle = detection.detect_reasoning_pattern(template)
    chosen = detection.detect_tool_call_parser(template, tokenizer, toggle, forced)
    if chosen is None and "<tool_call>" in template:
        chosen = "hermes"
    _log_auto("--rollout-tool-call-parser", chosen, "a request with tools is refused")
    return chosen


def resolve_reasoning_parser(template: str, tokenizer, setting: str) -> str | None:
    """The reasoning parser, as ``resolve_tool_call_parser`` resolves the tool-call one (``auto``:
    SGLang's detection only)."""
    check_setting("--rollout-reasoning-parser", setting, reasoning_parser_names)
    if setting != AUTO:
        return None if setting == NONE else setting
    from sglang.srt.parser import template_detection as detection

    forced, toggle = detection.detect_reasoning_pattern(template)
    chosen = detection.detect_reasoning_parser(template, tokenizer, toggle, forced)
    _log_auto("--rollout-reasoning-parser", chosen, "a think block stays in content")
    return chosen


def _log_auto(flag: str, chosen: str | None, without: str) -> None:
    if chosen is not None:
        log.info(f"{flag} auto chose {chosen!r} from the chat template", extra={"fields": {"parser": chosen}})
    else:
        log.warning(
            f"{flag} auto found no parser for the chat template: {without}; set {flag} NAME",
            extra={"fields": {"parser": None}},
        )


def offered_tools(tools: list[dict]) -> list:
    """The request's tools as SGLang's ``Tool``; ``ValueError`` naming the first that is not one."""
    from sglang.srt.entrypoints.openai.protocol import Tool

    out = []
    for i, tool in enumerate(tools):
        try:
            out.append(Tool.model_validate(tool))
        except ValidationError as exc:
            raise ValueError(f"tools[{i}] is not a function tool: {exc}") from None
    return out


class ReplyParser:
    """The run's parsers for the chat template ``template``: the settings (a name, auto or none) are
    resolved on first use, so a run that never offers tools never imports SGLang;
    ``ParserSettingError`` then for a name SGLang does not have."""

    def __init__(self, tool_setting: str = NONE, reasoning_setting: str = NONE, template: str = "", tokenizer=None):
        self.settings, self.template, self.tokenizer = (tool_setting, reasoning_setting), template, tokenizer

    @functools.cached_property
    def tool_parser(self) -> str | None:
        return resolve_tool_call_parser(self.template, self.tokenizer, self.settings[0])

    @functools.cached_property
    def reasoning_parser(self) -> str | None:
        return resolve_reasoning_parser(self.template, self.tokenizer, self.settings[1])

    def refusal(self, with_tools: bool) -> str | None:
        """Why a turn cannot be answered as asked (a parser setting SGLang does not have; tools, and no
        tool-call parser), or None."""
        try:
            if with_tools and self.tool_parser is None:
                return (
                    "tools: the run has no tool-call parser for this model's chat template (--rollout-tool-call-parser "
                    "none, or auto found none), so no call could be answered; set --rollout-tool-call-parser NAME "
                    '(hermes, qwen25, llama3, mistral, pythonic, ...), or send tool_choice "none" for text replies'
                )
            self.reasoning_parser  # noqa: B018  resolved here: a bad name is refused before anything is sampled
        except ParserSettingError as exc:
            return str(exc)
        return None

    def parse(self, text: str, tools: list | None, finish: str) -> ParsedReply:
        """``text`` (a reply as sampled, less its end-of-turn token) split into reasoning, content and
        tool calls; ``tools`` are the request's (SGLang's ``Tool``), None when it offers none or asks
        for none (``tool_choice`` none); ``finish`` is SGLang's ("stop", "length")."""
        reasoning = None
        if self.reasoning_parser is not None:
            from sglang.srt.parser.reasoning_parser import ReasoningParser

            reasoning, text = ReasoningParser(self.reasoning_parser, stream_reasoning=False).parse_non_stream(text)
            reasoning = reasoning or None
        if not tools or self.tool_parser is None:
            return ParsedReply(text, reasoning)
        from sglang.srt.environ import envs
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        parser = FunctionCallParser(tools, self.tool_parser)
        if not parser.has_tool_call(text):
            return ParsedReply(text, reasoning)
        if finish == "length":
            return ParsedReply(text, reasoning, error=_cut(self.tool_parser))
        # a call to a function not offered comes back with tool_index -1 (else SGLang drops it unseen)
        with envs.SGLANG_FORWARD_UNKNOWN_TOOLS.override(True):
            normal, calls = parser.parse_non_stream(text)
        if not calls:
            return ParsedReply(text, reasoning, error=_unparsed(self.tool_parser))
        offered = [t.function.name for t in tools]
        unknown = [c.name for c in calls if c.name not in offered]
        if unknown:
            return ParsedReply(text, reasoning, error=_unknown(unknown, offered))
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.parameters},
            }
            for c in calls
        ]
        return ParsedReply(normal or None, reasoning, tool_calls)


def _cut(parser: str) -> ToolCallError:
    return ToolCallError(
        "tool_call_cut",
        f"the reply holds {parser} tool-call markup and was cut by max_tokens (finish_reason length); answered as "
        "text: raise max_tokens (or --rollout-max-new-tokens) for replies that call tools",
    )


def _unparsed(parser: str) -> ToolCallError:
    return ToolCallError(
        "tool_call_unparsed",
        f"the {parser} parser found tool-call markup in the reply and parsed no call from it (bad JSON or a broken "
        "tag); answered as text",
    )


def _unknown(names: list, offered: list[str]) -> ToolCallError:
    return ToolCallError(
        "tool_call_unknown_function",
        f"the reply calls {', '.join(repr(n) for n in names)}, not among the request's tools "
        f"({', '.join(offered) or 'none'}); answered as text",
    )
