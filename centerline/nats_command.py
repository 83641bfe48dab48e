"""``centerline nats``: the embedded NATS server with the centerline streams, until SIGTERM or Ctrl-C.

    centerline nats --data-dir .centerline/nats --port 4222

Prints one JSON line, ``{"url", "streams"}``, once the streams exist.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from shared import names
from shared.nats_server import EmbeddedNats
from shared.streams import provision


def main(argv: list[str]) -> int:
    """``centerline nats``: run the embedded server with the centerline streams until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(prog="centerline nats", description=main.__doc__)
    parser.add_argument("--data-dir", default=".centerline/nats", help="config, log and JetStream store")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4222, help="client port; 0 = any free port")
    parser.add_argument("--http-port", type=int, default=None, help="monitoring port (/healthz, /varz)")
    parser.add_argument("--max-payload", type=int, default=names.DEFAULT_MAX_PAYLOAD, help="bytes per message")
    args = parser.parse_args(argv)
    server = EmbeddedNats(
        args.data_dir, host=args.host, port=args.port, http_port=args.http_port, max_payload=args.max_payload
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with server:
        # as the admin, not as this shell's CENTERLINE_NATS_USER
        streams = asyncio.run(provision(server.url, **server.credentials("admin")))
        print(json.dumps({"url": server.url, "streams": streams}), flush=True)
        try:
            return 0 if server.proc.wait() == 0 else 1  # the server stopped on its own
        except KeyboardInterrupt:
            return 0
