"""A TCP relay in front of the NATS server that cuts one client off at an exact protocol frame.

A SIGKILL from outside cannot be timed to the microsecond between two messages of a client
(a worker's batch publish and its task ack are a millisecond apart here). The relay can: it
forwards whole frames of the NATS text protocol (``PUB``/``HPUB``/``MSG``/``HMSG`` with their
payloads, every other operation a line) and, once ``arm``ed, stops forwarding what a client
sends right after the first frame that names a subject starting with ``prefix``:

- ``arm("client", "rollouts.batches")``: a worker's batch publish reaches the server, nothing
  it sends afterwards does (its task ack, its heartbeats): a worker dead between publish and ack;
- ``arm("server", "$JS.ACK.PROMPTS.")``: a worker has just been handed a task and can tell the
  server nothing more: a worker dead mid-task;
- ``arm("client", "$JS.ACK.ROLLOUTS.", ACK)``: the trainer's first ack of a committed step
  arrives, the others do not: a crash between checkpoint and acks.

What the server sends still reaches the client. Connections opened later (a reconnect after
the server restarts, or after ``drop``) pass untouched. ``trip`` records the client's CONNECT
name and the frame.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass

SIZED = {b"PUB", b"HPUB", b"MSG", b"HMSG"}  # operations followed by a payload of the op line's last number
ACK = (b"", b"+ACK")  # payloads of a JetStream ack (nats-py's ack_sync sends the empty one); +WPI, -NAK are not acks


@dataclass
class Trip:
    client: str  # the name the client sent in CONNECT
    line: bytes  # the operation line of the frame, without CRLF
    payload: bytes  # headers and body, as sent

    @property
    def body(self) -> bytes:
        """The payload without its headers (``HPUB``, ``HMSG``: the header size is the op line's second last number)."""
        parts = self.line.split()
        return self.payload[int(parts[-2]) :] if parts[0].upper() in (b"HPUB", b"HMSG") else self.payload


class Frames:
    """Splits a byte stream of the NATS protocol into whole frames."""

    def __init__(self):
        self.buf = b""

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """Every complete frame so far, as (op line, whole frame bytes)."""
        self.buf += data
        out = []
        while (end := self.buf.find(b"\r\n")) >= 0:
            line = self.buf[:end]
            parts = line.split()
            size = int(parts[-1]) + 2 if parts and parts[0].upper() in SIZED else 0
            total = end + 2 + size
            if len(self.buf) < total:
                break
            out.append((line, self.buf[:total]))
            self.buf = self.buf[total:]
        return out


class Relay:
    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.target = (host, port)
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"nats://{host}:{self.port}"
        self.lock = threading.Lock()
        self.armed: tuple[str, bytes, tuple[bytes, ...] | None] | None = None
        self.tripped = threading.Event()
        self.trip: Trip | None = None
        self.withheld: list[tuple[bytes, bytes]] = []  # (op line, payload) a cut client sent, not forwarded
        self.sockets: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, direction: str, prefix: str, payloads: tuple[bytes, ...] | None = None) -> None:
        """Cut the next client whose ``direction`` ("client" or "server") frame names a subject
        starting with ``prefix`` and, if ``payloads`` is given, carries one of them."""
        assert direction in ("client", "server")
        with self.lock:
            self.armed, self.trip = (direction, prefix.encode(), payloads), None
            self.tripped.clear()
            self.withheld.clear()

    def withheld_subject(self, prefix: str, payloads: tuple[bytes, ...] | None = None) -> bool:
        """Whether a cut client has sent (and the relay kept from the server) a frame whose subject
        starts with ``prefix`` and, if ``payloads`` is given, that carries one of them: what the
        client did after the cut, seen as it did it."""
        with self.lock:
            return any(
                line.split()[1:2]
                and line.split()[1].startswith(prefix.encode())
                and (payloads is None or payload in payloads)
                for line, payload in self.withheld
            )

    def drop(self) -> None:
        """Reset every connection open now, as a network blip would; the clients reconnect."""
        with self.lock:
            for sock in self.sockets:
                close_socket(sock)

    def close(self) -> None:
        self.listener.close()
        with self.lock:
            for sock in self.sockets:
                close_socket(sock)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target, timeout=2)
                server.settimeout(None)
            except OSError:  # the server is down: the client sees a refused connection and retries
                close_socket(client)
                continue
            conn = {"cut": False, "name": "?"}
            with self.lock:
                self.sockets |= {client, server}
            for src, dst, direction in ((client, server, "client"), (server, client, "server")):
                threading.Thread(target=self._pump, args=(src, dst, direction, conn), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str, conn: dict) -> None:
        frames = Frames()
        try:
            while data := src.recv(1 << 16):
                for line, frame in frames.feed(data):
                    if direction == "client" and line.startswith(b"CONNECT "):
                        conn["name"] = json.loads(line[8:]).get("name") or "?"
                    matched = self._match(direction, line, frame, conn)
                    if direction == "server" or not conn["cut"] or matched:
                        dst.sendall(frame)
                    else:
                        with self.lock:
                            self.withheld.append((line, frame[len(line) + 2 : -2]))
        except OSError:
            pass
        finally:
            close_socket(src)
            close_socket(dst)
            with self.lock:
                self.sockets -= {src, dst}

    def _match(self, direction: str, line: bytes, frame: bytes, conn: dict) -> bool:
        with self.lock:
            if self.armed is None or self.armed[0] != direction:
                return False
            payload = frame[len(line) + 2 : -2]
            if not any(token.startswith(self.armed[1]) for token in line.split()[1:]):
                return False
            if self.armed[2] is not None and payload not in self.armed[2]:
                return False
            conn["cut"] = True  # before the frame is forwarded: nothing the client answers gets through
            self.armed = None
            self.trip = Trip(conn["name"], line, payload)
            self.tripped.set()
            return True


def close_socket(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
