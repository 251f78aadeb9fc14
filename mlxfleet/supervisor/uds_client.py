"""HTTP/1.1 to one worker over its Unix socket: the gateway's hop, kept lean.

Hand-written rather than httpx because the hop is on every request: httpx, httpcore and
anyio cost about half of the gateway's time per request (py-spy, benchmarks/hop.py), for
features a private socket to our own server never uses (URLs, cookies, redirects, proxies,
HTTP/2, pool limits). The server on the other end is the worker's Hypercorn, so the
framing needed is small: Content-Length or chunked bodies, keep-alive connections.

Errors mid-body are raised as httpx's transport errors, so callers handle one family
whether a model runs here (this client) or on another node (httpx).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Optional

import httpx

from .handle import WorkerFailed, WorkerUnreachable

_MAX_HEAD = 64 << 10  # response line and headers
_READ = 64 << 10
_IDLE_CONNECTIONS = 128  # kept open per worker; more are closed when returned
#: New connections being opened to one worker at once. A burst of clients (512 at once)
#: connecting all together overflowed the worker's accept queue (its listen backlog),
#: and the kernel refused the rest (EAGAIN): 16 of 512 requests failed with a 502.
_CONNECTING = 32
#: How long a connection may wait for room in a worker's accept queue before it counts
#: as unreachable (a worker busy accepting hundreds takes milliseconds per connection).
_BACKLOG_WAIT = 10.0


class UpstreamResponse:
    """A worker's answer, its body not read yet: the subset of ``httpx.Response`` the
    gateway uses (``status_code``, ``headers``, ``aread``, ``aiter_raw``, ``aclose``)."""

    def __init__(self, client: UDSClient, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, status: int, headers: dict[str, str],
                 head_only: bool):
        self._client, self._reader, self._writer = client, reader, writer
        self.status_code = status
        self.headers = headers
        self._done = False
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        length = headers.get("content-length")
        self._left: Optional[int] = 0 if head_only else (
            None if self._chunked or length is None else int(length))
        self._reusable = headers.get("connection", "").lower() != "close" and (
            self._chunked or self._left is not None)

    async def aread(self) -> bytes:
        return b"".join([c async for c in self.aiter_raw()])

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each read's complete chunks joined in one piece (a
        stream's events are never split, and those that queued while the gateway was busy
        go out in one write: one await and one send for them all, not two and one each)."""
        if self._done:
            return
        r = self._reader
        try:
            if self._chunked:
                chunks = _Dechunker()
                while not chunks.ended:
                    data = await r.read(_READ)
                    if not data:
                        raise asyncio.IncompleteReadError(b"", None)
                    if body := chunks.feed(data):
                        yield body
                self._reusable = self._reusable and not chunks.extra
            elif self._left is not None:
                while self._left:
                    data = await r.read(min(self._left, _READ))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", self._left)
                    self._left -= len(data)
                    yield data
            else:  # no framing: the body ends when the worker closes
                while data := await r.read(_READ):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                ValueError, OSError) as e:
            self._abort()
            raise httpx.RemoteProtocolError(
                f"the worker broke off its answer ({type(e).__name__})") from None
        self._done = True
        self._client._give_back(self._reader, self._writer, self._reusable)

    async def aclose(self) -> None:
        """Done with it; before the end of the body this closes the connection, which the
        worker sees as a client that left (it stops generating)."""
        if not self._done:
            self._done = True
            self._abort()

    def _abort(self) -> None:
        self._done = True
        self._writer.transport.abort()


class UDSClient:
    """A pool of keep-alive HTTP/1.1 connections to one Unix socket."""

    def __init__(self, path: Path):
        self.path = str(path)
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._connecting = asyncio.Semaphore(_CONNECTING)

    async def request(self, method: str, path: str, body: bytes,
                      headers: dict[str, str]) -> UpstreamResponse:
        """Send one request, return once the response headers are in. Raises
        ``WorkerUnreachable`` when the request cannot have been received, else
        ``WorkerFailed``."""
        head = [f"{method} {path} HTTP/1.1\r\nHost: worker\r\nContent-Length: {len(body)}\r\n"]
        for k, v in headers.items():
            if "\r" not in v and "\n" not in v:
                head.append(f"{k}: {v}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + body
        stale = None
        while self._idle:  # a kept connection; the worker may have closed it meanwhile
            reader, writer = self._idle.pop()
            if reader.at_eof() or writer.is_closing():
                writer.transport.abort()
                continue
            try:
                return await self._exchange(reader, writer, data, method)
            except _Stale as e:
                stale = e  # closed under us before answering anything: a fresh one
        try:
            reader, writer = await self._connect()
        except OSError as e:
            if stale is not None:  # it took the request, then died: not safe to resend
                raise WorkerFailed(f"{stale}, and is gone") from None
            raise WorkerUnreachable(f"cannot connect to {self.path}: {e}") from None
        try:
            return await self._exchange(reader, writer, data, method)
        except _Stale as e:
            raise WorkerFailed(str(e)) from None

    async def prime(self, n: int) -> None:
        """Open connections until ``n`` are idle (a worker has just become ready), so that
        the first burst finds them open as later bursts do; one that fails is left out."""
        async def one() -> None:
            try:
                reader, writer = await self._connect()
            except OSError:
                return
            self._give_back(reader, writer, True)

        await asyncio.gather(*(one() for _ in range(min(n, _IDLE_CONNECTIONS)
                                                    - len(self._idle))))

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A new connection, waiting its turn: a few connect at a time, and one whose
        worker's accept queue is full (EAGAIN) tries again shortly instead of failing."""
        async with self._connecting:
            deadline = time.monotonic() + _BACKLOG_WAIT
            delay = 0.002
            while True:
                try:
                    return await asyncio.open_unix_connection(self.path, limit=_MAX_HEAD)
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.05)

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        data: bytes, method: str) -> UpstreamResponse:
        try:
            writer.write(data)
            raw = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as e:
            writer.transport.abort()
            if not e.partial:
                raise _Stale("the worker closed the connection without answering") from None
            raise WorkerFailed("the worker broke off its answer") from None
        except (ConnectionError, OSError, asyncio.LimitOverrunError) as e:
            writer.transport.abort()
            raise WorkerFailed(f"{type(e).__name__}: {e}") from None
        except BaseException:  # cancelled (a deadline, the client left): drop it
            writer.transport.abort()
            raise
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            writer.transport.abort()
            raise WorkerFailed(f"not an HTTP answer: {lines[0][:80]!r}") from None
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        head_only = method == "HEAD" or status in (204, 304)
        return UpstreamResponse(self, reader, writer, status, headers, head_only)

    def _give_back(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   reusable: bool) -> None:
        if reusable and len(self._idle) < _IDLE_CONNECTIONS and not writer.is_closing():
            self._idle.append((reader, writer))
        else:
            writer.transport.abort()

    def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].transport.abort()


class _Dechunker:
    """HTTP/1.1 chunked transfer coding, decoded from the bytes as they are read."""

    def __init__(self) -> None:
        self._buf = bytearray()  # (appended to and cut from the front in place)
        self.ended = False  # the last chunk and the trailers are in
        self.extra = False  # bytes came after the body (the connection cannot be reused)

    def feed(self, data: bytes) -> bytes:
        """The data of every chunk ``data`` completes, joined (b"" for none). Raises
        ValueError on a malformed chunk."""
        buf, out, at = self._buf, [], 0
        buf += data
        while not self.ended:
            eol = buf.find(b"\r\n", at)
            if eol < 0:
                if len(buf) - at > _MAX_HEAD:
                    raise ValueError("a chunk size line without an end")
                break
            size = int(buf[at:eol].split(b";", 1)[0], 16)
            if size == 0:  # the last chunk: trailers (usually none), then an empty line
                end = buf.find(b"\r\n\r\n", eol) if buf[eol + 2:eol + 4] != b"\r\n" \
                    else eol
                if end < 0:
                    break
                self.ended, at = True, end + 4
                self.extra = at < len(buf)
                break
            end = eol + 2 + size
            if len(buf) < end + 2:
                break
            if buf[end:end + 2] != b"\r\n":
                raise ValueError("a chunk longer than its size")
            out.append(buf[eol + 2:end])
            at = end + 2
        del buf[:at]
        return b"".join(out)


class _Stale(Exception):
    """A kept-alive connection the worker had closed: nothing was received."""
