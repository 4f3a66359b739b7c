"""The one msgpack codec: models in, bytes out, with a schema version check on the way in."""

from __future__ import annotations

from typing import Any, TypeVar

import msgpack
from pydantic import BaseModel, ValidationError

from schemas.messages import REQUEST_ID_RE, SCHEMA_VERSION, GenerateRequest

M = TypeVar("M", bound=BaseModel)


class CodecError(ValueError):
    """Bytes that are not a message of the expected kind."""


class DeadLetter(CodecError):
    """A request entry with no usable id: it goes to `{ns}:dead` with this reason."""


class Rejected(CodecError):
    """A request entry with a usable id but a bad field: it gets a final `rejected` chunk."""

    def __init__(self, request_id: str, code: str, message: str, prompt_tokens: int = 0) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.code = code
        self.message = message
        self.prompt_tokens = prompt_tokens  # for the chunk's usage, when the prompt was read


def encode(message: BaseModel) -> bytes:
    """Serialise a wire or control model to msgpack."""
    return msgpack.packb(message.model_dump(mode="python"), use_bin_type=True)


def decode(cls: type[M], raw: bytes) -> M:
    """Parse msgpack bytes into `cls`, raising CodecError with the reason."""
    data = _unpack_map(raw)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise CodecError(f"not a valid {cls.__name__}: {_describe(exc)}") from exc


def decode_request(raw: bytes, max_request_bytes: int) -> GenerateRequest:
    """Parse a request entry, sorting failures into DeadLetter and Rejected."""
    try:
        data = _unpack_map(raw)
    except CodecError as exc:
        raise DeadLetter(str(exc)) from exc
    request_id = data.get("id")
    if not isinstance(request_id, str) or not REQUEST_ID_RE.match(request_id):
        raise DeadLetter(f"request has no usable `id` (got {request_id!r:.80})")
    if len(raw) > max_request_bytes:
        raise Rejected(
            request_id,
            "too_large",
            f"request is {len(raw)} bytes, over max_request_bytes={max_request_bytes}",
        )
    version = data.get("v", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise Rejected(
            request_id,
            "unsupported_version",
            f"field `v`: unknown schema version {version!r:.40}; this pool speaks {SCHEMA_VERSION}",
        )
    try:
        return GenerateRequest.model_validate(data)
    except ValidationError as exc:
        raise Rejected(request_id, "invalid_request", _describe(exc)) from exc


def request_id_of(raw: bytes | None) -> str | None:
    """The usable `id` of a request entry's payload, if it has one."""
    try:
        request_id = _unpack_map(raw or b"").get("id")
    except CodecError:
        return None
    ok = isinstance(request_id, str) and REQUEST_ID_RE.match(request_id)
    return request_id if ok else None


def _unpack_map(raw: bytes) -> dict[str, Any]:
    try:
        # a string that is not UTF-8 is read with its bad bytes as U+DC80..U+DCFF, so the map
        # and its `id` stay readable and validation names the field (schemas/messages.py)
        data = msgpack.unpackb(
            raw, raw=False, strict_map_key=False, unicode_errors="surrogateescape"
        )
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise CodecError(f"not msgpack: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict):
        raise CodecError(f"msgpack is a {type(data).__name__}, not a map")
    return data


def _describe(exc: ValidationError) -> str:
    """One line per bad field, `field.path: what is wrong (got value)`."""
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "request"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r:.60})"
        parts.append(f"field `{where}`: {err['msg']}{shown}")
    return "; ".join(parts)
