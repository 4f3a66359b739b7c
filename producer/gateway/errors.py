"""Errors in OpenAI's format: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from schemas.messages import ResultChunk

# OpenAI's error `type` for each status the gateway answers with.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}
RETRY_AFTER_S = 1
_FIELD = re.compile(r"field `([^`]+)`")
_NAMED = re.compile(r"`(\w+)`|(\w+)=")


class ApiError(Exception):
    """An HTTP error answer: status, message, and the request field at fault if any."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI clients parse."""
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def from_validation(exc: ValidationError, renames: dict[str, str] | None = None) -> ApiError:
    """A 400 naming the first bad field (`sampling.top_p` is reported as `top_p`)."""
    renames = renames or {}
    parts, first = [], None
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"] if p != "sampling"]
        named = _NAMED.search(err["msg"])  # a check across fields names them in its message
        where = ".".join(loc) or (named.group(1) or named.group(2) if named else "body")
        where = renames.get(where, where)
        first = first or where.split(".")[0]
        value = err.get("input")
        shown = "" if isinstance(value, (dict, list)) else f" (got {value!r:.60})"
        parts.append(f"field `{where}`: {err['msg']}{shown}")
    return ApiError(400, "; ".join(parts), param=first, code="invalid_request")


def from_final_chunk(chunk: ResultChunk, renames: dict[str, str] | None = None) -> ApiError | None:
    """The HTTP error a final chunk stands for; None for stop, length and cancelled."""
    reason = chunk.finish_reason
    error = chunk.error
    message = error.message if error else f"request ended {reason}"
    code = error.code if error else None
    if reason == "rejected":
        if code == "queue_full":
            return ApiError(429, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})
        found = _FIELD.search(message)
        param = found.group(1).removeprefix("sampling.") if found else None
        param = (renames or {}).get(param or "", param)
        return ApiError(400, message, param=param, code=code)
    if reason == "timeout":
        message = error.message if error else "the request passed its deadline_ms unfinished"
        return ApiError(504, message, code=code or "timeout")
    if reason == "error":
        return ApiError(500, message, code=code)
    return None
