"""`centerline engine --model DIR --port P`: a model served with the SGLang HTTP protocol.

FastAPI on uvicorn (uvloop). Generation runs in the scheduler's worker thread
(`engine/scheduler.py`), so `/health` and the info endpoints answer while it works.
Endpoints: POST /generate, POST /v1/chat/completions, GET /health, /model_info
(/get_model_info), /server_info (/get_server_info), /v1/models, POST
/update_weights_from_disk, GET|POST /flush_cache. `model_path` and `tokenizer_path` are
reported as the local directory, so the sglang-router loads the tokenizer from disk.
With an admin key (``--admin-api-key``, else ``CENTERLINE_ENGINE_ADMIN_API_KEY[_FILE]``,
``shared/admin_key.py``) the two admin endpoints answer 401 ``{"error": "Unauthorized"}``
without ``Authorization: Bearer <key>``, as SGLang's do.
Left out: streaming, penalties, constrained decoding, prefix caching, multimodal input.

    centerline engine --model runs/model --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import time
from pathlib import Path

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from shared import admin_key

log = logging.getLogger("centerline.engine")
DTYPES = ("float64", "float32")


def json_response(content, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type="application/json")


def error_response(message: str, status: int = 400) -> Response:
    return json_response({"error": {"message": message}}, status)


def load_model(path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.eval()


def build_app(
    model_path: str, weight_version: str = "0", max_batch_size: int = 32, seed: int = 0,
    dtype: str = "float64", sampling_mask_max_tokens: int = 4096, host: str = "127.0.0.1", port: int = 0,
    admin_api_key: str | None = None,
) -> FastAPI:  # fmt: skip
    """Load the model and tokenizer from `model_path` and return the app; the scheduler
    thread starts and stops with the app's lifespan. ``admin_api_key`` guards the admin endpoints."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from engine import chat, protocol  # torch and transformers: imported after argument parsing
    from engine.protocol import EngineInfo, RequestError
    from engine.scheduler import Scheduler

    hf_logging.disable_progress_bar()
    model_path = str(Path(model_path).resolve())
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = load_model(model_path, dtype)
    config = model.config
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    seeds = random.Random(seed)
    state = {"model_path": model_path}
    served_name = Path(model_path).name

    def decode(ids: list[int], skip_special: bool = True) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip_special)

    info = EngineInfo(
        vocab_size=config.vocab_size,
        eos_ids={t for t in eos if t is not None},
        max_context=config.max_position_embeddings,
        sampling_mask_max_tokens=sampling_mask_max_tokens,
        encode=lambda text: tokenizer.encode(text, add_special_tokens=True),
        decode=decode,
        token_text=lambda t: tokenizer.decode([t], skip_special_tokens=False),
        next_seed=lambda: seeds.getrandbits(63),
    )
    scheduler = Scheduler(model, str(weight_version), max_batch_size, decode)

    def apply_template(messages: list) -> str:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    async def body_of(request: Request):
        try:
            return orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"the body is not valid JSON: {exc}") from exc

    async def run(seqs):
        futures = scheduler.submit(seqs)
        return await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(lifespan=lifespan)
    app.state.scheduler = scheduler

    def refused(request: Request) -> Response | None:
        """SGLang's answer to an admin request without the admin key, else None."""
        if admin_api_key is None or admin_key.authorized(request.headers.get("authorization"), admin_api_key):
            return None
        return json_response({"error": "Unauthorized"}, 401)

    @app.post("/generate")
    async def generate(request: Request):
        try:
            seqs, as_list = protocol.parse_generate(await body_of(request), info)
        except RequestError as exc:
            return error_response(str(exc))
        done = await run(seqs)
        out = [protocol.generate_response(s, info) for s in done]
        return json_response(out if as_list else out[0])

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            seqs, flags = chat.parse_chat(await body_of(request), info, apply_template)
        except RequestError as exc:
            return error_response(str(exc))
        done = await run(seqs)
        return json_response(chat.chat_response(done, flags, info, served_name))

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    def model_info():
        return {
            "model_path": state["model_path"],
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": scheduler.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "served_model_name": served_name,
            "model_type": config.model_type,
            "architectures": list(config.architectures or []),
        }

    def server_info():
        return {
            "model_path": state["model_path"],
            "tokenizer_path": model_path,
            "served_model_name": served_name,
            "host": host,
            "port": port,
            "dtype": dtype,
            "max_running_requests": max_batch_size,
            "sampling_mask_max_tokens": sampling_mask_max_tokens,
            "random_seed": seed,
            "weight_version": scheduler.weight_version,
            "context_length": info.max_context,
            "max_context_length": info.max_context,
            "dp_size": 1,
            "tp_size": 1,
            "internal_states": [{"load": scheduler.load}],
            "version": "0.5.23-centerline-embedded",
        }

    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, lambda: json_response(model_info()), methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, lambda: json_response(server_info()), methods=["GET"])

    @app.get("/v1/models")
    async def models():
        card = {"id": served_name, "object": "model", "created": int(time.time()), "owned_by": "sglang",
                "root": state["model_path"], "parent": None, "max_model_len": info.max_context}  # fmt: skip
        return json_response({"object": "list", "data": [card]})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        if (denied := refused(request)) is not None:
            return denied
        try:
            body = await body_of(request)
        except RequestError as exc:
            return error_response(str(exc))
        path = body.get("model_path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not Path(path).is_dir():
            return json_response({"success": False, "message": f"model_path {path!r} is not a directory",
                                  "num_paused_requests": 0}, 400)  # fmt: skip
        version = body.get("weight_version")
        version = scheduler.weight_version if version is None else str(version)
        try:
            await asyncio.wrap_future(scheduler.update_weights(lambda: load_model(path, dtype), version))
        except Exception as exc:  # a bad checkpoint keeps the old weights serving
            return json_response({"success": False, "message": f"Failed to update weights: {exc}",
                                  "num_paused_requests": 0}, 400)  # fmt: skip
        state["model_path"] = str(Path(path).resolve())
        return json_response({"success": True, "message": "Succeeded to update model weights.",
                              "num_paused_requests": 0})  # fmt: skip

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(request: Request):
        if (denied := refused(request)) is not None:
            return denied
        # No prefix cache is kept between requests, so there is nothing to drop.
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation will not be performed.)\n")  # fmt: skip

    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="centerline engine", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory (config, safetensors, tokenizer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--weight-version", default="0", help="initial weight version, reported as a string")
    parser.add_argument("--max-batch-size", type=int, default=32, help="most sequences decoded together")
    parser.add_argument("--seed", type=int, default=0, help="seeds requests that carry no sampling_seed")
    parser.add_argument("--dtype", choices=DTYPES, default="float64",
                        help="compute dtype; float64 makes cached decoding match a full forward to ~1e-12")  # fmt: skip
    parser.add_argument("--sampling-mask-max-tokens", type=int, default=4096, help="as SGLang's flag of that name")
    # One intra-op thread: a model this small gains nothing from more, and on a busy 2-core
    # machine OpenMP spin-waiting made a 16-row decode step 10x slower; the other core
    # serves HTTP.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--admin-api-key", default=None,
                        help=f"as SGLang's flag: admin endpoints need 'Authorization: Bearer KEY'; default ${admin_key.KEY_ENV} "
                             f"or the file ${admin_key.KEY_FILE_ENV} names (preferred: a flag shows in ps)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        key = args.admin_api_key or admin_key.key_from_env()
    except admin_key.AdminKeyError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")

    import torch
    import uvicorn

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if key is None:
        log.warning("no admin key: anyone who reaches this engine can load weights into it (--admin-api-key, $%s)", admin_key.KEY_ENV)
    app = build_app(
        args.model, args.weight_version, args.max_batch_size, args.seed, args.dtype,
        args.sampling_mask_max_tokens, args.host, args.port, admin_api_key=key,
    )  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", log_level="warning")
    return 0
