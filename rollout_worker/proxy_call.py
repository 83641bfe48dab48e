"""The worker's one call to the proxy: a training request in, the audited answer as arrays out, and
every other answer mapped to what happens to the task (docs/design.md section 7).

A plain prompt's group is one request (native /generate or /v1/chat/completions), a session's turn
one native /generate with the session's routing key. The worker asks for the binary answer
(``shared/response_arrays.py``): the proxy parsed SGLang's JSON once, to audit it, and nothing is
parsed here.
"""

from __future__ import annotations

import aiohttp
import orjson

from rollout_worker.failures import Rejected, Transient
from shared import response_arrays
from shared.msgpack_arrays import WireError
from shared.response_arrays import ResponseArrays

ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # smg 0.3.2's session affinity key (docs/sglang.md)
# The proxy's rules for an answer cut short by the engine's context length or KV pool (router_proxy/audit.py).
ENGINE_LIMITS = ("length_clipped", "prompt_over_engine_limit")


async def post(http: aiohttp.ClientSession, url: str, body: dict, routing_key: str | None = None) -> ResponseArrays:
    """``body`` sent to ``url`` (the proxy's), its audited answer as arrays; with ``routing_key``, a
    router that routes by key keeps the session on one engine. Raises ``Transient`` for what another
    attempt may not meet (the proxy or upstream unreachable, HTTP 5xx including the proxy's 502 audit
    verdict, an answer that is not arrays) and ``Rejected`` for a request refused as such (400, 413,
    422), an answer above the proxy's cap (502 ``upstream_too_large``) or cut short by the engine's
    context length or KV pool (502 ``ENGINE_LIMITS``): asking again cannot help."""
    headers = {"Content-Type": "application/json", "Accept": response_arrays.MEDIA_TYPE}
    if routing_key is not None:
        headers[ROUTING_KEY_HEADER] = routing_key
    try:
        async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
            status, answer = resp.status, await resp.read()
            ctype, verdict = resp.content_type, resp.headers.get("X-Centerline-Audit")
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise Transient(f"{url}: {exc!r}") from None
    if status in (400, 413, 422):
        raise Rejected(f"the proxy refused the request with {status}: {answer[:1000].decode(errors='replace')}")
    rule = _rule(answer) if status == 502 else ""
    if rule == "upstream_too_large":  # the same request makes the same answer again
        raise Rejected(
            f"the proxy cut off an upstream answer above its --max-upstream-response-bytes: "
            f"{answer[:1000].decode(errors='replace')}; raise it on the proxy, or lower --rollout-max-new-tokens, "
            "--rollout-n or K"
        )
    if rule in ENGINE_LIMITS:  # the engine cannot hold this prompt and its budget: every attempt meets the same
        raise Rejected(f"the proxy refused the engine's answer: {answer[:1000].decode(errors='replace')}")
    if status != 200:
        raise Transient(f"{url} answered {status}: {answer[:500].decode(errors='replace')}")
    if ctype != response_arrays.MEDIA_TYPE:  # an observe-mode proxy passing a response it could not read
        raise Transient(
            f"{url} answered {ctype}, not {response_arrays.MEDIA_TYPE} (audit verdict: {verdict}); the worker "
            "reads only the binary answer of a centerline proxy"
        )
    try:
        return response_arrays.decode(answer)
    except WireError as exc:
        raise Transient(f"unusable response from the proxy: {exc}") from None


def _rule(answer: bytes) -> str:
    """The rule of the proxy's error answer ``{"error": {"rule": ...}}``, or ""."""
    try:
        error = orjson.loads(answer).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return ""
    return error.get("rule", "") if isinstance(error, dict) else ""
