"""A stand-in SGLang upstream for the proxy tests, run as its own process:

    python tests/router_proxy/upstream_double.py --port P [--truncate 20] [--vocab-size 300] [--no-vocab]

POST /generate and /v1/chat/completions answer valid SGLang-shaped responses for whatever
the request asked (top_logprobs_num / top_logprobs, support mode, max_new_tokens, n);
``--truncate R`` cuts every candidate row to R entries, as some router builds do. Control:
POST /_next {"status", "body"} makes the next answer exactly that text; GET /_last returns
the last request body it received, GET /_last_headers its headers (names in lower case), so
tests can see what the proxy sent.
"""

from __future__ import annotations

import argparse
import math

from aiohttp import web

ROWS: dict = {}


def row(vocab: int, pos: int) -> list[float]:
    """A fixed log-softmax over the vocabulary for output position ``pos``."""
    if pos not in ROWS:
        logits = [math.sin(1.7 * v + 0.3 * pos) * 3 for v in range(vocab)]
        z = math.log(sum(math.exp(x) for x in logits))
        ROWS[pos] = [x - z for x in logits]
    return ROWS[pos]


def meta_info(req: dict, params: dict, k: int, support: bool, args) -> dict:
    n = int(params.get("max_new_tokens", 4))
    sampled, tops, mask, mask_lp = [], [], [], []
    for pos in range(n):
        lp = row(args.vocab_size, pos)
        order = sorted(range(args.vocab_size), key=lambda v: -lp[v])
        if support:
            top_k = int(params.get("top_k", 8))
            keep = order[:top_k]
            z = math.log(sum(math.exp(lp[v]) for v in keep))
            renorm = {v: lp[v] - z for v in keep}
            mask.append(keep[: args.truncate])
            mask_lp.append([renorm[v] for v in keep[: args.truncate]])
            sampled.append([renorm[keep[0]], keep[0], None])
        else:
            sampled.append([lp[order[0]], order[0], None])
            tops.append([[lp[v], v, None] for v in order[: min(k, args.truncate)]])
    meta = {
        "id": "double",
        "finish_reason": {"type": "length", "length": n},
        "prompt_tokens": 3,
        "completion_tokens": n,
        "weight_version": "default",  # SGLang 0.5.23 writes it in every meta_info
    }
    if req.get("return_logprob") or req.get("logprobs"):
        meta["output_token_logprobs"] = sampled
        if tops:
            meta["output_top_logprobs"] = tops
    if support and req.get("return_sampling_mask"):
        meta["output_token_sampling_mask"] = mask
        meta["output_token_sampling_logprobs"] = mask_lp
    return meta


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--truncate", type=int, default=1 << 30)
    parser.add_argument("--vocab-size", type=int, default=300)
    parser.add_argument("--no-vocab", action="store_true", help="report no vocab_size in /model_info")
    args = parser.parse_args()
    state = {"next": [], "last": None, "last_headers": {}}

    async def answer(request: web.Request, make) -> web.Response:
        state["last"] = await request.text()
        state["last_headers"] = {name.lower(): value for name, value in request.headers.items()}
        if state["next"]:
            nxt = state["next"].pop(0)
            return web.Response(text=nxt["body"], status=nxt.get("status", 200), content_type="application/json")
        req = await request.json()
        return web.json_response(make(req))

    def generate(req: dict) -> dict:
        params = req.get("sampling_params") or {}
        support = req.get("sampling_logprobs_mode") == "support"
        meta = meta_info(req, params, int(req.get("top_logprobs_num") or 0), support, args)
        return {"text": "x", "output_ids": [s[1] for s in meta.get("output_token_logprobs", [])], "meta_info": meta}

    def chat(req: dict) -> dict:
        params = {"max_new_tokens": req.get("max_tokens", 4), "top_k": req.get("top_k", 8)}
        support = req.get("sampling_logprobs_mode") == "support"
        meta = meta_info(req, params, int(req.get("top_logprobs") or 0), support, args)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "x"},
            "finish_reason": "length",
            "meta_info": meta if req.get("return_meta_info") else None,
        }
        return {"id": "chat-double", "object": "chat.completion", "choices": [choice]}

    async def set_next(request: web.Request) -> web.Response:
        state["next"].append(await request.json())
        return web.json_response({"queued": len(state["next"])})

    async def last(_request) -> web.Response:
        return web.Response(text=state["last"] or "null", content_type="application/json")

    async def last_headers(_request) -> web.Response:
        return web.json_response(state["last_headers"])

    async def model_info(_request) -> web.Response:
        return web.json_response({"model_path": "double", **({} if args.no_vocab else {"vocab_size": args.vocab_size})})

    app = web.Application()
    app.add_routes(
        [
            web.post("/generate", lambda r: answer(r, generate)),
            web.post("/v1/chat/completions", lambda r: answer(r, chat)),
            web.post("/_next", set_next),
            web.get("/_last", last),
            web.get("/_last_headers", last_headers),
            web.get("/model_info", model_info),
            web.get("/health", lambda r: web.Response(text="ok")),
        ]
    )
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
