"""What moving ``nbytes`` costs this machine at least, measured in the run that quotes it: a warm
copy in memory (``memcpy_gbps``) and a pass through a loopback TCP socket (``loopback_gbps``), the
floors ``bench weights`` and ``bench long-sample`` divide their figures by."""

from __future__ import annotations

import socket
import statistics
import threading
import time

import numpy as np

CHUNK = 4 << 20  # loopback write size


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """``nbytes`` copied into a warm preallocated buffer, median of ``repeats``."""
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def loopback_gbps(nbytes: int) -> float:
    """``nbytes`` through a loopback TCP connection, one receiving thread."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def drain():
        conn, _ = server.accept()
        with conn:
            left = nbytes
            buf = bytearray(CHUNK)
            while left:
                left -= conn.recv_into(buf, min(CHUNK, left))

    receiver = threading.Thread(target=drain)
    receiver.start()
    payload = memoryview(bytes(CHUNK))
    with socket.create_connection(("127.0.0.1", port)) as conn:
        t0 = time.perf_counter()
        sent = 0
        while sent < nbytes:
            n = min(CHUNK, nbytes - sent)
            conn.sendall(payload[:n])
            sent += n
        receiver.join()
        took = time.perf_counter() - t0
    server.close()
    return nbytes / took / 1e9
