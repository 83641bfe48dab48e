"""The OpenAI chat-completions shapes of a session's turn, both ways (docs/design.md section 12):
the request a turn takes (``parse_request``), the answer it gives (``completion``) and the error
it answers with (``error_body``), whichever transport carries them
(``rollout_worker/session_transport.py``).

The run's sampling is the one trained on, and a session answers one sampled reply at a time, so every
field of OpenAI's chat-completions request is one of:

- honoured: ``messages``, ``model`` (echoed), ``max_tokens`` / ``max_completion_tokens`` (capped by
  the run's), ``stop``, ``tools`` and ``chat_template_kwargs`` (both go to the chat template; the
  reply is parsed for calls to the tools: ``rollout_worker/tool_calls.py``), ``tool_choice`` (``auto``,
  ``none``: the reply is text, or one named function: only calls to it are parsed; nothing is forced);
- a setting the run fixes (``temperature``, ``top_p``, ``top_k``): accepted at the run's value;
- accepted at its neutral value only (``NEUTRAL_ONLY``; the sampler's own settings at
  ``shared/sampling.py``'s ``NEUTRAL``), refused by name at any other;
- no effect on what is sampled (``NO_EFFECT``: who calls, what to cache): accepted as it is.

Any other field is refused by name: nothing a request says is silently ignored.

The answer is OpenAI's ``chat.completion``: ``choices[0].message`` (``content``, ``tool_calls``,
``reasoning_content``), ``finish_reason``, ``usage`` with ``prompt_tokens_details.cached_tokens``
where SGLang said, and ``choices[0].tool_call_error`` for a call that did not parse. An error is
``{"error": {"message", "type", "code", "param"}}``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import orjson

from rollout_worker.session import Reply
from rollout_worker.session_errors import SessionRequestError, UnsupportedSettingError
from rollout_worker.tool_calls import offered_tools
from shared.config import Config
from shared.sampling import NEUTRAL, Sampling

_DISTRIBUTION = "it changes the distribution the run samples and trains on"
_TOOLS = "the endpoint parses the calls the model samples and forces none (constrained decoding " + _DISTRIBUTION + ")"
_TEXT = "the session's replies are text sampled by the run's model"

# field: (its accepted values besides unset, why any other is refused)
NEUTRAL_ONLY: dict[str, tuple[tuple, str]] = {
    "n": ((1,), "a session's turn is one reply"),
    **{name: ((value,), _DISTRIBUTION) for name, value in NEUTRAL.items()},
    "min_tokens": ((0,), _DISTRIBUTION),
    "ignore_eos": ((False,), _DISTRIBUTION),
    "logit_bias": (({},), _DISTRIBUTION),
    "response_format": (({"type": "text"},), "structured output is constrained decoding, " + _DISTRIBUTION),
    "seed": ((), "the run samples with the engine's own randomness"),
    "logprobs": ((False,), "the endpoint answers no log-probs (the trainer gets the sampled ones with each token)"),
    "top_logprobs": ((0,), "the endpoint answers no log-probs (the trainer gets the top-K rows with each token)"),
    "stream": ((False,), "a session's turn is answered whole"),
    "stream_options": ((), "a session's turn is answered whole"),
    "function_call": (("auto", "none"), _TOOLS),
    "parallel_tool_calls": ((True,), _TOOLS),
    "functions": (([],), "send tools (OpenAI's current form), which go to the chat template and are parsed"),
    "reasoning_effort": ((), 'a template that reads it takes it as chat_template_kwargs {"reasoning_effort": ...}'),
    "verbosity": ((), _TEXT),
    "modalities": ((["text"],), _TEXT),
    "audio": ((), _TEXT),
    "prediction": ((), _TEXT),
    "web_search_options": ((), _TEXT),
    "store": ((False,), "the endpoint stores nothing"),
    "service_tier": (("auto", "default"), "the endpoint has one tier"),
}
NO_EFFECT = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_retention"})
HONOURED = frozenset(
    {"messages", "model", "max_tokens", "max_completion_tokens", "stop", "tools", "tool_choice", "chat_template_kwargs"}
)
RUN_SETTINGS = frozenset({"temperature", "top_p", "top_k"})
# apply_chat_template's own arguments, which the endpoint sets: not variables a request may pass
_TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


@dataclass(frozen=True)
class TurnRequest:
    """What a session's turn takes of a chat-completions request."""

    messages: list
    model: str
    max_new_tokens: int  # min(the request's limit, --rollout-max-new-tokens)
    stop: list[str] | None
    tools: list | None  # as sent, for the chat template
    call_tools: list | None  # SGLang's Tool of each function a call in the reply may name; None: parse no calls
    variables: dict  # chat_template_kwargs


def parse_request(raw: bytes, cfg: Config) -> TurnRequest:
    """The turn ``raw`` asks for; ``SessionRequestError`` for a request that is not one,
    ``UnsupportedSettingError`` for a setting the endpoint does not honour, each naming the field."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SessionRequestError(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
        raise SessionRequestError("the body must be an object with a non-empty messages list")
    refuse_settings(body, cfg)
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    if limit is not None and not (_is_int(limit) and limit >= 1):
        raise SessionRequestError(f"max_tokens: is {limit!r}, expected a positive integer")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise SessionRequestError(f"stop: is {stop!r}, expected a string or a list of strings")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise SessionRequestError(f"tools: is {str(tools)[:200]}, expected a list of tool objects")
    try:
        call_tools = offered_tools(tools) if tools else None
    except ValueError as exc:
        raise SessionRequestError(f"tools: {exc}") from None
    variables = body.get("chat_template_kwargs") or {}
    if not isinstance(variables, dict):
        raise SessionRequestError(f"chat_template_kwargs: is {variables!r}, expected an object")
    taken = sorted(_TEMPLATE_ARGUMENTS & variables.keys())
    if taken:
        raise UnsupportedSettingError(
            f"chat_template_kwargs: {taken} are arguments the endpoint sets itself; pass only the template's "
            "own variables (tools as the request's tools)"
        )
    model = body.get("model")
    return TurnRequest(
        messages=body["messages"],
        model=model if isinstance(model, str) and model else "default",
        max_new_tokens=min(limit or cfg.rollout.max_new_tokens, cfg.rollout.max_new_tokens),
        stop=stop,
        tools=tools,
        call_tools=_called(body.get("tool_choice"), call_tools),
        variables=variables,
    )


def _called(choice, tools: list | None) -> list | None:
    """The tools a reply's calls may name under ``tool_choice``: all (``auto``, unset), none (``none``),
    or the one named function; ``required`` and anything else refused by name."""
    if choice is None or choice == "auto":
        return tools
    if choice == "none":
        return None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str):
        named = [t for t in tools or [] if t.function.name == name]
        if not named:
            offered = ", ".join(t.function.name for t in tools or []) or "no tools"
            raise SessionRequestError(
                f"tool_choice: names the function {name!r}, not among the request's tools ({offered})"
            )
        return named
    raise UnsupportedSettingError(
        f"tool_choice: is {str(choice)[:200]}; {_TOOLS} (send auto, none or "
        '{"type": "function", "function": {"name": ...}}, which parses calls to that function only)'
    )


def refuse_settings(body: dict, cfg: Config) -> None:
    """Raise ``UnsupportedSettingError`` (``SessionRequestError`` for a value of the wrong type) for
    the first field of ``body`` the endpoint does not honour at the value it has."""
    for name, value in body.items():
        if value is None or name in HONOURED or name in NO_EFFECT:
            continue
        if name in RUN_SETTINGS:
            _check_run_setting(name, value, cfg.rollout.sampling)
        elif name in NEUTRAL_ONLY:
            accepted, why = NEUTRAL_ONLY[name]
            if not any(_same(value, a) for a in accepted):
                allowed = " or ".join(repr(a) for a in accepted) if accepted else "nothing"
                raise UnsupportedSettingError(
                    f"{name}: is {str(value)[:200]}; {why} (send {allowed}, or leave it unset)"
                )
        else:
            raise UnsupportedSettingError(
                f"{name}: not a chat-completions field this endpoint honours; leave it out "
                "(docs/design.md section 12 lists the fields a session takes)"
            )


def _check_run_setting(name: str, value, run: Sampling) -> None:
    if name == "top_k":
        if not _is_int(value):
            raise SessionRequestError(f"top_k: is {value!r}, expected an integer")
        want = run.top_k
        if (-1 if value in (0, -1) else value) != want:  # 0 and -1 both mean no top-k
            raise UnsupportedSettingError(
                f"top_k: is {value}, the run samples at {want} (--rollout-top-k); {_DISTRIBUTION}"
            )
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SessionRequestError(f"{name}: is {value!r}, expected a number")
    want = getattr(run, name)  # temperature, top_p
    if not math.isclose(value, want, rel_tol=1e-9):
        flag = "--rollout-" + name.replace("_", "-")
        raise UnsupportedSettingError(f"{name}: is {value}, the run samples at {want} ({flag}); {_DISTRIBUTION}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _same(value, accepted) -> bool:
    """``value == accepted``, where True is not 1 and 1.0 is."""
    return isinstance(value, bool) == isinstance(accepted, bool) and value == accepted


def completion(reply: Reply, *, answer_id: str, model: str, cached_tokens: int | None) -> dict:
    """A turn's ``reply`` as OpenAI's ``chat.completion``; ``cached_tokens``: the prompt tokens SGLang's
    prefix cache served (``usage.prompt_tokens_details``, left out where SGLang did not say)."""
    answer = {
        "id": answer_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": reply.message(), "finish_reason": reply.finish_reason, "logprobs": None}],
        "usage": {
            "prompt_tokens": reply.prompt_tokens,
            "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        },
    }
    if reply.parsed.error is not None:  # a call that did not parse: the reply is text, the failure named
        answer["choices"][0]["tool_call_error"] = reply.parsed.error.answer()
    if cached_tokens is not None:
        answer["usage"]["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return answer


def error_body(status: int, message: str, code: str) -> bytes:
    """OpenAI's error object, as the client reads it into ``APIStatusError.code`` and ``.body``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return orjson.dumps({"error": {"message": message, "type": kind, "code": code, "param": None}})
