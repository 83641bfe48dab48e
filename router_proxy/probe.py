"""Capability probe: does the upstream return complete candidate sets for the contract?

A canary training request (rewritten exactly as the proxy rewrites real ones) goes through
the upstream for the configured endpoint and mode at the configured K, and its response is
audited with the same code as every proxied response. Each step is a named check; the first
failing one is the cause ("router rejects top_logprobs above 20", "drops
sampling_logprobs_mode/return_sampling_mask", "truncates candidate rows to 20", ...).

    centerline probe --upstream http://127.0.0.1:30001 --k 128 --endpoint generate --mode selected [--json]

exits 0 when compatible, 1 when not (the cause printed), 2 on bad flags. An upstream started
with ``--api-key`` gets ``CENTERLINE_UPSTREAM_API_KEY`` (or the file
``CENTERLINE_UPSTREAM_API_KEY_FILE`` names) as ``Authorization: Bearer``. The vocabulary
size is learned from the upstream before anything is generated (``learn_vocab_size``), and a
K above it fails the probe without a canary: SGLang would take its server down. The proxy runs the
same ``probe`` at start-up and on GET /capabilities, and is ready only when it passes.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from dataclasses import asdict, dataclass, field

import orjson

from router_proxy.audit import audit_body
from router_proxy.rewrite import HARMLESS_DEFAULTS, STATED, Contract, rewrite_body
from router_proxy.sglang_response import response_metas
from router_proxy.upstream import UpstreamPool, upstream_key_from_env
from shared import admin_key
from shared.config import ConfigError, add_arguments, resolve_section
from shared.contract import ContractViolation, k_above_vocab
from shared.settings import ProbeSettings

CANARY_TOKENS = 8
CHAT_TOP_LOGPROBS_CAP = 20  # the PyPI sglang-router rejects chat top_logprobs above this


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class ProbeReport:
    upstream: str
    endpoint: str
    mode: str
    k: int
    vocab_size: int | None = None
    checks: list[Check] = field(default_factory=list)

    @property
    def compatible(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def cause(self) -> str | None:
        return next((c.detail for c in self.checks if not c.ok), None)

    def add(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append(Check(name, ok, detail))
        return ok

    def to_dict(self) -> dict:
        return {**asdict(self), "compatible": self.compatible, "cause": self.cause}

    def table(self) -> str:
        width = max(len(c.name) for c in self.checks)
        head = (
            f"upstream {self.upstream}  endpoint {self.endpoint}  mode {self.mode}  K {self.k}  vocab {self.vocab_size}"
        )
        rows = [f"  {'PASS' if c.ok else 'FAIL'}  {c.name:<{width}}  {c.detail}" for c in self.checks]
        verdict = "COMPATIBLE" if self.compatible else f"INCOMPATIBLE: {self.cause}"
        return "\n".join([head, *rows, verdict])


async def learn_vocab_size(upstream: UpstreamPool) -> int | None:
    """The upstream model's vocabulary size, learned without a request that could harm it;
    None when the upstream cannot tell.

    ``vocab_size`` from /model_info or /get_model_info where an upstream reports it (SGLang
    0.5.23 does not). Else SGLang's own range check of ``token_ids_logprob``: the tokenizer
    manager refuses an id outside ``[0, vocab)`` with 400 before anything is scheduled (the
    scheduler itself never sees it, unlike ``top_logprobs_num`` above the vocabulary, which
    takes the server down). One request with the largest id reads the bound from the message;
    two more confirm it (``vocab - 1`` accepted, ``vocab`` refused), and where the message says
    nothing usable, a bisection over such requests finds it. Every request generates nothing
    (``max_new_tokens`` 0) and passes the SGLang router unchanged.
    """
    for path in (b"/model_info", b"/get_model_info"):
        try:
            status, body, _ = await upstream.request(b"GET", path)
            if status != 200:
                continue
            info = orjson.loads(body)
        except (OSError, orjson.JSONDecodeError):
            continue
        for where in (info, info.get("hf_config"), info.get("config")) if isinstance(info, dict) else ():
            value = where.get("vocab_size") if isinstance(where, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    largest = (1 << 31) - 1
    status, message = await _token_id_accepted(upstream, largest)
    if status is None or status == 200:  # unreachable, or the check is not there: cannot tell
        return None
    found = VOCAB_BOUND.search(message)
    if found and 0 < int(found.group(1)) <= largest:
        vocab = int(found.group(1))
        if (await _token_id_accepted(upstream, vocab - 1))[0] == 200 and (await _token_id_accepted(upstream, vocab))[
            0
        ] == 400:
            return vocab
    low, high = 0, largest  # id `low` is accepted (0 always is), `high` refused
    if (await _token_id_accepted(upstream, 0))[0] != 200:
        return None
    while high - low > 1:
        mid = (low + high) // 2
        status, _ = await _token_id_accepted(upstream, mid)
        if status not in (200, 400):
            return None
        low, high = (mid, high) if status == 200 else (low, mid)
    return high


VOCAB_BOUND = re.compile(r"valid range is \[0, (\d+)\)")


async def _token_id_accepted(upstream: UpstreamPool, token_id: int) -> tuple[int | None, str]:
    """``(status, error message)`` of a generation-free request asking for ``token_id``'s log-prob."""
    body = {
        "input_ids": [0],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "token_ids_logprob": [token_id],
    }
    try:
        status, reply, _ = await upstream.request(
            b"POST", b"/generate", orjson.dumps(body), [(b"content-type", b"application/json")]
        )
    except OSError:
        return None, ""
    return status, reply[:500].decode(errors="replace")


def _unstated_defaults(info_body: bytes) -> list[str]:
    """The server's ``preferred_sampling_params`` (model info) that a training request does not
    state and that change the sampled distribution (``rewrite.HARMLESS_DEFAULTS`` aside)."""
    try:
        info = orjson.loads(info_body)
        preferred = info.get("preferred_sampling_params") if isinstance(info, dict) else None
        if isinstance(preferred, str):
            preferred = orjson.loads(preferred)
    except orjson.JSONDecodeError:
        return []
    if not isinstance(preferred, dict):
        return []
    return sorted(k for k in preferred if k not in STATED and k not in HARMLESS_DEFAULTS)


def canary_body(contract: Contract) -> bytes:
    """A small training request, rewritten to the contract like any proxied one."""
    if contract.endpoint == "chat":
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": CANARY_TOKENS,
            "ignore_eos": True,
        }
        return rewrite_body(orjson.dumps(body), "chat", contract)
    body = {
        "text": "The capital of France is",
        "sampling_params": {"max_new_tokens": CANARY_TOKENS, "ignore_eos": True},
    }
    return rewrite_body(orjson.dumps(body), "generate", contract)


async def probe(upstream: UpstreamPool, contract: Contract, *, vocab_size: int | None = None) -> ProbeReport:
    """Run the canary through ``upstream`` and report each check; stops at the first failure."""
    report = ProbeReport(upstream.url, contract.endpoint, contract.mode, contract.k)
    path = "/v1/chat/completions" if contract.endpoint == "chat" else "/generate"
    try:
        info_status, info_body, _ = await upstream.request(b"GET", b"/get_model_info")
    except OSError as exc:
        report.add("upstream reachable", False, f"cannot reach {upstream.url}/get_model_info: {exc}")
        return report
    if not report.add(
        "upstream reachable",
        info_status not in (401, 403),
        f"GET /get_model_info answered {info_status}"
        + (
            ": the upstream wants an API key; set CENTERLINE_UPSTREAM_API_KEY (or _FILE)"
            if info_status in (401, 403)
            else ""
        ),
    ):
        return report

    defaults = _unstated_defaults(info_body) if info_status == 200 else []
    detail = "every default the server may fill is stated by each training request"
    if defaults:
        detail = (
            f"--preferred-sampling-params sets {', '.join(defaults)}, which a request cannot override through a "
            "router and which changes what is sampled; start SGLang without them"
        )
    if not report.add("server sampling defaults overridable", not defaults, detail):
        return report

    # Learned before the canary is sent: top_logprobs_num above the vocabulary takes an SGLang server down.
    report.vocab_size = vocab_size or await learn_vocab_size(upstream)
    if not report.add(
        "vocab size known",
        report.vocab_size is not None,
        f"{report.vocab_size}"
        if report.vocab_size
        else "the upstream neither reports vocab_size nor range-checks "
        "token_ids_logprob (not SGLang?); pass --vocab-size",
    ):
        return report
    vocab = report.vocab_size
    too_many = k_above_vocab(contract.k, vocab, contract.mode)
    detail = f"--rollout-top-logprobs-num: {too_many}" if too_many else f"K={contract.k} <= vocab {vocab}"
    if contract.mode == "selected" and not report.add("K within the vocabulary", too_many is None, detail):
        return report

    try:
        status, body, ctype = await upstream.request(
            b"POST", path.encode(), canary_body(contract), [(b"content-type", b"application/json")]
        )
    except OSError as exc:
        report.add("request answered", False, f"POST {path} to {upstream.url} failed: {exc}")
        return report

    if status != 200:
        text = body[:300].decode(errors="replace")
        if contract.endpoint == "chat" and contract.k > CHAT_TOP_LOGPROBS_CAP and status in (400, 422):
            detail = (
                f"router rejects top_logprobs above {CHAT_TOP_LOGPROBS_CAP} (chat top_logprobs={contract.k} answered "
                f"{status}: {text}); use --rollout-endpoint generate or K <= {CHAT_TOP_LOGPROBS_CAP}"
            )
        else:
            detail = f"the canary request was answered {status}: {text}"
        report.add("request accepted", False, detail)
        return report
    report.add("request accepted", True, "200")

    try:
        doc = orjson.loads(body)
        metas = response_metas(doc, contract.endpoint)
    except orjson.JSONDecodeError as exc:
        report.add("response readable", False, f"the response is not JSON ({exc})")
        return report
    except ContractViolation as exc:
        if exc.rule == "missing_token_ids":
            report.add(
                "token ids returned",
                False,
                "drops token ids on chat: no choices[].meta_info (return_meta_info was dropped), and chat logprobs "
                "name tokens by text only",
            )
        else:
            report.add("response readable", False, f"{exc.rule}: {exc}")
        return report
    report.add(
        "token ids returned",
        True,
        "meta_info present" + (" (return_meta_info kept)" if contract.endpoint == "chat" else ""),
    )
    if contract.endpoint == "chat":
        choice = doc["choices"][0]
        kept = isinstance(choice.get("prompt_token_ids"), list) and bool(choice["prompt_token_ids"])
        detail = "choices[].prompt_token_ids present (return_prompt_token_ids kept)"
        if not kept:
            detail = (
                "drops return_prompt_token_ids: the prompt SGLang rendered from the chat template is unknown, "
                "so it cannot be trained on; use --rollout-endpoint generate"
            )
        if not report.add("prompt ids returned", kept, detail):
            return report

    meta = metas[0]
    if contract.mode == "support":
        kept = isinstance(meta.get("output_token_sampling_mask"), list) and isinstance(
            meta.get("output_token_sampling_logprobs"), list
        )
        detail = (
            "output_token_sampling_mask and output_token_sampling_logprobs present"
            if kept
            else (
                "drops sampling_logprobs_mode/return_sampling_mask: the response has no output_token_sampling_mask/"
                "output_token_sampling_logprobs, so filtered rollouts would carry no support"
            )
        )
    else:
        kept = isinstance(meta.get("output_top_logprobs"), list)
        detail = (
            "output_top_logprobs present"
            if kept
            else "drops top_logprobs_num/return_logprob: the response has no output_top_logprobs"
        )
    if not report.add("candidate fields returned", kept, detail):
        return report

    tokens = len(meta.get("output_token_logprobs") or [])
    if not report.add(
        "tokens generated",
        tokens > 0,
        f"{tokens} tokens" if tokens else "the canary generated no tokens, nothing to check",
    ):
        return report

    try:
        result = audit_body(
            body,
            endpoint=contract.endpoint,
            mode=contract.mode,
            k=contract.k,
            vocab_size=report.vocab_size,
            content_type=ctype,
        )
    except ContractViolation as exc:
        report.add("complete candidate sets", False, _cause(exc))
        return report
    width = min(contract.k, report.vocab_size) if contract.mode == "selected" else f"<= {contract.k}"
    report.add("complete candidate sets", True, f"{result.tokens} rows of {width} candidates pass the contract")
    return report


def _cause(exc: ContractViolation) -> str:
    if exc.rule == "short_row":
        return f"truncates candidate rows to {exc.found} (expected {exc.expected}): {exc}"
    if exc.rule == "non_finite":
        return f"returns non-finite log-probs: {exc}"
    return f"{exc.rule}: {exc}"


def main(argv: list[str]) -> int:
    """`centerline probe`: check an SGLang server or router against the candidate contract."""
    parser = argparse.ArgumentParser(prog="centerline probe", description=main.__doc__)
    add_arguments(parser, ProbeSettings, shared=False)
    try:
        settings = resolve_section(ProbeSettings, parser.parse_args(argv))
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    top_k = settings.top_k if settings.top_k is not None else (settings.k if settings.mode == "support" else -1)
    contract = Contract(settings.k, settings.temperature, settings.top_p, top_k, settings.mode, settings.endpoint)
    try:
        api_key = upstream_key_from_env()
        report = asyncio.run(_probe_once(settings.upstream, contract, settings.vocab_size, settings.timeout, api_key))
    except admin_key.AdminKeyError as exc:
        parser.error(str(exc))
    except ValueError as exc:  # not an http(s) URL
        parser.error(str(exc))
    print(orjson.dumps(report.to_dict()).decode() if settings.json else report.table())
    return 0 if report.compatible else 1


async def _probe_once(
    upstream: str, contract: Contract, vocab_size: int | None, timeout: float, api_key: str | None
) -> ProbeReport:
    pool = UpstreamPool(upstream, timeout=timeout, api_key=api_key)
    try:
        return await probe(pool, contract, vocab_size=vocab_size)
    finally:
        await pool.close()
