"""``centerline nats``: the embedded NATS server with the centerline streams, until SIGTERM or Ctrl-C.

    centerline nats --data-dir .centerline/nats --port 4222
    centerline nats --cluster 3 --port 4222      # three nodes on 4222-4224, streams with 3 replicas

Prints one JSON line, ``{"url", "streams", "replicas"}``, once the streams exist; a cluster's
``url`` names every node, comma-separated, as every centerline service takes it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from centerline.nats_server import DEFAULT_MAX_PAYLOAD, EmbeddedNats, NatsCluster, provision
from shared.streams import StreamLimits


def main(argv: list[str]) -> int:
    """``centerline nats``: run the embedded server with the centerline streams until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(prog="centerline nats", description=main.__doc__)
    parser.add_argument("--data-dir", default=".centerline/nats", help="config, log and JetStream store")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4222, help="client port; 0 = any free port")
    parser.add_argument("--http-port", type=int, default=None, help="monitoring port (/healthz, /varz)")
    parser.add_argument("--max-payload", type=int, default=DEFAULT_MAX_PAYLOAD, help="bytes per message")
    parser.add_argument(
        "--cluster", type=int, default=1, help="JetStream nodes: 1 = one server; N = a cluster on loopback"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="copies of each stream (default: 3 on a cluster of 3 or more nodes, else 1; at most --cluster)",
    )
    args = parser.parse_args(argv)
    if args.cluster < 1:
        parser.error(f"--cluster {args.cluster}: a deployment has at least one node")
    replicas = args.replicas if args.replicas is not None else (3 if args.cluster >= 3 else 1)
    if not 1 <= replicas <= args.cluster:
        parser.error(f"--replicas {replicas}: between 1 and the cluster's {args.cluster} node(s)")
    if args.cluster == 1:
        server = EmbeddedNats(
            args.data_dir, host=args.host, port=args.port, http_port=args.http_port, max_payload=args.max_payload
        )
    else:
        server = NatsCluster(args.data_dir, args.cluster, host=args.host, port=args.port, max_payload=args.max_payload)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with server:
        # as the admin, not as this shell's CENTERLINE_NATS_USER
        streams = asyncio.run(provision(server.url, StreamLimits(replicas=replicas), **server.credentials("admin")))
        print(json.dumps({"url": server.url, "streams": streams, "replicas": replicas}), flush=True)
        try:
            nodes = server.nodes if args.cluster > 1 else [server]
            return 0 if all(node.proc.wait() == 0 for node in nodes) else 1  # stopped on their own
        except KeyboardInterrupt:
            return 0
