"""The gateway's ASGI app: OpenAI routes, resumable result events, health, API keys."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from producer.gateway.errors import ApiError
from producer.gateway.generate import generate
from producer.gateway.metrics import GatewayMetrics
from producer.gateway.middleware import RequestIds
from producer.gateway.responses import EventsResponse, GenerationResponse
from producer.gateway.state import Gateway, GatewayConfig
from schemas.messages import REQUEST_ID_RE


async def health(request: Request) -> JSONResponse:
    """200 while some pool is ready, else 503 with the reason: for load balancers."""
    gateway: Gateway = request.app.state.gateway
    ready = gateway.pools.ready()
    if ready:
        return JSONResponse({"status": "ok", "pools": [p.name for p in ready]})
    return JSONResponse({"status": "unavailable", "reason": gateway.pools.problem}, 503)


def _model_cards(gateway: Gateway) -> dict[str, dict[str, object]]:
    cards: dict[str, dict[str, object]] = {}
    for pool in gateway.pools.ready():
        cards.setdefault(
            pool.model,
            {
                "id": pool.model,
                "object": "model",
                "created": pool.created,
                "owned_by": "npu-pool",
                "max_model_len": pool.max_model_len,
            },
        )
    return cards


async def list_models(request: Request) -> JSONResponse:
    """`GET /v1/models`: the models of the ready pools."""
    cards = _model_cards(request.app.state.gateway)
    return JSONResponse({"object": "list", "data": list(cards.values())})


async def get_model(request: Request) -> JSONResponse:
    """`GET /v1/models/{model}`: one served model, or 404."""
    name = request.path_params["model"]
    card = _model_cards(request.app.state.gateway).get(name)
    if card is None:
        raise ApiError(404, f"The model `{name}` does not exist", "model", "model_not_found")
    return JSONResponse(card)


async def completions(request: Request) -> GenerationResponse:
    """`POST /v1/completions`."""
    return await generate(request, "completion")


async def chat_completions(request: Request) -> GenerationResponse:
    """`POST /v1/chat/completions`."""
    return await generate(request, "chat")


def _path_request_id(request: Request) -> str:
    """The request id of a `/v1/requests/{id}/...` path (400 if it is not one); the
    response's X-Request-Id names it."""
    request_id: str = request.path_params["request_id"]
    if not REQUEST_ID_RE.match(request_id):
        raise ApiError(
            400, f"request id must match [A-Za-z0-9._:-]{{1,128}} (got {request_id!r:.60})"
        )
    request.state.request_id = request_id
    return request_id


async def events(request: Request) -> EventsResponse:
    """`GET /v1/requests/{id}/events`: a result stream as SSE, after `Last-Event-ID` if given."""
    gateway: Gateway = request.app.state.gateway
    request_id = _path_request_id(request)
    last = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    try:
        after_seq = -1 if last in (None, "") else int(last)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ApiError(400, f"Last-Event-ID must be a chunk seq (got {last!r:.40})") from exc
    sub = gateway.client.subscribe(request_id)
    return EventsResponse(sub, after_seq, gateway.config.keepalive_s)


async def cancel(request: Request) -> JSONResponse:
    """`POST /v1/requests/{id}/cancel`: ask the pool to stop a request, queued or running;
    its stream ends `cancelled` (a finished request keeps its result)."""
    gateway: Gateway = request.app.state.gateway
    request_id = _path_request_id(request)
    await gateway.client.cancel(request_id)
    return JSONResponse({"id": request_id, "object": "request.cancel", "status": "requested"}, 202)


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    error = exc if isinstance(exc, ApiError) else ApiError(500, str(exc))
    return JSONResponse(error.body(), error.status, headers=error.headers)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
    error = ApiError(status, f"{detail}: {request.method} {request.url.path}")
    return JSONResponse(error.body(), status)


def create_app(config: GatewayConfig) -> ASGIApp:
    """The gateway as an ASGI app (its pool watch and client live with its lifespan)."""
    gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await gateway.pools.start()
        try:
            yield
        finally:
            await gateway.pools.stop()
            await gateway.client.close()

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", list_models),
            Route("/v1/models/{model:path}", get_model),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/requests/{request_id}/events", events),
            Route("/v1/requests/{request_id}/cancel", cancel, methods=["POST"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error},
        lifespan=lifespan,
    )
    app.state.gateway = gateway
    return GatewayMetrics(RequestIds(app, config.api_keys, config.key_tenants))
