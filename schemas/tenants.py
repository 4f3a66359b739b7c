"""Tenants: the services that share a pool, each with its weight and quotas (one TOML file,
docs/architecture.md §3a), and the request streams their requests queue on.

    [tenants.analytics]
    weight = 1            # share while others are waiting
    max_queue = 1000      # queued requests
    max_running = 64      # running at once
    api_keys = ["..."]    # gateway keys that map to it

A request that names no tenant is `default`'s, which is always allowed (weight 1, no quota
of its own unless the file gives it a table). Without a file any tenant name is allowed
and every tenant has weight 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, cast

import tomllib
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from schemas.keys import DEFAULT_TENANT, PRIORITY_CLASSES, Keys, stream_class
from schemas.messages import TENANT_PATTERN

TenantName = Annotated[str, Field(pattern=TENANT_PATTERN)]
# Streams a namespace may hold for tenants other than `default` (19 classes each at most):
# admission refuses a new one past this, so random names cannot grow every intake's work.
MAX_TENANT_STREAMS = 4096


class Tenant(BaseModel):
    """One tenant's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weight: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    max_queue: int | None = Field(default=None, ge=1)
    max_running: int | None = Field(default=None, ge=1)
    api_keys: tuple[Annotated[str, Field(min_length=1)], ...] = ()


class Tenants(BaseModel):
    """A tenants file: its tables by tenant name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenants: dict[TenantName, Tenant] = Field(min_length=1)

    @model_validator(mode="after")
    def _keys_once(self) -> Tenants:
        seen: dict[str, str] = {}
        for name, tenant in self.tenants.items():
            for key in tenant.api_keys:
                if key in seen:
                    raise ValueError(f"an API key is given to both {seen[key]!r} and {name!r}")
                seen[key] = name
        return self

    def get(self, name: str) -> Tenant | None:
        """The tenant's settings: None if the file does not allow it (`default` always is)."""
        found = self.tenants.get(name)
        if found is None and name == DEFAULT_TENANT:
            return Tenant()
        return found

    def by_api_key(self) -> dict[str, str]:
        """API key -> tenant."""
        return {key: name for name, t in self.tenants.items() for key in t.api_keys}


class TenantsFileError(ValueError):
    """A tenants file that cannot be read or breaks a rule: the message says where."""


def load_tenants(path: str | Path) -> Tenants:
    """Read and check a tenants file; raises TenantsFileError naming the file and field."""
    try:
        with open(path, "rb") as f:
            raw: dict[str, Any] = tomllib.load(f)
    except OSError as exc:
        raise TenantsFileError(f"tenants file {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise TenantsFileError(f"tenants file {path}: not TOML: {exc}") from exc
    try:
        return Tenants.model_validate(raw)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"]) or "the file"
        message = error["msg"].removeprefix("Value error, ")
        raise TenantsFileError(f"tenants file {path}: {where}: {message}") from None


def request_streams(client: Any, keys: Keys) -> list[str]:
    """Every request stream of the namespace: each class's (`default`'s) and the tenants'
    streams in use, highest class first."""
    registered = cast(dict[bytes, bytes], client.hgetall(keys.queues))
    return order_streams(keys, (bytes(s).decode() for s in registered))


def stream_owners(client: Any, keys: Keys) -> dict[str, str]:
    """Every request stream of the namespace -> the tenant whose requests it holds."""
    registered = cast(dict[bytes, bytes], client.hgetall(keys.queues))
    owners = dict.fromkeys(keys.request_streams, DEFAULT_TENANT)
    owners.update({bytes(s).decode(): bytes(t).decode() for s, t in registered.items()})
    return owners


def order_streams(keys: Keys, tenant_streams: Iterable[str]) -> list[str]:
    """`default`'s class streams with `tenant_streams`, highest class first (`default`'s
    first within a class)."""
    by_class: dict[int, list[str]] = {c: [keys.request_stream(c)] for c in PRIORITY_CLASSES}
    for stream in sorted(tenant_streams):
        by_class.setdefault(stream_class(stream), []).append(stream)
    return [s for c in PRIORITY_CLASSES for s in by_class[c]]
