"""The HTTP edge: reading a body totally (any byte sequence is a 4xx or a valid document), bearer-token
checks, and error responses whose bodies always serialize."""

from __future__ import annotations

import asyncio
import hmac
import json
import math
from typing import Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from policy_bundle.serve.schemas import ApiError

MAX_DEPTH = 32  # nesting a valid request never needs; deeper documents are refused before they recurse


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _check(node, path: str = "body", depth: int = 0) -> None:
    """Refuse what JSON parsers accept but a request must not carry: non-finite numbers (from 1e999),
    lone surrogates (``"\\ud800"``, which no tokenizer and no UTF-8 encoder takes), deep nesting."""
    if depth > MAX_DEPTH:
        raise ApiError(400, f"{path}: nested deeper than {MAX_DEPTH} levels", path.split(".")[-1], limit=MAX_DEPTH)
    if isinstance(node, float) and not math.isfinite(node):
        raise ApiError(400, f"{path}: number out of range", path.split(".")[-1])
    elif isinstance(node, str):
        try:
            node.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, f"{path}: string holds an unpaired surrogate (not valid Unicode)",
                           path.split(".")[-1]) from None
    elif isinstance(node, dict):
        for key, value in node.items():
            _check(key, path, depth + 1)
            _check(value, f"{path}.{key}" if path != "body" else key, depth + 1)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check(value, f"{path}.{i}", depth + 1)


def parse_json(body: bytes):
    """The document in ``body``, or an ApiError(400): invalid UTF-8 or JSON, NaN/Infinity literals,
    numbers beyond float range, unpaired surrogates, nesting deeper than MAX_DEPTH."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, f"body is not valid JSON ({str(exc)[:200]})", "body") from None
    except RecursionError:
        raise ApiError(400, f"body: nested deeper than {MAX_DEPTH} levels", "body", limit=MAX_DEPTH) from None
    _check(data)
    return data


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or a 413 as soon as it is known to exceed ``limit``: from its Content-Length, or
    (chunked, no length) as it streams past the limit, without reading the rest."""
    length = request.headers.get("content-length")
    if length and length.isascii() and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {length} bytes exceeds the limit", "body", int(length), limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes (refused at {len(body)})",
                               "body", len(body), limit)
    except ClientDisconnect:  # nobody reads the answer; a 4xx keeps it out of the server errors
        raise ApiError(400, "the client disconnected before its body was read", "body") from None
    return bytes(body)


async def read_json(request: Request, limit: int):
    return parse_json(await read_body(request, limit))


class ReleasingStream(StreamingResponse):
    """A StreamingResponse that calls ``on_end`` once it is over, however it ends: the body sent, the client
    gone mid-stream, or gone before the first byte (Starlette then never starts the body generator, so a
    ``finally`` in it never runs)."""

    def __init__(self, content, on_end: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_end = on_end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def check_token(given: Optional[str], expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def bearer(request: Request) -> Optional[str]:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def require_api_key(request: Request, keys) -> None:
    """401 unless no keys are configured or the request carries one of them as a bearer token."""
    if not keys:
        return
    key = bearer(request)
    if key is None or not any(check_token(key, k) for k in keys):
        raise ApiError(401, "missing or invalid API key (Authorization: Bearer <key>)", "authorization",
                       code="invalid_api_key")


def require_admin(request: Request, token: Optional[str]) -> None:
    if not token:
        raise ApiError(403, "admin API is disabled: set POLICY_BUNDLE_ADMIN_TOKEN to enable it", code="admin_disabled")
    if bearer(request) is None:
        raise ApiError(401, "admin API needs Authorization: Bearer <admin token>", "authorization", code="unauthorized")
    if not check_token(bearer(request), token):
        raise ApiError(403, "admin token is not valid", "authorization", code="permission_denied")


PROBES = ("/livez", "/readyz", "/healthz")  # what an orchestrator polls without credentials


def guarded_path(path: str) -> bool:
    """Every path needs an API key (when keys are configured) but the probes and the admin API, which has its own
    token: BentoML's routes too (the metrics, the spec at /docs.json and /schema.json, the docs page at /)."""
    return path not in PROBES and path != "/admin" and not path.startswith("/admin/")


class ApiKeyGuard:
    """ASGI middleware: with API keys configured, every route but the probes and the admin API (``guarded_path``)
    needs a key, BentoML's own included (our routes check it themselves too)."""

    def __init__(self, app, keys=()):
        self.app, self.keys = app, tuple(keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.keys and guarded_path(scope.get("path", "")):
            request = Request(scope)
            try:
                require_api_key(request, self.keys)
            except ApiError as err:
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# BentoML's per-request timeout (``traffic.timeout``) of every service here. It ends a request, a stream included,
# that many seconds after it began, whatever it is doing: at 120 s the variants cut every answer of more than about
# 2000 tokens at SmolLM2-135M's speed under load (found by loadtest/bench_long_requests.py: 16 streams cut at 121 s).
# What bounds a request is the router's own: request_timeout_s to each first token and each next one, the variant's
# deadline for plain calls, the client's disconnect. So this is a day, a backstop only (the timer is cancelled when
# the request ends: ``patch_bentoml_timeout``).
TRAFFIC_TIMEOUT_S = 24 * 3600


def patch_bentoml_timeout() -> None:
    """Cancel BentoML's per-request timeout timer when the request ends.

    ``bentoml._internal.server.http.traffic.TimeoutMiddleware`` (BentoML 1.4) arms ``loop.call_later(timeout,
    ...)`` for every request and never cancels it; the timer handle holds the request's context (its
    OpenTelemetry span and everything the span references) for the whole ``traffic.timeout``: the router
    grew ~4 KB per request at 16 req/s over a 5-minute soak, all of it such timers. The app builder
    imports the class from that module when it builds the middleware stack, so replacing it there
    before the service starts is enough."""
    from bentoml._internal.server.http import traffic

    if getattr(traffic.TimeoutMiddleware, "cancels_its_timer", False):
        return

    class CancellingTimeoutMiddleware(traffic.TimeoutMiddleware):
        cancels_its_timer = True

        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] not in ("http", "websocket"):
                return await self.app(scope, receive, send)
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            timer = loop.call_later(self.timeout, self._set_timer_out, waiter)

            async def _send(message) -> None:
                if not waiter.done():
                    waiter.set_result(None)
                await send(message)

            fut = asyncio.ensure_future(self.app(scope, receive, _send), loop=loop)
            try:
                await waiter
            except asyncio.TimeoutError:
                if fut.cancel():
                    body = ApiError(504, f"not able to process the request in {self.timeout} seconds",
                                    code="timeout").body()
                    await JSONResponse(body, status_code=504)(scope, receive, send)
            else:
                await fut
            finally:
                timer.cancel()

    traffic.TimeoutMiddleware = CancellingTimeoutMiddleware
