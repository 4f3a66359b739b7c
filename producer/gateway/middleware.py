"""ASGI middleware of the gateway: X-Request-Id on every request and response, API keys and
the tenant each key maps to."""

from __future__ import annotations

import hmac
import uuid

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from producer.gateway.errors import ApiError
from schemas.keys import DEFAULT_TENANT
from schemas.messages import REQUEST_ID_RE

REQUEST_ID_HEADER = "x-request-id"


class RequestIds:
    """ASGI middleware: a valid X-Request-Id on every request and response, and API keys;
    the request's tenant (`state["tenant"]`) is its key's (`default` for a key no tenant
    names, or with no keys)."""

    def __init__(
        self, app: ASGIApp, api_keys: list[str], key_tenants: dict[str, str] | None = None
    ) -> None:
        self.app = app
        tenants = key_tenants or {}
        self.api_keys = [(k.encode(), tenants.get(k, DEFAULT_TENANT)) for k in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        request_id = given or uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["tenant"] = DEFAULT_TENANT

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":  # a route may name the request it serves
                request_id_now = str(state.get("request_id", request_id)).encode()
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id_now),
                ]
            await send(message)

        error = None
        if given and not REQUEST_ID_RE.match(given):
            error = ApiError(
                400, f"header X-Request-Id: must match [A-Za-z0-9._:-]{{1,128}} (got {given!r:.60})"
            )
            state["request_id"] = uuid.uuid4().hex
        elif self.api_keys and scope["path"] != "/health":
            tenant = self._tenant_of(headers)
            if tenant is None:
                error = ApiError(401, "Incorrect API key provided", code="invalid_api_key")
            else:
                state["tenant"] = tenant
        if error is not None:
            await JSONResponse(error.body(), error.status)(scope, receive, send_with_id)
            return
        await self.app(scope, receive, send_with_id)

    def _tenant_of(self, headers: dict[bytes, bytes]) -> str | None:
        """The tenant of the request's Bearer key; None if it has no key this gateway takes.
        Every key is compared (in constant time), so timing says nothing of which matched."""
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        found = None
        for key, tenant in self.api_keys:
            if hmac.compare_digest(token.strip(), key):
                found = tenant
        return found
