"""The trainer's admin calls to an engine survive the engine closing an idle keep-alive connection
while the trainer's event loop was busy (rank 0 reading a version, the proof hashing one)."""

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from trainer_service.weights import WeightPublisher

IDLE_S = 1.0  # the engine closes a connection idle this long (SGLang's server: 5 s)


class Engine(BaseHTTPRequestHandler):
    """Answers every POST with ``{"success": true}`` over keep-alive connections, as SGLang's
    server does, counting the connections it was given."""

    protocol_version = "HTTP/1.1"
    timeout = IDLE_S
    connections = 0
    closed = threading.Event()  # set when the engine has closed a connection

    def setup(self):
        super().setup()
        Engine.connections += 1

    def finish(self):
        super().finish()
        Engine.closed.set()

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"success": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_call_after_the_engine_closed_the_idle_connection_goes_through():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"

    async def two_calls():
        engines = WeightPublisher(None, [url], prove=False)
        try:
            first = await engines._post(url, "/continue_generation", {})
            # the loop busy until the engine has closed the connection: the close is not read meanwhile
            assert Engine.closed.wait(timeout=30)
            return first, await engines._post(url, "/continue_generation", {})
        finally:
            await engines.close()

    try:
        assert asyncio.run(two_calls()) == ((200, {"success": True}), (200, {"success": True}))
        assert Engine.connections == 2  # a connection per call: none reused after the engine closed it
    finally:
        server.shutdown()
        server.server_close()
