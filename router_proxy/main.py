"""`centerline proxy`: the router proxy's command (docs/design.md section 7); the routes are
``router_proxy/server.py``.

    centerline proxy --upstream http://127.0.0.1:30001 --port 30010 [--vocab-size V] [config flags]

It serves until SIGTERM or SIGINT, then gives the requests in progress ``SHUTDOWN_GRACE_S`` to
finish. Audit events go to NATS only where a URL was given (flag, TOML or environment). An upstream
started with ``--api-key`` gets the proxy's own key, from ``CENTERLINE_UPSTREAM_API_KEY`` or
``CENTERLINE_UPSTREAM_API_KEY_FILE`` (``upstream.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys

from router_proxy import candidate_scan
from router_proxy.front import Front
from router_proxy.server import Proxy
from router_proxy.upstream import upstream_key_from_env
from shared import admin_key, logs
from shared.config import ENV_PREFIX, add_arguments, load_toml, parse_args
from shared.settings import ProxySettings

log = logging.getLogger("centerline.proxy")

SHUTDOWN_GRACE_S = 10.0  # requests in progress at SIGTERM get this long to finish


async def run(proxy: Proxy) -> None:
    """Serve on the settings' host and port until SIGTERM or SIGINT, then finish the requests in
    progress (up to ``SHUTDOWN_GRACE_S``) and stop."""
    host, port = proxy.settings.host, proxy.settings.port
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await proxy.start()
    front = Front(proxy.handle, max_body_bytes=proxy.settings.max_request_body_bytes)
    await front.start(host, port)
    # start-up objects (numpy, prometheus, ...) leave the GC's view: later collections only walk request garbage
    gc.freeze()
    log.warning(
        "proxy on http://%s:%d -> %s (%s; candidate rows scanned by the %s scanner%s)",
        host,
        port,
        proxy.upstream,
        proxy.contract,
        candidate_scan.SCANNER or "no",
        ""
        if candidate_scan.SCANNER == "c"
        else ": router_proxy/_rowscan.c is not built, pip install it with a C compiler",
    )
    await stopping.wait()
    await front.shutdown(SHUTDOWN_GRACE_S)
    await proxy.stop()


def main(argv: list[str]) -> int:
    """`centerline proxy`: serve the contract-enforcing proxy in front of an SGLang router or server."""
    parser = argparse.ArgumentParser(prog="centerline proxy", description=main.__doc__)
    add_arguments(parser, ProxySettings)
    args, cfg, settings = parse_args(parser, argv, section=ProxySettings)
    logs.setup("proxy")
    nats_url = cfg.services.nats_url if _nats_configured(args) else None
    try:
        api_key = upstream_key_from_env()
    except admin_key.AdminKeyError as exc:
        print(f"centerline proxy: {exc}", file=sys.stderr)
        return 2
    try:
        proxy = Proxy(settings, cfg, nats_url=nats_url, upstream_api_key=api_key)
    except ValueError as exc:
        print(f"centerline proxy: --upstream: {exc}", file=sys.stderr)
        return 2
    import uvloop

    uvloop.run(run(proxy))
    return 0


def _nats_configured(args: argparse.Namespace) -> bool:
    """Audit events go to NATS only when a URL was given (flag, TOML or environment), not by default."""
    if "nats_url" in vars(args) or ENV_PREFIX + "NATS_URL" in os.environ:
        return True
    return "config" in vars(args) and "nats_url" in load_toml(args.config)
