"""The FastAPI application: routers, access policy (Host check, bearer token, rate limit: see
`auth.py`), request-size limit, one AsyncTangramClient per tenant (`tenancy.py`): each request
acts as the tenant its token names.

OpenAPI docs are served at /docs (schema at /openapi.json); they and GET /v1/ping need no token.
Clients that cannot set headers (verl's SandboxFusion client sends none) may pass the token as
the query parameter `token` where the operator allows it (`http.token_in_query`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from tangram_celery.client.aio import AsyncTangramClient
from tangram_celery.client.gate import Gate
from tangram_celery.common.config import TangramConfig
from tangram_celery.common.errors import BrokerError
from tangram_celery.common.tenants import DEFAULT
from tangram_celery.web.auth import Access, Principal, Refusal
from tangram_celery.web.phases import COMPILED, LANGUAGES
from tangram_celery.web.sandbox_fusion import Answer, run_code_fast
from tangram_celery.web.sandbox_models import Capabilities
from tangram_celery.web.tenancy import Tenancy, tenant_of_scope

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


@dataclass
class ServerState:
    """What the endpoints share (app.state.tangram)."""

    cfg: TangramConfig
    client: AsyncTangramClient
    gate: Gate
    default_memory_mb: int
    tenancy: Tenancy | None = None  # None: the default tenant's client and gate only
    _caps: Capabilities | None = field(default=None, repr=False)

    def gate_of(self, scope: object) -> Gate:
        """The gate (and through it the client) of the tenant a request acts as."""
        tenant = tenant_of_scope(scope)
        if self.tenancy is None:
            return self.gate
        return self.tenancy.gate(tenant)

    async def offered_languages(self) -> list[str] | None:
        """The languages some CPU worker reported (None: none has reported yet)."""
        by_node = await self.client.languages()
        if not by_node:
            return None
        offered = {lang for langs in by_node.values() for lang in langs}
        return [lang for lang in LANGUAGES if lang in offered]

    async def capabilities(self) -> Capabilities:
        if self._caps is None:
            from tangram_celery.common.wire import PoolView

            view = PoolView.of(self.cfg)
            self._caps = Capabilities(
                languages=list(LANGUAGES),
                compiled_languages=sorted(COMPILED),
                reward_models=sorted(view.models),
                apis=list(view.apis),
                max_cpus=view.max_cpus,
                max_memory_mb=view.max_memory_mb,
            )
        caps = self._caps
        if self.client.core.follow:  # nodes join at run time: the largest one now
            live = await self.client.pools()
            if live is not None:
                caps = caps.model_copy(
                    update={"max_cpus": live.max_cpus, "max_memory_mb": live.max_memory_mb}
                )
        by_node = await self.client.languages()
        offered = await self.offered_languages()
        languages = offered if offered is not None else list(LANGUAGES)
        return caps.model_copy(
            update={
                "languages": languages,
                "compiled_languages": [lang for lang in languages if lang in COMPILED],
                "languages_reported": offered is not None,
                "languages_by_node": {node: list(langs) for node, langs in sorted(by_node.items())},
            }
        )


def create_app(
    cfg: TangramConfig,
    broker_url: str,
    *,
    client: AsyncTangramClient | None = None,
    registry: CollectorRegistry | None = None,
    token: str | None = None,
) -> FastAPI:
    """The HTTP server's app for deployment `cfg` whose Redis is at `broker_url`; with
    `registry`, its gauges (requests in flight, overload answers, actions awaited) go there.
    `token`: the one required (default `http.token`; with neither and `http.auth: token`, every
    request but ping and the docs is refused)."""
    from tangram_celery.integrations.rewards import router as rewards_router
    from tangram_celery.web.native import router as native_router
    from tangram_celery.web.sandbox_fusion import router as sandbox_router

    access = Access.of(cfg.http, token or cfg.http.resolved_token())

    def tenant_client(tenant: str) -> AsyncTangramClient:
        # Redis retries are bounded by the slack: a request must not outlive its deadline
        # waiting for a broker that is away (the caller gets 503 instead, see below)
        return AsyncTangramClient(broker_url, config=cfg, retry_budget_s=cfg.http.slack_s, tenant=tenant)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        c = client or tenant_client(DEFAULT)
        gate = Gate(c, cfg.http)
        tenancy = Tenancy(cfg, access, gate, tenant_client)
        await tenancy.start()
        app.state.tangram = ServerState(
            cfg=cfg, client=c, gate=gate, default_memory_mb=cfg.sandbox.default_memory_mb, tenancy=tenancy
        )
        if registry is not None:
            _gauges(registry, tenancy)
        try:
            yield
        finally:
            await tenancy.close()
            await c.close()

    app = FastAPI(
        title="Tangram",
        summary="SandboxFusion-compatible sandbox API and native endpoints in front of Tangram's scheduler",
        version="1",
        lifespan=lifespan,
    )

    @app.exception_handler(BrokerError)
    async def broker_away_answer(request: Request, exc: BrokerError) -> JSONResponse:
        return JSONResponse({"detail": broker_away(exc)}, status_code=503, headers={"Retry-After": "1"})

    app.include_router(sandbox_router)
    app.include_router(native_router)
    app.include_router(rewards_router)
    app.state.access = access  # the policy the guard applies (tenants' tokens: `Tenancy`)
    app.add_middleware(Guard, access=access, max_body_bytes=cfg.http.max_body_mb << 20)
    return app


def broker_away(exc: BrokerError) -> str:
    """Why a request got 503: Redis unreachable for longer than the slack."""
    return f"broker unavailable: {exc}"


def _gauges(registry: CollectorRegistry, tenancy: Tenancy) -> None:
    """Every tenant's requests together (a gauge per tenant would name tenants to whoever
    reads the metrics; the scheduler's metrics show tenants to the operator)."""
    from prometheus_client import Gauge

    Gauge("tangram_http_in_flight", "HTTP requests being served", registry=registry).set_function(
        tenancy.in_flight
    )
    Gauge(
        "tangram_http_overloaded_total", "Requests answered with the overload status", registry=registry
    ).set_function(tenancy.overloaded_total)
    Gauge(
        "tangram_http_awaited_actions", "Actions whose results are awaited", registry=registry
    ).set_function(tenancy.awaited)


class Guard:
    """Pure ASGI middleware (no per-request task, unlike BaseHTTPMiddleware): the access policy
    (`Access.check`: Host, token, rate limit), request-body limit, and the fast path of
    `POST /run_code`. The principal a request acts for is in `scope["state"]["principal"]`.

    The fast path: a `/run_code` request with a JSON body is read here and, if it validates, is
    answered by `run_code_fast` without FastAPI's routing, dependency solving and second parse
    (the hot path of every SandboxFusion client). A body that does not validate goes on to the
    FastAPI route, replayed, which answers exactly as it would have (its 422)."""

    def __init__(self, app: ASGIApp, access: Access, max_body_bytes: int) -> None:
        self.app = app
        self.access = access
        self.max_body_bytes = max_body_bytes

    def _check(self, scope: Scope, headers: dict[bytes, bytes]) -> Principal | Refusal:
        return self.access.check(
            scope["path"],
            headers.get(b"host"),
            headers.get(b"authorization"),
            scope.get("query_string", b""),
            time.monotonic(),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        verdict = self._check(scope, headers)
        if isinstance(verdict, Refusal) and verdict.unknown_token:
            tenancy = _tenancy(scope)
            if tenancy is not None:  # a tenant added since the registry was last read?
                await tenancy.reread()
                verdict = self._check(scope, headers)
        if isinstance(verdict, Refusal):
            await _reply(send, verdict.status, verdict.detail, dict(verdict.headers))
            return
        scope.setdefault("state", {})["principal"] = verdict
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _reply(send, 413, f"request body over {self.max_body_bytes >> 20} MiB (http.max_body_mb)")
            return
        started = False

        async def tracking_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        limited = _limited(receive, self.max_body_bytes)
        try:
            if scope["path"] == "/run_code" and scope["method"] == "POST" and _json_body(headers):
                body = await _read_body(limited)
                if body is None:  # the client went away before its request was whole
                    return
                try:
                    answer = await run_code_fast(scope, body)
                except BrokerError as e:
                    await _reply(send, 503, broker_away(e), {"retry-after": "1"})
                    return
                if answer is not None:
                    await _send_answer(tracking_send, answer)
                    return
                limited = _replay(body, receive)
            await self.app(scope, limited, tracking_send)
        except BodyTooLarge:
            if not started:
                await _reply(
                    send, 413, f"request body over {self.max_body_bytes >> 20} MiB (http.max_body_mb)"
                )


class BodyTooLarge(Exception):
    pass


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive` that refuses a chunked body growing past `limit` bytes."""
    seen = 0

    async def wrapped() -> MutableMapping[str, Any]:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(f"request body over {limit} bytes")
        return message

    return wrapped


def _json_body(headers: dict[bytes, bytes]) -> bool:
    """The request says its body is JSON (the media type FastAPI parses as JSON, and only its
    plain form: anything else takes FastAPI's own way)."""
    media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    return media == b"application/json"


async def _read_body(receive: Receive) -> bytes | None:
    """The whole request body; None if the client disconnected first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """`receive` for an app downstream of a middleware that read the whole body already."""
    replayed = False

    async def wrapped() -> MutableMapping[str, Any]:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return wrapped


async def _send_answer(send: Send, answer: Answer) -> None:
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(answer.body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in answer.headers]
    await send({"type": "http.response.start", "status": answer.status_code, "headers": raw})
    await send({"type": "http.response.body", "body": answer.body})


def _tenancy(scope: Scope) -> Tenancy | None:
    """The running server's tenants (None outside its app, or before its start)."""
    state = getattr(getattr(scope.get("app"), "state", None), "tangram", None)
    return getattr(state, "tenancy", None)


async def _reply(send: Send, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await _send_answer(send, Answer(status, body, tuple((headers or {}).items())))
