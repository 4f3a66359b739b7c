"""The gateway's own metrics on `GET /metrics` (Prometheus' text format): requests by route
and status, those in flight, and how long answers took, under `npupool_gateway_*` names."""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Route templates, so that request ids never become label values.
ROUTES = (
    ("/v1/chat/completions", "/v1/chat/completions"),
    ("/v1/completions", "/v1/completions"),
    ("/v1/models", "/v1/models"),
    ("/v1/requests/", "/v1/requests/{id}"),
    ("/health", "/health"),
    ("/metrics", "/metrics"),
)
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def route_of(path: str) -> str:
    """The route template a path belongs to; `other` for none."""
    for prefix, route in ROUTES:
        if path.startswith(prefix):
            return route + ("/cancel" if path.endswith("/cancel") and "{id}" in route else "")
    return "other"


class GatewayMetrics:
    """ASGI middleware that counts every HTTP request, and serves them on `/metrics`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "npupool_gateway_requests",
            "HTTP requests answered, by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "npupool_gateway_in_flight",
            "HTTP requests being answered (streams included)",
            registry=self.registry,
        )
        self.seconds = Histogram(
            "npupool_gateway_request_seconds",
            "time from a request to the end of its answer, by route",
            ["route"],
            buckets=BUCKETS,
            registry=self.registry,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_of(scope["path"])
        if route == "/metrics":
            await self._serve(send)
            self.requests.labels(route, "200").inc()
            return
        status = 500
        started = time.perf_counter()

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.in_flight.inc()
        try:
            await self.app(scope, receive, watched)
        finally:
            self.in_flight.dec()
            self.requests.labels(route, str(status)).inc()
            self.seconds.labels(route).observe(time.perf_counter() - started)

    async def _serve(self, send: Send) -> None:
        body = generate_latest(self.registry)
        headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
