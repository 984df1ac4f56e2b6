"""A lean HTTP/1.1 load client for the benchmarks: keep-alive connections, one request in flight on each.

httpx spent 4.7 ms of CPU on each POST /v1/jobs in bench.ingest (measured: the load generator used 4.8 CPU-s
for 1,024 requests, the whole stack 3.1), so on a 2-core machine the client, not the server, set the pace; a
load generator in C (wrk, h2load) would cost tens of microseconds. This one writes prebuilt request bytes on
an asyncio transport and parses answers with httptools (uvicorn's parser, already a dependency): about as
cheap as Python gets. It speaks only what the benchmarks need: Content-Length bodies and chunked answers.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import httptools


class Answer:
    __slots__ = ("status", "body", "headers")

    def __init__(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.status, self.body, self.headers = status, body, headers


class _Conn(asyncio.Protocol):
    """One keep-alive connection: request() writes, the parser's callbacks fill the answer, a future wakes."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Answer] | None = None
        self.body: list[bytes] = []
        self.headers: dict[str, str] = {}
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ConnectionError(f"bad HTTP answer: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(exc or ConnectionError("the server closed the connection"))

    def _fail(self, exc: Exception) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        answer = Answer(self.parser.get_status_code(), b"".join(self.body), self.headers)
        self.body, self.headers = [], {}
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(answer)


IDLE_KEPT_S = 2.0  # an idle connection older than this is closed, not reused: the server closes its idle ones after
# 5 s (uvicorn's timeout_keep_alive), and a request written as it does so is reset (seen once in bench.ingest)


class Client:
    """Keep-alive connections to one server, made on demand, one request in flight on each (like a pool of
    independent clients): ``raw = client.prepare("POST", "/v1/jobs", body)`` once, then ``await client.send(raw)``."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {self.host}:{self.port}\r\n{extra}"
        self._idle: list[_Conn] = []

    async def _conn(self) -> _Conn:
        while self._idle:
            c = self._idle.pop()
            if c.transport is not None and not c.transport.is_closing():
                if time.monotonic() - c.idle_since < IDLE_KEPT_S:
                    return c
                c.transport.close()
        _, c = await asyncio.get_running_loop().create_connection(_Conn, self.host, self.port)
        return c

    def prepare(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> bytes:
        """The request's bytes (``body``: bytes or JSON-able; ``headers``: this request's own): build them once and
        send them many times."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        head = f"{method} {path} HTTP/1.1\r\n{self._head}" + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        if data is not None:
            head += f"content-type: application/json\r\ncontent-length: {len(data)}\r\n"
        return head.encode() + b"\r\n" + (data or b"")

    async def send(self, raw: bytes) -> Answer:
        c = await self._conn()
        assert c.transport is not None
        c.waiter = asyncio.get_running_loop().create_future()
        c.transport.write(raw)
        try:
            answer = await c.waiter
        except BaseException:
            if c.transport is not None:
                c.transport.close()
            raise
        if answer.headers.get("connection", "").lower() != "close":
            c.idle_since = time.monotonic()
            self._idle.append(c)
        return answer

    def close(self) -> None:
        for c in self._idle:
            if c.transport is not None:
                c.transport.close()
        self._idle.clear()
