"""The gateway's HTTP/1.1 client to its workers (supervisor/uds_client.py), against a real
server on a real Unix socket that behaves as awkwardly as HTTP allows: it closes kept-alive
connections, answers in chunks, or without any framing."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mlxfleet.supervisor.handle import WorkerFailed, WorkerUnreachable
from mlxfleet.supervisor.uds_client import UDSClient


class Server:
    """Answers each request per ``mode``; counts connections and notices hang-ups."""

    def __init__(self, path: str, mode: str):
        self.path, self.mode = path, mode
        self.connections = 0
        self.hung_up = asyncio.Event()
        self.bodies: list[bytes] = []

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self.handle, self.path)

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        while True:
            try:
                head = await r.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            length = int(next(h.split(b":")[1] for h in head.split(b"\r\n")
                              if h.lower().startswith(b"content-length")))
            self.bodies.append(await r.readexactly(length))
            if self.mode == "close-after-answer":  # keep-alive promised, then closed
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await w.drain()
                w.close()
                return
            if self.mode == "chunked":
                w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n")
                for part in (b"data: 1\n\n", b"data: 2\n\n"):
                    w.write(b"%x\r\n%s\r\n" % (len(part), part))
                    await w.drain()
                    await asyncio.sleep(0.01)
                w.write(b"0\r\n\r\n")
            elif self.mode == "unframed":
                w.write(b"HTTP/1.1 503 Busy\r\nretry-after: 3\r\n\r\nno framing")
                await w.drain()
                w.close()
                return
            elif self.mode == "endless":
                w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                try:
                    while True:
                        w.write(b"3\r\nabc\r\n")
                        await w.drain()
                        await asyncio.sleep(0.01)
                except ConnectionError:
                    self.hung_up.set()
                    return
            await w.drain()


async def serve(tmp_path, mode: str) -> Server:
    s = Server(str(tmp_path / "w.sock"), mode)
    await s.start()
    return s


async def test_a_connection_the_worker_closed_is_replaced_not_failed(tmp_path):
    s = await serve(tmp_path, "close-after-answer")
    c = UDSClient(tmp_path / "w.sock")
    for i in range(3):
        r = await c.request("POST", "/v1/x", b'{"n": %d}' % i, {"content-type": "x"})
        assert (r.status_code, await r.aread()) == (200, b"ok")
        await asyncio.sleep(0.05)  # the server's close arrives while the connection idles
    assert s.connections == 3 and s.bodies == [b'{"n": 0}', b'{"n": 1}', b'{"n": 2}']
    c.close()


async def test_chunks_are_relayed_as_the_worker_wrote_them_and_the_connection_kept(tmp_path):
    s = await serve(tmp_path, "chunked")
    c = UDSClient(tmp_path / "w.sock")
    for _ in range(2):
        r = await c.request("POST", "/v1/x", b"{}", {})
        assert r.headers["content-type"] == "text/event-stream"
        assert [x async for x in r.aiter_raw()] == [b"data: 1\n\n", b"data: 2\n\n"]
    assert s.connections == 1
    c.close()


async def test_a_primed_pool_serves_a_first_burst_on_connections_already_open(tmp_path):
    s = await serve(tmp_path, "chunked")
    c = UDSClient(tmp_path / "w.sock")
    await c.prime(4)
    await asyncio.sleep(0.05)  # (the server has accepted them)
    assert s.connections == 4
    await c.prime(4)  # as many are idle already: none more
    rs = await asyncio.gather(*(c.request("POST", "/v1/x", b"{}", {}) for _ in range(4)))
    for r in rs:
        assert b"".join([x async for x in r.aiter_raw()]) == b"data: 1\n\ndata: 2\n\n"
    assert s.connections == 4 and len(s.bodies) == 4
    c.close()
    await UDSClient(tmp_path / "gone.sock").prime(2)  # nothing listens: nothing opened


async def test_an_unframed_answer_ends_when_the_worker_closes(tmp_path):
    await serve(tmp_path, "unframed")
    c = UDSClient(tmp_path / "w.sock")
    r = await c.request("POST", "/v1/x", b"{}", {})
    assert (r.status_code, r.headers["retry-after"], await r.aread()) == \
        (503, "3", b"no framing")


async def test_closing_mid_body_hangs_up_on_the_worker(tmp_path):
    s = await serve(tmp_path, "endless")
    c = UDSClient(tmp_path / "w.sock")
    r = await c.request("POST", "/v1/x", b"{}", {})
    chunks = r.aiter_raw()
    assert await chunks.__anext__() == b"abc"
    await r.aclose()  # what the gateway does when its client leaves or a deadline passes
    await asyncio.wait_for(s.hung_up.wait(), 5)


async def test_no_worker_is_unreachable_and_a_broken_answer_a_transport_error(tmp_path):
    c = UDSClient(tmp_path / "missing.sock")
    with pytest.raises(WorkerUnreachable):
        await c.request("POST", "/v1/x", b"{}", {})

    async def half(r, w):  # headers promise 100 bytes, 3 arrive
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc")
        await w.drain()
        w.close()

    async def garbage(r, w):
        await r.readuntil(b"\r\n\r\n")
        w.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await w.drain()

    await asyncio.start_unix_server(half, str(tmp_path / "half.sock"))
    r = await UDSClient(tmp_path / "half.sock").request("POST", "/v1/x", b"{}", {})
    with pytest.raises(httpx.TransportError):
        await r.aread()
    await asyncio.start_unix_server(garbage, str(tmp_path / "garbage.sock"))
    with pytest.raises(WorkerFailed):
        await UDSClient(tmp_path / "garbage.sock").request("POST", "/v1/x", b"{}", {})


@pytest.mark.parametrize("cut", [1, 3, 7, 1000])
def test_chunks_are_decoded_however_the_bytes_fall(cut):
    """What the worker wrote, read back whole whatever the reads' sizes: chunk sizes in
    hex with extensions, trailers, the end; what arrived together comes out together."""
    from mlxfleet.supervisor.uds_client import _Dechunker

    parts = [b"data: 1\n\n", b"x" * 300, b"data: \xc3\xa9\r\n\r\n"]
    wire = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts) \
        + b"0\r\nx-trailer: 1\r\n\r\n"
    d, got = _Dechunker(), []
    for i in range(0, len(wire), cut):
        got.append(d.feed(wire[i:i + cut]))
    assert b"".join(got) == b"".join(parts) and d.ended and not d.extra
    if cut == 1000:  # all in one read: one piece
        assert got == [b"".join(parts)]
    d = _Dechunker()
    assert d.feed(b"3\r\nabc\r\n0\r\n\r\nHTTP/1.1") == b"abc" and d.ended and d.extra
    with pytest.raises(ValueError):
        _Dechunker().feed(b"3\r\nabcdef\r\n")
    with pytest.raises(ValueError):
        _Dechunker().feed(b"zz\r\n")
