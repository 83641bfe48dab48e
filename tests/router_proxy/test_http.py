"""The proxy's own HTTP/1.1: the upstream pool (upstream.py) and the server (front.py), in process on loopback."""

import asyncio
import json

import pytest

from router_proxy.front import Front
from router_proxy.upstream import UpstreamError, UpstreamPool, UpstreamTooLarge


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def scripted_upstream(answer):
    """A raw TCP server: ``answer(connection_number, request_number, head)`` returns bytes to send, or None to close."""
    counts = {"connections": 0}

    async def serve(reader, writer):
        counts["connections"] += 1
        conn, n = counts["connections"], 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                n += 1
                reply = answer(conn, n, head)
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
                if b"connection: close" in reply:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", counts


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def test_requests_reuse_one_keep_alive_connection():
    async def main():
        server, url, counts = await scripted_upstream(lambda c, n, head: ok(b'{"n": %d}' % n))
        pool = UpstreamPool(url)
        answers = [
            await pool.request(b"POST", b"/generate", b"{}", [(b"content-type", b"application/json")]) for _ in range(3)
        ]
        await pool.close()
        server.close()
        return answers, counts["connections"]

    answers, connections = run(main())
    assert answers == [(200, b'{"n": %d}' % n, b"application/json") for n in (1, 2, 3)]
    assert connections == 1


def test_requests_beyond_max_connections_wait_for_a_free_one():
    async def main():
        server, url, counts = await scripted_upstream(lambda c, n, head: ok(b"%d" % c))
        pool = UpstreamPool(url, max_connections=2)
        answers = await asyncio.gather(*(pool.request(b"POST", b"/generate", b"{}") for _ in range(7)))
        server.close()
        return answers, counts["connections"], pool.opened

    answers, connections, opened = run(main())
    assert [a[0] for a in answers] == [200] * 7 and connections == 2 and opened == 2


def test_chunked_response_is_reassembled():
    reply = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: application/json\r\n\r\n"
        b'3\r\n{"a\r\n5\r\n": 1}\r\n0\r\n\r\n'
    )

    async def main():
        server, url, _ = await scripted_upstream(lambda c, n, head: reply)
        pool = UpstreamPool(url)
        first, second = await pool.request(b"GET", b"/x"), await pool.request(b"GET", b"/x")
        server.close()
        return first, second

    assert run(main()) == ((200, b'{"a": 1}', b"application/json"),) * 2


def test_body_without_length_ends_with_the_connection():
    async def main():
        server, url, counts = await scripted_upstream(
            lambda c, n, head: b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n" + b"x" * 70000
        )
        pool = UpstreamPool(url)
        answers = [await pool.request(b"GET", b"/x") for _ in range(2)]
        server.close()
        return answers, counts["connections"]

    answers, connections = run(main())
    assert answers == [(200, b"x" * 70000, b"")] * 2 and connections == 2


def test_stale_keep_alive_connection_is_retried_once_on_a_fresh_one():
    # The upstream drops its idle connection as the second request arrives, without answering it.
    async def main():
        server, url, counts = await scripted_upstream(lambda c, n, head: ok(b"%d" % c) if n == 1 else None)
        pool = UpstreamPool(url)
        answers = [await pool.request(b"POST", b"/generate", b"{}") for _ in range(2)]
        server.close()
        return answers, counts["connections"]

    answers, connections = run(main())
    assert [a[1] for a in answers] == [b"1", b"2"] and connections == 2


def test_fresh_connection_closed_without_answer_is_an_upstream_error():
    async def main():
        server, url, counts = await scripted_upstream(lambda c, n, head: None)
        pool = UpstreamPool(url)
        with pytest.raises(UpstreamError, match="closed the connection"):
            await pool.request(b"POST", b"/generate", b"{}")
        server.close()
        return counts["connections"]

    assert run(main()) == 1


def test_unreachable_upstream_is_an_upstream_error():
    async def main():
        server, url, _ = await scripted_upstream(lambda c, n, head: None)
        server.close()
        await server.wait_closed()
        with pytest.raises(UpstreamError, match="cannot connect"):
            await UpstreamPool(url).request(b"GET", b"/health")

    run(main())


def test_silent_upstream_times_out():
    async def main():
        async def silent(reader, writer):
            await reader.read(1 << 16)
            await asyncio.sleep(5)

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        pool = UpstreamPool(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", timeout=0.2)
        with pytest.raises(UpstreamError, match="within 0.2 s"):
            await pool.request(b"POST", b"/generate", b"{}")
        server.close()

    run(main())


def test_answer_above_the_limit_is_cut_off_and_the_pool_goes_on():
    async def main():
        server, url, counts = await scripted_upstream(lambda c, n, head: ok(b"x" * (5000 if c == 1 else 10)))
        pool = UpstreamPool(url, max_response_bytes=1000)
        with pytest.raises(UpstreamTooLarge, match=r"exceeds 1000 bytes \(--max-upstream-response-bytes\)") as info:
            await pool.request(b"POST", b"/generate", b"{}")
        after = await pool.request(b"POST", b"/generate", b"{}")
        server.close()
        return info.value.limit, after, counts["connections"]

    assert run(main()) == (1000, (200, b"x" * 10, b"application/json"), 2)


def test_unsolicited_bytes_after_an_answer_never_become_the_next_answer():
    # A complete answer followed by the start of another: the second request must get its own.
    smuggled = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"

    async def main():
        server, url, counts = await scripted_upstream(lambda c, n, head: ok(b"%d" % c) + smuggled)
        pool = UpstreamPool(url)
        answers = [await pool.request(b"POST", b"/generate", b"{}") for _ in range(2)]
        server.close()
        return answers, counts["connections"]

    answers, connections = run(main())
    assert answers == [(200, b"1", b"application/json"), (200, b"2", b"application/json")] and connections == 2


def test_switching_protocols_is_an_upstream_error():
    async def main():
        server, url, _ = await scripted_upstream(
            lambda c, n, head: b"HTTP/1.1 101 Switching Protocols\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n"
        )
        with pytest.raises(UpstreamError, match="not HTTP/1.1 \\(HttpParserUpgrade"):
            await UpstreamPool(url).request(b"POST", b"/generate", b"{}")
        server.close()

    run(main())


async def front_with(handler):
    front = Front(handler)
    await front.start("127.0.0.1", 0)
    port = front.server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return front, reader, writer


async def read_response(reader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
    )
    return head, await reader.readexactly(length)


def test_pipelined_requests_are_answered_in_order():
    async def handler(req):
        await asyncio.sleep(0.05 if req.path == b"/slow" else 0)
        return 200, req.path, b"text/plain", []

    async def main():
        front, reader, writer = await front_with(handler)
        writer.write(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\nGET /fast?q=1 HTTP/1.1\r\nhost: x\r\n\r\n")
        bodies = [(await read_response(reader))[1] for _ in range(2)]
        writer.close()
        await front.shutdown(1.0)
        return bodies

    assert run(main()) == [b"/slow", b"/fast"]


def test_chunked_request_body_and_expect_continue():
    async def handler(req):
        return 200, req.body, b"application/json", [(b"x-seen", req.headers[b"x-request-id"])]

    async def main():
        front, reader, writer = await front_with(handler)
        writer.write(
            b"POST /generate HTTP/1.1\r\nhost: x\r\nX-Request-Id: r1\r\nexpect: 100-continue\r\ntransfer-encoding: "
            b"chunked\r\n\r\n"
        )
        interim = await reader.readuntil(b"\r\n\r\n")
        writer.write(b'4\r\n{"a"\r\n3\r\n: 1\r\n1\r\n}\r\n0\r\n\r\n')
        head, body = await read_response(reader)
        writer.close()
        await front.shutdown(1.0)
        return interim, head, body

    interim, head, body = run(main())
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"x-seen: r1\r\n" in head and body == b'{"a": 1}'


def test_unparseable_request_gets_400_and_the_connection_closes():
    async def handler(req):
        return 200, b"", b"text/plain", []

    async def main():
        front, reader, writer = await front_with(handler)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        head, body = await read_response(reader)
        rest = await reader.read()
        await front.shutdown(1.0)
        return head, body, rest

    head, body, rest = run(main())
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"connection: close" in head
    assert json.loads(body)["error"]["rule"] == "bad_request" and rest == b""


def test_garbage_after_a_pipelined_request_is_rejected_after_its_answer():
    async def handler(req):
        await asyncio.sleep(0.05)
        return 200, b"first", b"text/plain", []

    async def main():
        front, reader, writer = await front_with(handler)
        writer.write(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\nNOT HTTP\r\n\r\n")
        first = await read_response(reader)
        second = await read_response(reader)
        await front.shutdown(1.0)
        return first, second

    (_, first), (head, _) = run(main())
    assert first == b"first" and head.startswith(b"HTTP/1.1 400 Bad Request\r\n")


def test_http10_request_is_answered_and_closed():
    async def handler(req):
        return 200, b"ok", b"text/plain", []

    async def main():
        front, reader, writer = await front_with(handler)
        writer.write(b"GET /liveness HTTP/1.0\r\n\r\n")
        answer = await reader.read()
        await front.shutdown(1.0)
        return answer

    answer = run(main())
    assert (
        answer.startswith(b"HTTP/1.1 200 OK\r\n")
        and b"connection: close\r\n" in answer
        and answer.endswith(b"\r\n\r\nok")
    )
