"""The dashboard's page machinery: templates, pages that answer errors as pages, streamed pages, and the API
called in-process as the page's caller."""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path as FsPath
from typing import Any
from urllib.parse import urlencode

import httpx
from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup, escape

from services.dashboard import views
from shared.auth import ROLE_RANK, SESSION_COOKIE

HERE = FsPath(__file__).parent


def templates() -> Environment:
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else ""
    env.filters["gpus"] = lambda v: f"{round(v, 1):g}" if isinstance(v, (int, float)) else v
    env.filters["dict_update"] = lambda d, **kw: {**d, **kw}
    env.globals["short_type"] = views.short_type
    env.filters["short_model"] = views.short_model
    return env


class PageRoute(APIRoute):
    """A page answers its errors as a page: 401 is the login form (with WWW-Authenticate, as the API's), the rest
    a sentence on the page, with the API's status."""

    def get_route_handler(self) -> Callable:
        inner = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await inner(request)
            except HTTPException as e:
                return error_page(request, e.status_code, str(e.detail), e.headers)
            except RequestValidationError as e:
                return error_page(request, 422, "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}"
                                                          for x in e.errors()))
        return handler


ENV = templates()


def page_text(request: Request, name: str, **context: Any) -> str:
    principal = getattr(request.state, "principal", None)
    return ENV.get_template(name).render(request=request, me=principal,
                                         operator=principal is not None and ROLE_RANK[principal.role] >= 1, **context)


def render(request: Request, name: str, code: int = 200, headers: dict[str, str] | None = None,
           **context: Any) -> HTMLResponse:
    return HTMLResponse(page_text(request, name, **context), code,
                        headers={"Cache-Control": "no-store", **(headers or {})})


LIVE_MARK = "<!--live-->"


def render_streamed(request: Request, page: str, part: str, load: Callable[[], Awaitable[dict[str, Any]]],
                    **context: Any) -> StreamingResponse:
    """A page whose frame (header, filters) is sent at once and whose live part follows when its data has come
    from the API: the browser paints the frame while the big part (8,000 GPU tiles) is read and rendered."""
    head, tail = page_text(request, page, live_html=Markup(LIVE_MARK), **context).split(LIVE_MARK, 1)

    async def body() -> AsyncIterator[bytes]:
        yield head.encode()
        try:
            yield page_text(request, part, **context, **await load()).encode()
        except HTTPException as e:
            yield f'<p class="error" role="alert">{escape(str(e.detail))}</p>'.encode()
        yield tail.encode()

    return StreamingResponse(body(), media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-store"})


def error_page(request: Request, status: int, detail: str, headers: dict[str, str] | None = None) -> HTMLResponse:
    if status == 401:
        return render(request, "login.html", 401, headers or {"WWW-Authenticate": 'Bearer realm="gpuorch"'},
                      error=detail if request.cookies.get(SESSION_COOKIE) else "",
                      next=local(request.url.path + (f"?{request.url.query}" if request.url.query else "")))
    return render(request, "error.html", status, headers, status=status, detail=detail)


LOCAL_TARGET = re.compile(r"^/(?![/\\])[A-Za-z0-9_.~%/?=&+-]*$")


def local(target: str | None) -> str:
    """A redirect target on this site only: a plain path and query, never //host, a scheme, or characters a browser
    would strip or rewrite (tabs, backslashes)."""
    return target if target and LOCAL_TARGET.match(target) else "/"


def token_of(request: Request) -> str:
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.cookies.get(SESSION_COOKIE, "")


class Api:
    """The API, called in-process as the caller (their token): what it refuses, the page refuses the same way."""

    def __init__(self, request: Request) -> None:
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=request.app), base_url="http://dashboard",
                                        headers={"authorization": f"Bearer {token_of(request)}"}, timeout=30)

    async def call(self, path: str, **params: Any) -> httpx.Response:
        return await self.client.get(path, params={k: v for k, v in params.items() if v not in (None, "", [])})

    async def get(self, path: str, **params: Any) -> Any:
        r = await self.call(path, **params)
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail")
            except ValueError:
                detail = r.text[:500]
            raise HTTPException(r.status_code, detail if isinstance(detail, str) else json.dumps(detail))
        return r.json()

    async def jobs(self, pages: int = 20, **params: Any) -> tuple[list[dict[str, Any]], bool]:
        """Every job of these filters the caller may see, page after page (at most ``pages`` of 1,000); and whether
        there were more."""
        out: list[dict[str, Any]] = []
        cursor = None
        for _ in range(pages):
            r = await self.call("/v1/jobs", limit=1000, cursor=cursor, **params)
            if r.status_code >= 400:
                raise HTTPException(r.status_code, r.json().get("detail"))
            out += r.json()
            cursor = r.headers.get("x-next-cursor")
            if not cursor:
                return out, False
        return out, True

    async def close(self) -> None:
        await self.client.aclose()


@contextlib.asynccontextmanager
async def api_of(request: Request) -> AsyncIterator[Api]:
    api = Api(request)
    try:
        yield api
    finally:
        await api.close()


def live_url(request: Request, part: str) -> str:
    query = [(k, v) for k, v in request.query_params.multi_items() if k != "part"] + [("part", part)]
    return f"{request.url.path}?{urlencode(query)}"
