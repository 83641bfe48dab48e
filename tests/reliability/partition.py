"""A NATS cluster on loopback whose routes run through cuttable links, for partitions made
without touching the host's network.

Every route between two nodes goes through a ``Link`` of its own, one per direction: node i
dials node j at ``links[i, j]``, a TCP forwarder to j's route port. Each node advertises a port
nothing listens on, so no node learns a direct route by gossip, and the links are the only
paths between nodes. ``isolate(k)`` cuts every link to and from node k (open connections reset,
new ones closed at once) and ``heal(k)`` lets them through again: node k is cut off from the
others while its clients stay connected to it.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from centerline.nats_server import NatsCluster
from centerline.ports import free_port
from tests.reliability.relay import close_socket


class Link:
    """A TCP forwarder to ``port`` on loopback that can be cut and healed."""

    def __init__(self, port: int):
        self.target = ("127.0.0.1", port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.is_cut = False
        self.sockets: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self.lock:
            self.is_cut = True
            for sock in self.sockets:
                close_socket(sock)

    def heal(self) -> None:
        with self.lock:
            self.is_cut = False

    def close(self) -> None:
        self.cut()
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                inbound, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self.lock:
                cut = self.is_cut
            if cut:
                close_socket(inbound)
                continue
            try:
                outbound = socket.create_connection(self.target, timeout=2)
                outbound.settimeout(None)
            except OSError:  # the node is down: the dialer sees its connection closed and retries
                close_socket(inbound)
                continue
            with self.lock:
                self.sockets |= {inbound, outbound}
            for src, dst in ((inbound, outbound), (outbound, inbound)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            close_socket(src)
            close_socket(dst)
            with self.lock:
                self.sockets -= {src, dst}


class PartitionableCluster(NatsCluster):
    """``NatsCluster`` with every route through a ``Link``; ``isolate``/``heal`` a node."""

    def __init__(self, data_dir: Path, nodes: int = 3):
        super().__init__(data_dir, nodes)
        nowhere = free_port()  # advertised by every node: gossip leads nowhere, only the links connect
        self.links = {(i, j): Link(self.nodes[j].cluster_port) for i in range(nodes) for j in range(nodes) if i != j}
        for i, node in enumerate(self.nodes):
            node.routes = [self.links[i, j].port for j in range(nodes) if j != i]
            node.cluster_advertise = f"127.0.0.1:{nowhere}"

    def node_links(self, k: int) -> list[Link]:
        return [link for (i, j), link in self.links.items() if k in (i, j)]

    def isolate(self, k: int) -> None:
        for link in self.node_links(k):
            link.cut()

    def heal(self, k: int) -> None:
        for link in self.node_links(k):
            link.heal()

    def stop(self, timeout: float = 20.0) -> None:
        super().stop(timeout)
        for link in self.links.values():
            link.close()
